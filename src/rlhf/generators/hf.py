"""Generator on a transformers causal LM: left-padded batches, a KV-cached decode that drops finished rows
(`rlhf.generators.decode`), sampling or greedy."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from rlhf.errors import require
from rlhf.generators.base import (
    GeneratorConfig, SamplingParams, parameter_bytes, release_parameters, restore_parameters, runs_on_cpu,
)
from rlhf.generators.memory import FLOAT32, GenerationWork, GeneratorShape, MemoryNeed, kv_cache_bytes, own_copy_memory
from rlhf.micro_batches import halvings
from rlhf.generators.continuous import ContinuousBatch, Continued, Request, continue_by_generate
from rlhf.generators.decode import decode
from rlhf.generators.shared_prefill import SHARE_MODES, PromptGroups, prompt_groups, shares
from rlhf.generators.static_decode import StaticDecoder, attention_window, bucket_for, cache_columns, unsupported
from rlhf.models.grouped_attention import use_generator_attention
from rlhf.models.loading import load_causal_lm
from rlhf.registry import register
from rlhf.trajectory import Trajectories, concat, from_completions, left_pad
from rlhf.models.fingerprint import fingerprint

log = logging.getLogger("rlhf")


def stop_token_id(tokenizer, stop_token: str) -> int:
    """The id that ends a response: the tokenizer's EOS for ``eos``, else the id of that literal token; ConfigError
    naming `generator.stop_token` when there is none."""
    if stop_token == "eos":
        require(tokenizer.eos_token_id is not None,
                "generator.stop_token=eos but the tokenizer has no EOS token; name a stop token")
        return int(tokenizer.eos_token_id)
    token_id = tokenizer.convert_tokens_to_ids(stop_token)
    require(token_id is not None and token_id != tokenizer.unk_token_id,
            f"generator.stop_token={stop_token!r} is not a single token of this tokenizer; set a token of its "
            f"vocabulary" + (f" (e.g. {tokenizer.eos_token!r}), or eos" if tokenizer.eos_token else ""))
    return int(token_id)


def truncate_at_stop(tokens: torch.Tensor, stop_id: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cut each response after its first stop token. Shape: (B, L) -> (ids (B, L), mask (B, L), stopped (B,)).

    The stop token itself stays (mask 1) so the policy learns to emit it; what follows becomes padding.
    """
    is_stop = tokens == stop_id
    stopped = is_stop.any(dim=1)
    # index of the first stop token, or L when there is none
    first = torch.where(stopped, is_stop.float().argmax(dim=1), torch.full_like(stopped, tokens.shape[1], dtype=torch.long))
    positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
    mask = (positions <= first.unsqueeze(1)).float()
    return torch.where(mask.bool(), tokens, torch.full_like(tokens, pad_id)), mask, stopped


DECODES = ("auto", "eager", "static")


@dataclass
class HfGeneratorConfig(GeneratorConfig):
    batch_size: int = 512  # sequences decoded together, to bound memory (more: calls of prompts of similar length)
    compile: bool = False  # torch.compile the one-token decode steps (the prompt pass stays eager); the first calls pay the compile
    decode: str = "auto"  # eager (growing cache, a row leaves the step it stops), static (preallocated cache, fixed-shape step per bucket), auto (static on CUDA and with generator.compile, else eager; eager for a model static cannot serve)
    buckets: list[int] | None = None  # static decode: the batch sizes a step runs at (rows padded up to the next); the largest must hold generator.batch_size; null: with CUDA graphs the powers of 2 below generator.batch_size and itself (one graph each), else every batch size (no padded rows)
    graphs: bool | None = None  # static decode: record each bucket's step as a CUDA graph and replay it (null: on CUDA yes, on CPU no)
    grouped_decode: bool = True  # the generator's own attention (rlhf.models.grouped_attention): grouped-query models (fewer key/value than query heads) decode without copying the cache to every query head, and the static decode prefills prompts packed; false: transformers' SDPA as is
    check_every: int | None = None  # static decode: steps between looks at which rows stopped (the end, or a move to a smaller bucket); null: 8 on CUDA (a look waits for the GPU), 2 on CPU
    share_prompt_prefill: str = "auto"  # rows holding the same prompt token for token (a group's samples) run its prompt pass once: true, false, auto (when the prompt tokens it saves per row x the model's parameters reach 2M; rlhf.generators.shared_prefill)

    def check(self, at: str) -> None:
        super().check(at)
        require(self.batch_size >= 1, f"{at}.batch_size={self.batch_size} must be >= 1")
        require(self.decode in DECODES, f"{at}.decode={self.decode} must be one of {', '.join(DECODES)}")
        require(self.buckets is None or (len(self.buckets) > 0 and all(b >= 1 for b in self.buckets)),
                f"{at}.buckets={self.buckets and list(self.buckets)} must list batch sizes >= 1 (or be null)")
        require(self.check_every is None or self.check_every >= 1, f"{at}.check_every={self.check_every} must be >= 1 (or null)")
        require(str(self.share_prompt_prefill).lower() in SHARE_MODES,
                f"{at}.share_prompt_prefill={self.share_prompt_prefill} must be one of {', '.join(SHARE_MODES)}")
        require(not (self.graphs and self.decode == "eager"),
                f"{at}.graphs=true records the static decode's steps: set {at}.decode=static (or auto), or {at}.graphs=null")


