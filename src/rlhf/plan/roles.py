"""Each role's memory on one of its devices, from the composed config: what `rlhf.run.build` would load, sized.

A `Workload` gathers the sizes every role needs (rows, sequence length, dtype); `role_items` turns one role into
`memory.Item`s. Models are read through `rlhf.plan.architecture` (config.json only).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhf.training.critic import critic_init_path
from rlhf.generators.base import sleep_overrides
from rlhf.generators.memory import GenerationWork, GeneratorShape, own_copy_memory
from rlhf.models.dtypes import DTYPES
from rlhf.models import lora
from rlhf.plan import memory
from rlhf.plan.architecture import ModelSource, activations, lora_parameter_counts, parameter_count, read_config, text_config
from rlhf.plan.memory import FLOAT32, GENERATE, SCORE, TRAIN, Item, Sharding
from rlhf.parts import Part, choose
from rlhf.registry import schedule_trait

# gradients alive at once in the backward of the largest kept tensor (the output layer's logits: the gradients of
# the log-softmax, of the entropy, their sum and the logits' own): about 4x its bytes, measured on a 30M Llama
BACKWARD_COPIES = 4


@dataclass(frozen=True)
class Workload:
    """The sizes of one step that decide memory (derived from the config, never written back)."""

    micro_rows: int  # sequences per training forward/backward on one rank
    score_rows: int  # sequences per no-grad scoring forward (train.micro_batch_size)
    generate_rows: int  # sequences one generate call holds (hf: generator.batch_size, capped by the step's samples)
    seq_len: int  # prompt + response tokens of the longest row
    window: int  # positions whose logits the loss needs (the response, plus one)
    dtype: str  # model.dtype: the generator's and frozen models' weights; bf16/fp16 = autocast when training
    device_kind: str  # cuda or cpu
    sleeps_generator: bool  # the schedule puts the generator to sleep while training (schedule=hybrid)
    offload_while_generating: bool  # schedule.offload_optimizer: the optimiser waits on the host while generating

    @property
    def dtype_bytes(self) -> int:
        return DTYPES[self.dtype].itemsize

    @property
    def autocast(self) -> bool:
        return self.dtype != "float32"


def workload(cfg, sizes, ranks: dict[str, int], device_kind: str, rows_per_unit: int) -> Workload:
    """The `Workload` of a composed config with its derived sizes and ranks per role."""
    if cfg.env.name:
        seq_len, window = cfg.env.max_tokens, cfg.env.max_tokens
        generate_rows = cfg.env.num_parallel
    else:
        seq_len, window = cfg.dataset.max_prompt_length + cfg.generator.max_new_tokens, cfg.generator.max_new_tokens + 1
        generate_rows = sizes.samples_per_step
    generator = generator_part(cfg)
    rows_per_call = generator.trait("rows_per_call")
    if rows_per_call is not None:
        generate_rows = rows_per_call(generator.config, generate_rows)
    mini_units = max(1, sizes.mini_batch_size // ranks.get("policy", 1))
    micro_units = min(mini_units, max(1, cfg.train.micro_batch_size // rows_per_unit))
    return Workload(
        micro_rows=micro_units * rows_per_unit, score_rows=cfg.train.micro_batch_size, generate_rows=generate_rows,
        seq_len=seq_len, window=min(window, seq_len), dtype=cfg.model.dtype, device_kind=device_kind,
        sleeps_generator=schedule_trait(cfg.schedule, "sleeps_generator"),
        offload_while_generating=offloads_while_generating(cfg),
    )


def sources(cfg) -> dict[str, ModelSource]:
    """The model each role loads, with the key that names it."""
    model = cfg.model
    policy = ModelSource("model.name_or_path", model.name_or_path, model.revision, model.trust_remote_code)
    found = {"policy": policy, "generator": policy, "reference": policy}
    if cfg.reference.name_or_path:
        found["reference"] = ModelSource("reference.name_or_path", cfg.reference.name_or_path, None, model.trust_remote_code)
    critic = critic_init_path(cfg)
    critic_key = "critic.name_or_path" if cfg.critic.name_or_path else "reward.path" if cfg.reward.path else policy.key
    found["critic"] = ModelSource(critic_key, critic, None if critic != model.name_or_path else model.revision,
                                  model.trust_remote_code)
    if cfg.reward.path:
        found["reward"] = ModelSource("reward.path", cfg.reward.path, None, model.trust_remote_code)
    return found


def sharding(strategy, ranks: int) -> Sharding:
    """A `Sharding` from `policy.strategy` / `critic.strategy` (auto: single on one rank, else ddp)."""
    name = strategy.name
    if name == "auto":
        name = "single" if ranks == 1 else "ddp"
    return Sharding(name, ranks, strategy.zero_stage if name == "deepspeed" else 0,
                    bool(strategy.offload_optimizer), bool(strategy.offload_params))


def trained_items(role: str, source: ModelSource, head: str, strategy, gradient_checkpointing: bool, ranks: int,
                  work: Workload, lora_cfg=None) -> list[Item]:
    """A trained role (policy or critic): its state, its training activations and its own scoring pass; with
    ``lora_cfg`` (`policy.lora`) only the adapters get gradients and optimiser state."""
    params = parameter_count(source, head)
    shard = sharding(strategy, ranks)
    trainable, merged = lora_parameter_counts(source, lora_cfg) if lora.enabled(lora_cfg) else (params, 0)
    items = memory.trained_state(role, params, shard, work.autocast, trainable)
    if merged and role == "policy":  # a LoRA push: the adapted layers merged into a new copy, held while the generator loads them
        items.append(Item(role, "merged weights", FLOAT32 * merged, phases=(GENERATE,)))
    if work.sleeps_generator and work.offload_while_generating and role == "policy":
        items = [_without(i, GENERATE) if i.what == "optimizer" else i for i in items]
    window = work.window if head == "lm" else 1
    act = activations(source, work.micro_rows, work.seq_len, window, work.autocast, head)
    layers = text_config(read_config(source)).num_hidden_layers
    items.append(Item(role, "activations", act.total(layers, gradient_checkpointing), phases=(TRAIN,)))
    items.append(Item(role, "backward temporaries", BACKWARD_COPIES * act.largest, phases=(TRAIN,)))
    if shard.strategy == "fsdp2" or (shard.strategy == "deepspeed" and shard.zero_stage == 3):
        # one block's weights gathered whole while it runs, and the next one prefetched
        items.append(Item(role, "gathered weights", 2 * FLOAT32 * params // layers, phases=(TRAIN, SCORE)))
    items.append(Item(role, "scoring temporaries", _scoring(source, head, work), phases=(SCORE,)))
    return items


def frozen_items(role: str, source: ModelSource, head: str, work: Workload) -> list[Item]:
    """A model that only scores (reference, reward model): weights in `model.dtype` and its scoring pass."""
    params = parameter_count(source, head)
    return [
        Item(role, "weights", params * work.dtype_bytes),
        Item(role, "scoring temporaries", _scoring(source, head, work), phases=(SCORE,)),
    ]


def _scoring(source: ModelSource, head: str, work: Workload) -> int:
    """Temporaries of a no-grad forward over ``work.score_rows`` rows."""
    vocab = text_config(read_config(source)).vocab_size if head == "lm" else 0
    window = work.window if head == "lm" else 1  # the training trace's key: one trace serves both
    act = activations(source, work.score_rows, work.seq_len, window, work.autocast, head)
    return memory.scoring_bytes(work.score_rows, work.window, vocab, act.per_layer)


def offloads_while_generating(cfg) -> bool:
    """Whether the schedule moves the optimiser state to the host while the generator runs (it answers)."""
    schedule = choose("schedule", cfg.schedule, "schedule")
    return bool(schedule.trait("offloads_while_generating", lambda config: False)(schedule.config))


def generator_part(cfg) -> Part:
    """The generator backend the `generator` node chooses, with its typed config."""
    return choose("generator", cfg.generator, "generator")


def generator_items(cfg, source: ModelSource, work: Workload, capacity: int | None) -> list[Item]:
    """The generator on one of its devices, as the backend answers (`plan_memory`; a backend that declares none is
    taken to hold its own copy of the weights, as hf does). What it holds through training is freed while it sleeps."""
    config = text_config(read_config(source))
    heads = config.num_attention_heads
    shape = GeneratorShape(
        params=parameter_count(source, "lm"), layers=config.num_hidden_layers,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads, vocab=config.vocab_size,
    )
    generation = GenerationWork(work.generate_rows, work.seq_len, work.window, work.dtype_bytes, work.device_kind, capacity)
    backend = generator_part(cfg)
    needs = backend.trait("plan_memory", own_copy_memory)(backend.config, shape, generation)
    sleeps = work.sleeps_generator and sleep_overrides(backend.obj, backend.config) == []
    resident = (GENERATE,) if sleeps else memory.PHASES
    return [Item("generator", need.what, need.bytes, phases=resident if need.resident else (GENERATE,)) for need in needs]


def _without(item: Item, phase: str) -> Item:
    return Item(item.role, item.what, item.bytes, tuple(p for p in item.phases if p != phase), item.on_host)
