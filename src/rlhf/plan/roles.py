"""Each role's memory on one of its devices, from the resolved run (`RunSpec`): what `rlhf.run.build` would load, sized.

A `Workload` gathers the sizes every role needs (rows, sequence length, dtype); `role_items` turns one role into
`memory.Item`s. Models are read through `rlhf.plan.architecture` (config.json only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf.training.critic import critic_init_path
from rlhf.generators.base import sleep_overrides
from rlhf.generators.memory import GenerationWork, GeneratorShape, own_copy_memory
from rlhf.models.dtypes import DTYPES
from rlhf.models.logprobs import logprob_chunk
from rlhf.micro_batches import micro_units
from rlhf.models import lora
from rlhf.plan import memory
from rlhf.plan.architecture import ModelSource, activations, lora_parameter_counts, parameter_count, read_config, text_config
from rlhf.plan.memory import FLOAT32, GENERATE, SCORE, TRAIN, Item, Sharding
from rlhf.config.spec import RunSpec
from rlhf.parts import Part, choose

# gradients alive at once in the backward of the largest kept tensor (the output layer's logits: the gradients of
# the log-softmax, of the entropy, their sum and the logits' own): about 4x its bytes, measured on a 30M Llama
BACKWARD_COPIES = 4
# what compiled decoder blocks (`policy.compile`) keep for the backward, as a share of what the eager blocks keep:
# inductor recomputes the cheap elementwise work instead of saving it. Measured on an H100 (bench/GPU.md, 2026-11-26:
# Qwen2.5-0.5B shape, micro batch 16 x 512 tokens, bf16): 21.16 GiB eager, 18.07 GiB compiled, of 11.3 GiB activations.
COMPILED_ACTIVATIONS = 0.73
# with a policy.activation_memory_budget below 1 they keep less: measured at budgets 0.5 and 0.3 (the same shape,
# bench/GPU.md 2026-11-27 second lease: 18.14 GiB without a budget, 15.69 and 15.35 GiB with, so 0.51 and 0.48 of the
# eager activations). (budget, share) points: the plan interpolates between them, and below the smallest keeps its
# share (an upper bound: a smaller budget keeps no more)
BUDGET_ACTIVATIONS = ((0.3, 0.48), (0.5, 0.51), (1.0, COMPILED_ACTIVATIONS))


def compiled_share(budget: float | None) -> float:
    """The share of the eager blocks' activations that compiled blocks keep at `policy.activation_memory_budget`
    ``budget`` (null: torch's default, 1.0), from the measured `BUDGET_ACTIVATIONS`."""
    budget = 1.0 if budget is None else budget
    (low, low_share), *_ = BUDGET_ACTIVATIONS
    if budget <= low:
        return low_share
    for (b0, s0), (b1, s1) in zip(BUDGET_ACTIVATIONS, BUDGET_ACTIVATIONS[1:]):
        if budget <= b1:
            return s0 + (s1 - s0) * (budget - b0) / (b1 - b0)
    return BUDGET_ACTIVATIONS[-1][1]


@dataclass(frozen=True)
class Workload:
    """The sizes of one step that decide memory (derived from the config, never written back)."""

    micro_rows: int  # sequences per training forward/backward on one rank
    score_rows: int  # sequences per no-grad scoring forward (train.micro_batch_size, at most a step's samples)
    generate_rows: int  # sequences one generate call holds (hf: generator.batch_size, capped by the step's samples)
    seq_len: int  # prompt + response tokens of the longest row
    window: int  # positions whose logits the loss needs (the response, plus one)
    dtype: str  # model.dtype: the generator's and frozen models' weights; bf16/fp16 = autocast when training
    device_kind: str  # cuda or cpu
    sleeps_generator: bool  # the schedule puts the generator to sleep while training (schedule=hybrid)
    offload_while_generating: bool  # schedule.offload_optimizer: the optimiser waits on the host while generating
    precision: str = "master"  # train.mixed_precision
    logprob_chunk: int = 0  # the fused output layer's chunk on this device (`model.logprob_chunk` resolved); 0 = logits

    @property
    def dtype_bytes(self) -> int:
        return DTYPES[self.dtype].itemsize

    def compute(self, strategy: str | None) -> str:
        """How a forward computes (`rlhf.plan.architecture.activations`' mode): float32; ``bf16`` weights (a frozen
        model, ``strategy`` None; a trained one under single or fsdp2 with master weights, or DeepSpeed's bf16); or
        ``autocast`` (float32 weights: ddp, or `train.mixed_precision=autocast`)."""
        if self.dtype == "float32":
            return "float32"
        if strategy is None or strategy == "deepspeed" or (self.precision == "master" and strategy in ("single", "fsdp2")):
            return "bf16"
        return "autocast"


def workload(spec: RunSpec, ranks: dict[str, int], device_kind: str) -> Workload:
    """The `Workload` of the run ``spec`` with ``ranks`` per role."""
    env, sizes, train = spec.env, spec.sizes, spec.train
    seq_len = sizes.longest_row
    if env is not None:
        window, generate_rows = env.max_tokens, env.num_parallel
    else:
        window, generate_rows = spec.max_new_tokens + 1, sizes.samples_per_step
    generator = spec.generator
    rows_per_call = generator.trait("rows_per_call")
    if rows_per_call is not None:
        generate_rows = rows_per_call(generator.config, generate_rows)
    mini_units = max(1, sizes.mini_batch_size // ranks.get("policy", 1))
    rows_per_unit = 2 if spec.algorithm.pairwise else 1
    return Workload(
        micro_rows=micro_units(mini_units, train.micro_batch_size, rows_per_unit) * rows_per_unit,
        score_rows=min(train.micro_batch_size, sizes.samples_per_step), generate_rows=generate_rows,
        seq_len=seq_len, window=min(window, seq_len), dtype=spec.model.dtype, device_kind=device_kind,
        sleeps_generator=bool(spec.schedule.trait("sleeps_generator", False)),
        offload_while_generating=offloads_while_generating(spec.schedule),
        precision=train.mixed_precision, logprob_chunk=logprob_chunk(spec.model, torch.device(device_kind)),
    )


def sources(spec: RunSpec) -> dict[str, ModelSource]:
    """The model each role of the run ``spec`` loads, with the key that names it."""
    model = spec.model
    policy = ModelSource("model.name_or_path", model.name_or_path, model.revision, model.trust_remote_code)
    found = {"policy": policy, "generator": policy, "reference": policy}
    if spec.reference.name_or_path:
        found["reference"] = ModelSource("reference.name_or_path", spec.reference.name_or_path, None, model.trust_remote_code)
    if spec.teacher.name_or_path:
        found["teacher"] = ModelSource("teacher.name_or_path", spec.teacher.name_or_path, None, model.trust_remote_code)
    critic = critic_init_path(spec)
    critic_key = "critic.name_or_path" if spec.critic.name_or_path else "reward.path" if spec.reward.path else policy.key
    found["critic"] = ModelSource(critic_key, critic, None if critic != model.name_or_path else model.revision,
                                  model.trust_remote_code)
    if spec.reward.path:
        found["reward"] = ModelSource("reward.path", spec.reward.path, None, model.trust_remote_code)
    return found


def sharding(strategy: Part, ranks: int) -> Sharding:
    """A `Sharding` from `policy.strategy` / `critic.strategy` (``strategy``: the chosen part; auto: single on one
    rank, else ddp). Its class names what it shards like (a user's subclass of FSDP2Strategy is fsdp2); a strategy
    without ZeRO or offload keys shards and offloads nothing."""
    name, config = getattr(strategy.obj, "name", strategy.name), strategy.config
    if name == "auto":
        name = "single" if ranks == 1 else "ddp"
    return Sharding(name, ranks, getattr(config, "zero_stage", 0), bool(getattr(config, "offload_optimizer", False)),
                    bool(getattr(config, "offload_params", False)))


def trained_items(role: str, source: ModelSource, head: str, strategy, gradient_checkpointing: bool, ranks: int,
                  work: Workload, lora_cfg=None, compiled: bool = False, budget: float | None = None) -> list[Item]:
    """A trained role (policy or critic): its state, its training activations and its own scoring pass; with
    ``lora_cfg`` (`policy.lora`) only the adapters get gradients and optimiser state; ``compiled`` blocks keep
    `compiled_share` of ``budget`` (`policy.activation_memory_budget`) of the activations."""
    params = parameter_count(source, head)
    shard = sharding(choose("strategy", strategy, f"{role}.strategy"), ranks)
    mode = work.compute(shard.strategy)
    trainable, merged = lora_parameter_counts(source, lora_cfg) if lora.enabled(lora_cfg) else (params, 0)
    items = memory.trained_state(role, params, shard, work.dtype != "float32", trainable, master=mode == "bf16")
    if merged and role == "policy":  # a LoRA push: the adapted layers merged into a new copy, held while the generator loads them
        items.append(Item(role, "merged weights", FLOAT32 * merged, phases=(GENERATE,)))
    if work.sleeps_generator and work.offload_while_generating and role == "policy":
        items = [_without(i, GENERATE) if i.what == "optimizer" else i for i in items]
    window = work.window if head == "lm" else 1
    chunk = work.logprob_chunk if head == "lm" and shard.strategy in ("single", "ddp") else 0  # where the layer fuses
    act = activations(source, work.micro_rows, work.seq_len, window, mode, head, chunk)
    config = text_config(read_config(source))
    kept = act.total(config.num_hidden_layers, gradient_checkpointing)
    items.append(Item(role, "activations", int(kept * compiled_share(budget)) if compiled else kept, phases=(TRAIN,)))
    temporaries = BACKWARD_COPIES * act.largest
    if chunk:  # the fused layer's own chunk, beside the largest kept tensor's gradients
        temporaries = max(temporaries, memory.fused_chunk_bytes(min(chunk, work.micro_rows * window), config.vocab_size))
    items.append(Item(role, "backward temporaries", temporaries, phases=(TRAIN,)))
    if shard.strategy == "fsdp2" or (shard.strategy == "deepspeed" and shard.zero_stage == 3):
        # one block's weights gathered whole while it runs, and the next one prefetched (bf16 under mixed precision)
        gathered = (2 if mode == "bf16" else FLOAT32) * 2 * params // config.num_hidden_layers
        items.append(Item(role, "gathered weights", gathered, phases=(TRAIN, SCORE)))
    items.append(Item(role, "scoring temporaries", _scoring(source, head, work, mode, chunk), phases=(SCORE,)))
    return items


def frozen_items(role: str, source: ModelSource, head: str, work: Workload) -> list[Item]:
    """A model that only scores (reference, reward model): weights in `model.dtype` and its scoring pass."""
    params = parameter_count(source, head)
    chunk = work.logprob_chunk if head == "lm" else 0
    return [
        Item(role, "weights", params * work.dtype_bytes),
        Item(role, "scoring temporaries", _scoring(source, head, work, work.compute(None), chunk), phases=(SCORE,)),
    ]


def _scoring(source: ModelSource, head: str, work: Workload, mode: str, chunk: int) -> int:
    """Temporaries of a no-grad forward over ``work.score_rows`` rows, computed as ``mode`` says."""
    vocab = text_config(read_config(source)).vocab_size if head == "lm" else 0
    window = work.window if head == "lm" else 1  # the training trace's key: one trace serves both
    act = activations(source, work.score_rows, work.seq_len, window, mode, head, chunk)
    return memory.scoring_bytes(work.score_rows, work.window, vocab, act.per_layer, chunk)


def offloads_while_generating(schedule: Part) -> bool:
    """Whether the chosen ``schedule`` moves the optimiser state to the host while the generator runs (it answers)."""
    return bool(schedule.trait("offloads_while_generating", lambda config: False)(schedule.config))


def generator_items(backend: Part, source: ModelSource, work: Workload, capacity: int | None) -> list[Item]:
    """The generator (``backend``: the chosen part) on one of its devices, as the backend answers (`plan_memory`; a backend that declares none is
    taken to hold its own copy of the weights, as hf does). What it holds through training is freed while it sleeps."""
    config = text_config(read_config(source))
    heads = config.num_attention_heads
    shape = GeneratorShape(
        params=parameter_count(source, "lm"), layers=config.num_hidden_layers,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads, vocab=config.vocab_size,
    )
    generation = GenerationWork(work.generate_rows, work.seq_len, work.window, work.dtype_bytes, work.device_kind, capacity)
    needs = backend.trait("plan_memory", own_copy_memory)(backend.config, shape, generation)
    sleeps = work.sleeps_generator and sleep_overrides(backend.obj, backend.config) == []
    resident = (GENERATE,) if sleeps else memory.PHASES
    return [Item("generator", need.what, need.bytes, phases=resident if need.resident else (GENERATE,)) for need in needs]


def _without(item: Item, phase: str) -> Item:
    return Item(item.role, item.what, item.bytes, tuple(p for p in item.phases if p != phase), item.on_host)