def static_decode_on(config: HfGeneratorConfig, device: torch.device) -> tuple[bool, bool, int]:
    """(static decode, CUDA graphs, steps between looks) for this generator on ``device``: `generator.decode`,
    `generator.graphs` and `generator.check_every` with their `auto`/null resolved (`generator.buckets`: `buckets`).
    `auto` is static on CUDA, and on CPU when `generator.compile` is on: compiled, the static step runs 1.6-2.0x the
    compiled eager loop and 2.0-2.3x the eager one on the 3M model of `bench/generate.py`. Uncompiled it runs 1.2x the
    eager loop there, but samples by another draw (the exponential race): the eager loop stays the CPU's default, so
    seeded CPU runs and the recorded curves keep their samples. Graphs on CUDA."""
    cuda = device.type == "cuda"
    static = config.decode == "static" or (config.decode == "auto" and (cuda or config.compile))
    graphs = static and (config.graphs if config.graphs is not None else cuda)
    return static, graphs, config.check_every or (8 if cuda else 2)


def buckets(config: HfGeneratorConfig, graphs: bool) -> tuple[int, ...] | None:
    """The batch sizes the static decode's steps run at: `generator.buckets`; null: with CUDA graphs the powers of 2
    below `generator.batch_size` and the batch size itself (each bucket records a graph), else None: every batch size
    runs as it is (one compiled step serves them all, so no row is padded and every look that finds a row stopped
    moves the rest to a smaller batch). Buckets that do not hold `generator.batch_size` are refused here, where they
    are read (`check_run` reads them where the run's static decode will), never for the eager loop, which ignores them
    (`decode=auto` on a CPU without `generator.compile`)."""
    if config.buckets is not None:
        require(max(config.buckets) >= config.batch_size,
                f"generator.buckets={list(config.buckets)} do not cover generator.batch_size={config.batch_size} (the "
                f"static decode runs here): add a bucket of at least {config.batch_size}, lower generator.batch_size, "
                f"or decode eagerly (generator.decode=eager)")
        return tuple(sorted(config.buckets))
    if not graphs:
        return None
    size = config.batch_size
    return tuple(2**i for i in range(size.bit_length()) if 2**i < size) + (size,)


@register("generator", "hf")
class HFGenerator:
    """Samples with its own copy of the policy weights, refreshed by `update_weights` after each step."""

    config = HfGeneratorConfig

    @staticmethod
    def plan_memory(config: HfGeneratorConfig, model: GeneratorShape, work: GenerationWork) -> list[MemoryNeed]:
        """The eager loop: its own weights, a KV cache and logits while generating (`own_copy_memory`). The static
        decode keeps its buffers between calls: a cache of the bucket's rows x every column a call needs, and a step's
        (rows, vocabulary) float32 temporaries (logits, probabilities, noise), once per recorded graph (their pools
        add up to about twice the largest bucket's)."""
        static, graphs, _ = static_decode_on(config, torch.device(work.device_kind))
        if not static:
            return own_copy_memory(config, model, work)
        rows = bucket_for(min(work.rows, config.batch_size), buckets(config, graphs))
        columns = cache_columns(work.seq_len)
        step = 3 * rows * model.vocab * FLOAT32 * (2 if graphs else 1)
        return [
            MemoryNeed("weights", model.params * work.dtype_bytes, resident=True),
            MemoryNeed("static_kv_cache", kv_cache_bytes(model.layers, model.kv_heads, model.head_dim, rows * columns, work.dtype_bytes), resident=True),
            MemoryNeed("decode_step", step, resident=graphs),
        ]

    @staticmethod
    def rows_per_call(config: HfGeneratorConfig, rows: int) -> int:
        """Rows decoded together: at most `batch_size`."""
        return min(rows, config.batch_size)

    @staticmethod
    def check_run(config: HfGeneratorConfig, cfg, ranks: dict[str, int]) -> None:
        """Its fit with the run: CUDA graphs need the generator on a GPU; the static decode, where it runs, needs
        buckets that hold a decode batch (`buckets`)."""
        on_cpu = runs_on_cpu(cfg)
        require(
            not (config.graphs and on_cpu),
            f"generator.graphs=true records CUDA graphs, but this run's generator is on the CPU (cluster.device="
            f"{cfg.cluster.device}, cluster.device_type={cfg.cluster.get('device_type')}): set generator.graphs=null, "
            "or run on a GPU",
        )
        static, graphs, _ = static_decode_on(config, torch.device("cpu" if on_cpu else "cuda"))
        if static:
            buckets(config, graphs)

    @staticmethod
    def memory_advice(config: HfGeneratorConfig, shares_devices: bool, rows: int) -> list[list[str]]:
        """Smaller decode batches, largest first."""
        return [[f"generator.batch_size={size}"] for size in halvings(min(config.batch_size, rows))]

    def __init__(self, cfg, model_cfg, tokenizer, device: torch.device) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.device = device
        self.model = load_causal_lm(
            model_cfg.name_or_path, model_cfg.dtype, model_cfg.revision, model_cfg.trust_remote_code, device
        ).eval()
        self.model.requires_grad_(False)
        self.params = sum(p.numel() for p in self.model.parameters())  # the scale of a prompt token's work (`shares`)
        # one-token steps of a grouped-query model read the cache as it is (no per-head copy); the static decode's
        # prompt pass runs packed
        if cfg.grouped_decode:
            use_generator_attention(self.model)
        static, graphs, check_every = static_decode_on(cfg, device)
        reason = unsupported(self.model.config) if static and cfg.decode == "auto" else None
        if reason:  # `auto` picks the eager loop for a model the static decode cannot serve; `static` is refused
            log.info("generator: decode=auto runs the eager loop: the static decode cannot serve this model (%s)", reason)
            static = False
        # `generator.decode=static`: preallocated buffers and one fixed-shape step per bucket, compiled and recorded
        # as CUDA graphs as asked; it reads the weights where they live, so pushes reach it
        self.static = StaticDecoder(self.model, buckets(cfg, graphs), check_every, cfg.compile, graphs) if static else None
        # `generator.compile` for the eager loop: its one-token steps through torch.compile (the prompt pass stays
        # eager). The same module and weights, so pushes and sleep/wake reach it; dynamic shapes, so rows leaving the
        # batch and the cache growing reuse one graph
        self.step_model = torch.compile(self.model, dynamic=True) if cfg.compile and not static else None
        self.stop_id = stop_token_id(tokenizer, cfg.stop_token)
        self.pad_id = int(tokenizer.pad_token_id)

        self._shapes: dict[str, torch.Size] | None = None  # set while asleep: the released parameters' shapes
        self.freed_bytes = 0  # what the last sleep released
        self._continuous: ContinuousBatch | None = None  # schedule=stream's rows in flight; new weights drop them
        self.last_metrics: dict[str, float] = {}  # the last `generate` call's prompt passes (`shared_groups`)

    @torch.no_grad()
    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load ``state_dict``: every weight, or some of them (a LoRA policy's adapted layers; the rest stay)."""
        if self._continuous is not None:
            self._continuous.clear()  # rows in flight are read again under the new weights (the buffers stay)
        if self._shapes is not None:
            self.wake_up(state_dict)
            return
        unexpected = self.model.load_state_dict(state_dict, strict=False).unexpected_keys
        if unexpected:
            raise KeyError(f"the generator's model has no weights named {unexpected[:3]}: pushed from another model?")

    def sleep(self) -> None:
        """Free the weights (and the static decode's cache and graphs, which read them) until `wake_up` brings new
        ones."""
        self.freed_bytes = self.resident_bytes()
        self._continuous = None
        self._shapes = release_parameters(self.model)
        if self.static is not None:
            self.static.free()

    @torch.no_grad()
    def wake_up(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Reallocate the weights and load ``state_dict``, every one of them, into them (the freed values are gone)."""
        if self._shapes is None:
            raise RuntimeError("wake_up() without sleep()")
        restore_parameters(self.model, self._shapes)
        self._shapes = None
        self.model.load_state_dict(state_dict, strict=True)

    @property
    def asleep(self) -> bool:
        return self._shapes is not None

    def weight_fingerprints(self) -> list[dict[str, float]]:
        """[`rlhf.models.fingerprint.fingerprint` of the weights it holds now]: one engine."""
        if self.asleep:
            raise RuntimeError("the generator is asleep: it holds no weights to fingerprint")
        return [fingerprint(self.model.state_dict())]

    def expected_fingerprint(self, state_dict: dict[str, torch.Tensor]) -> dict[str, float]:
        """The fingerprint it holds after loading ``state_dict``: each tensor rounded to its weights' dtype."""
        return fingerprint(state_dict, next(self.model.parameters()).dtype)

    def resident_bytes(self) -> int:
        """Bytes of weights this generator holds now (0 while asleep)."""
        return parameter_bytes(self.model)

    def continue_rows(self, requests: list[Request], sampling: SamplingParams, steps: int) -> list[Continued]:
        """schedule=stream: each row continued by up to ``steps`` tokens from the KV cache it left in this generator
        (`rlhf.generators.continuous`); a row it does not hold, or holds from older weights, is read first. A model
        the slot cache cannot serve (`static_decode.unsupported`: flash attention, sliding-window layers; or any
        `attention_window`: rows grow past it) continues through `generate` on each row's tokens instead."""
        if self.asleep:
            raise RuntimeError("the generator is asleep; wake_up() it with the new weights before generating")
        if unsupported(self.model.config) or attention_window(self.model.config):
            return continue_by_generate(self, requests, sampling, steps)
        if self._continuous is None:
            self._continuous = ContinuousBatch(self.model)
        return self._continuous.run(requests, sampling, steps, self.stop_id, self.pad_id)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> Trajectories:
        if self.asleep:
            raise RuntimeError("the generator is asleep; wake_up() it with the new weights before generating")
        size = self.cfg.batch_size
        groups = prompt_groups(prompts)
        share = shares(str(self.cfg.share_prompt_prefill).lower(), prompts, groups, self.params)
        self.last_metrics = {"generator/prefilled_prompts": float(groups.rows), "generator/alone_rows": 0.0}
        if len(prompts) <= size:
            return self._generate_chunk(prompts, sampling, share)
        # several decode calls: prompts of similar length share one (less left padding), and a shared prefill keeps
        # the rows of one prompt together; rows come back in order
        key = (lambda i: (len(prompts[i]), int(groups.owner[i]))) if share else (lambda i: len(prompts[i]))
        order = sorted(range(len(prompts)), key=key)
        chunks = [self._generate_chunk([prompts[i] for i in order[start : start + size]], sampling, share)
                  for start in range(0, len(prompts), size)]
        return concat(chunks, self.pad_id).select(torch.argsort(torch.tensor(order)))

    def _generate_chunk(self, prompts: list[list[int]], sampling: SamplingParams, share: bool = False) -> Trajectories:
        """One decode (`rlhf.generators.decode`): exactly the sampling asked for, whatever the model folder's own
        generation_config.json says (no repetition penalty or minimum length can make rollouts differ from the
        policy being trained). ``share``: each distinct prompt of the chunk prefilled once (`shared_groups`)."""
        query_ids, query_mask = left_pad(prompts, self.pad_id)
        query_ids, query_mask = query_ids.to(self.device), query_mask.to(self.device)
        groups = self.shared_groups(prompts) if share else None
        # a model whose attention is windowed (`attention_window`) decodes statically only while rows fit the window
        if self.static is not None and self.static.serves(query_ids.shape[1] + sampling.max_new_tokens):
            raw, logprobs = self.static.decode(query_ids, query_mask, sampling, self.stop_id, self.pad_id, groups)
        else:
            raw, logprobs = decode(self.model, query_ids, query_mask, sampling, self.stop_id, self.pad_id, self.step_model, groups)
        response_ids, response_mask, stopped = truncate_at_stop(raw, self.stop_id, self.pad_id)
        return from_completions(query_ids, query_mask, response_ids, response_mask, logprobs * response_mask, stopped)

    def shared_groups(self, prompts: list[list[int]]) -> PromptGroups | None:
        """The distinct prompts of one decode chunk, for a shared prefill (None when no prompt repeats), added to
        `last_metrics`: ``generator/prefilled_prompts`` counts prompt passes run, ``generator/alone_rows`` the rows
        prefilled alone because no other row of their chunk held their prompt token for token (a group whose rows
        differ, or one split across `generator.batch_size` chunks)."""
        groups = prompt_groups(prompts)
        metrics = self.last_metrics
        metrics["generator/prefilled_prompts"] -= groups.rows - groups.distinct
        metrics["generator/alone_rows"] += groups.alone()
        if groups.distinct == groups.rows:
            return None
        return groups.to(self.device)
