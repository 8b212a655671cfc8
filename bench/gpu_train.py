"""The trainer's speed, change by change: GRPO training passes of a Qwen2.5-0.5B-shaped model on synthetic rows
(no generation), under today's path and each of the trainer's speed changes alone and together. Run by
`bench/gpu_check.py` (section ``train``); its CPU form runs in CI at tiny scale.

A configuration is four switches:

- ``precision``: ``autocast`` (float32 weights, bf16 autocast: the path before) or ``master`` (bf16 weights and
  compute, float32 masters in the optimiser): `train.mixed_precision`;
- ``chunk``: 0 (the output layer's logits, then log-softmax) or the fused output layer's chunk: `model.logprob_chunk`;
- ``varlen``: packed rows through torch's variable-length attention (CUDA) or the per-row block:
  `rlhf.models.packing.VARLEN_ON_CUDA`;
- ``compile``: `policy.compile`; ``budget``: with it, `policy.activation_memory_budget` (null: torch's default).

The host syncs inside a mini batch are gone in every configuration (not a switch); ``syncs`` counts what is left.
"""

from __future__ import annotations

import sys
import time
import warnings
from dataclasses import dataclass, replace

import torch
from omegaconf import OmegaConf

from cli_runs import attempt, release, sync, train_flops
from rlhf.algorithms import build_algorithm
from rlhf.config import compose_config
from rlhf.config.schema import ModelConfig, PolicyConfig, TrainConfig
from rlhf.models import packing
from rlhf.functional import fused_logprobs as _  # noqa: F401 (the module below, by name)
from rlhf.run.state import NonFiniteGuard
from rlhf.step.learner import Learner
from rlhf.step.scored import Scored
from rlhf.trajectory import with_groups
from rlhf.training.policy import TorchPolicy
from rlhf.trajectory import from_completions


fused_module = sys.modules["rlhf.functional.fused_logprobs"]


@dataclass(frozen=True)
class Switches:
    name: str
    key: str  # its name on the command line (--configs)
    precision: str = "autocast"
    chunk: int = 0
    varlen: bool = False
    compile: bool = False
    chunk_kernels: bool = True  # the fused layer's chunk math compiled on CUDA (`fused_logprobs.COMPILE_ON_CUDA`)
    budget: float | None = None  # policy.activation_memory_budget (with compile)
    checkpointing: bool = False  # policy.gradient_checkpointing


TODAY = Switches("today (autocast, plain logits, block attention, eager)", "today")
ALL = Switches("all four", "all", "master", 1024, True, True)
BUDGET = Switches("all four, activation memory budget 0.5", "budget", "master", 1024, True, True, budget=0.5)
CONFIGS = [
    TODAY,
    Switches("bf16 weights + fp32 masters", "master", precision="master"),
    Switches("fused output layer", "fused", chunk=1024),
    Switches("varlen attention", "varlen", varlen=True),
    Switches("policy.compile", "compile", compile=True),
    Switches("all but compile", "all-but-compile", "master", 1024, True, False),
    ALL,
    Switches("all four, chunk math eager", "all-eager-chunks", "master", 1024, True, True, chunk_kernels=False),
    BUDGET,
    Switches("all four, activation memory budget 0.3", "budget-0.3", "master", 1024, True, True, budget=0.3),
    Switches("all four, budget 0.5, output layer chunk 512", "budget-chunk512", "master", 512, True, True, budget=0.5),
    Switches("all four, budget 0.3, output layer chunk 512", "budget-0.3-chunk512", "master", 512, True, True, budget=0.3),
    Switches("all four, budget 0.3, output layer chunk 256", "budget-0.3-chunk256", "master", 256, True, True, budget=0.3),
    Switches("all four, gradient checkpointing", "checkpointed", "master", 1024, True, True, checkpointing=True),
]


def synthetic(rows: int, prompt: int, response: int, vocab: int, samples: int) -> Scored:
    """``rows`` full-length GRPO rows of random tokens (no padding), random scores, groups of ``samples``."""
    g = torch.Generator().manual_seed(0)
    query = torch.randint(3, vocab, (rows, prompt), generator=g)
    answer = torch.randint(3, vocab, (rows, response), generator=g)
    batch = from_completions(query, torch.ones_like(query), answer, torch.ones_like(answer),
                             torch.full((rows, response), -2.0), torch.ones(rows, dtype=torch.bool))
    batch = replace(with_groups(batch, samples), scores=torch.randn(rows, generator=g))
    return Scored(batch, [""] * rows, [""] * rows, {})


def build(folder: str, device: torch.device, switches: Switches, micro: int, samples: int):
    """(policy, learner) of one configuration: GRPO, no reference (beta 0), one optimiser step per batch."""
    packing.VARLEN_ON_CUDA = switches.varlen
    fused_module.COMPILE_ON_CUDA = switches.chunk_kernels
    dtype = "bfloat16" if device.type == "cuda" or switches.precision == "master" else "float32"
    model_cfg = OmegaConf.structured(ModelConfig(name_or_path=folder, dtype=dtype, logprob_chunk=switches.chunk))
    train_cfg = OmegaConf.structured(TrainConfig(micro_batch_size=micro, lr=1e-6, mixed_precision=switches.precision))
    torch._dynamo.reset()
    policy_cfg = PolicyConfig(compile=switches.compile, activation_memory_budget=switches.budget,
                              gradient_checkpointing=switches.checkpointing)
    policy = TorchPolicy(OmegaConf.structured(policy_cfg), model_cfg, train_cfg,
                         total_optimizer_steps=100, device=device)
    algo_cfg = compose_config(["algorithm=grpo", f"algorithm.num_samples_per_prompt={samples}", "algorithm.beta=0"]).algorithm
    algorithm = build_algorithm(algo_cfg, 256)
    learner = Learner(policy, None, None, algorithm, train_cfg, device, torch.Generator().manual_seed(0),
                      policy_packs=policy.packs())
    return policy, learner


def train_pass(learner: Learner, scored: Scored) -> dict:
    batch, _ = learner.prepare(scored)
    return learner.train(batch, NonFiniteGuard(3))


def measure(folder: str, shape_cfg, device: torch.device, switches: Switches, rows: int, prompt: int, response: int,
            micro: int, peak: float, steps: int = 2, samples: int = 4) -> dict:
    """One configuration: a warm-up pass (compiles, if asked), then ``steps`` timed passes; tokens/s, MFU, peak."""
    row = {"config": switches.name, "rows": rows, "tokens_per_row": prompt + response, "micro_batch_rows": micro}
    try:
        row |= timed_passes(folder, shape_cfg, device, switches, rows, prompt, response, micro, peak, steps, samples)
    except torch.OutOfMemoryError:
        row["result"] = "out of memory"
    except Exception as error:  # one configuration that breaks must not cost the others (CI's test needs every row)
        row["result"] = f"{type(error).__name__}: {error}"[:1500]
    finally:
        packing.VARLEN_ON_CUDA = fused_module.COMPILE_ON_CUDA = True
        release(device)
    return row


def timed_passes(folder, shape_cfg, device, switches, rows, prompt, response, micro, peak, steps, samples) -> dict:
    policy, learner = build(folder, device, switches, micro, samples)
    scored = synthetic(rows, prompt, response, shape_cfg.vocab_size, samples)
    start = time.perf_counter()
    train_pass(learner, scored)
    sync(device)
    warmup = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(steps):
        metrics = train_pass(learner, scored)
    sync(device)
    seconds = (time.perf_counter() - start) / steps
    seq = prompt + response
    flops = train_flops(shape_cfg, rows * seq, rows * response, rows * seq * seq)
    return {
        "warmup_s": round(warmup, 2), "s_per_pass": round(seconds, 4), "tokens_per_s": round(rows * seq / seconds, 1),
        "tflops": round(flops / seconds / 1e12, 3), "mfu": round(flops / seconds / peak, 4),
        "max_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
        "loss": round(metrics.get("loss/policy_avg", float("nan")), 5),
    }


def count_syncs(folder: str, shape_cfg, device: torch.device, rows: int, prompt: int, response: int) -> dict:
    """Host syncs of one whole training pass (prepare + train) with the mini batch in 1 and in 4 micro batches
    (CUDA's sync debug mode, which warns on each): equal counts mean none happens between micro batches."""
    if device.type != "cuda":
        return {"skipped": "CUDA only (torch.cuda.set_sync_debug_mode)"}
    counts = {}
    for micro in (rows, rows // 4):
        _, learner = build(folder, device, replace(ALL, compile=False), micro, 4)
        scored = synthetic(rows, prompt, response, shape_cfg.vocab_size, 4)
        train_pass(learner, scored)  # warm
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                train_pass(learner, scored)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts[f"syncs_{rows // micro}_micro"] = sum("synchroniz" in str(w.message) for w in caught)
        del learner
        torch.cuda.empty_cache()
    return counts


RANGES = ("prepare", "forward", "loss", "backward", "optimizer_step")  # a pass's parts, as the profile names them
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")  # the host's kernel launches


def ranged(label: str, fn):
    """``fn`` under a profiler range named ``label``."""

    def call(*args, **kwargs):
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)

    return call


def profile(folder: str, shape_cfg, device: torch.device, rows: int, prompt: int, response: int, micro: int,
            switches: Switches = ALL) -> dict:
    """Where one pass of ``switches`` spends its time, on the device and on the host: the top kernels by device
    time; the device's busy time against the pass's wall time; each part of the pass (`RANGES`: the learner's
    prepare, each micro batch's forward, loss and backward, the optimiser step) with its host time and the device's
    idle time while the host was in it (the waits that part causes); the kernel launches; and the host's top
    operators by their own time."""
    policy, learner = build(folder, device, switches, micro, 4)
    learner.prepare = ranged("prepare", learner.prepare)
    policy.train_forward = ranged("forward", policy.train_forward)
    policy.backward = ranged("backward", policy.backward)
    policy.optimizer_step = ranged("optimizer_step", policy.optimizer_step)
    learner.algorithm.policy_loss = ranged("loss", learner.algorithm.policy_loss)
    scored = synthetic(rows, prompt, response, shape_cfg.vocab_size, 4)
    train_pass(learner, scored)
    sync(device)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    start = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        with torch.profiler.record_function("pass"):
            train_pass(learner, scored)
            sync(device)
    wall = time.perf_counter() - start
    events = prof.events()
    cpu = torch.autograd.DeviceType.CPU
    spans = [(e.name, e.time_range.start, e.time_range.end) for e in events  # the host's ranges, not their device copies
             if e.name in RANGES + ("pass",) and e.device_type == cpu]
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.name not in RANGES + ("pass",)
               and not getattr(e, "is_user_annotation", False) and e.time_range.end > e.time_range.start]
    # (the device's own work: kernels, copies, fills; not the device-side copies of the host's named ranges)
    intervals = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    whole = next(((s, t) for name, s, t in spans if name == "pass"), (0, 0))
    host = {label: round(sum(t - s for name, s, t in spans if name == label) / 1e3, 1) for label in RANGES}
    gaps = device_gaps(intervals, *whole, least_us=0.0) if intervals else []  # no device timeline on CPU
    idle: dict[str, float] = {}
    for gap_start, gap_end in gaps:
        middle = (gap_start + gap_end) / 2
        inside = [(t - s, name) for name, s, t in spans if name != "pass" and s <= middle < t]
        label = min(inside)[1] if inside else "between parts"
        idle[label] = idle.get(label, 0.0) + (gap_end - gap_start) / 1e3
    busy = (whole[1] - whole[0] - sum(t - s for s, t in gaps)) / 1e3 if intervals else 0.0  # ms
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append((e.time_range.end - e.time_range.start) / 1e3)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:12]
    averages = prof.key_averages()
    host_ops = sorted((e for e in averages if e.key not in RANGES + ("pass",)), key=lambda e: -e.self_cpu_time_total)[:15]
    launches = sum(e.count for e in averages if e.key in LAUNCHES)
    return {
        "micro_batch_rows": micro, "wall_ms": round(wall * 1e3, 1), "device_busy_ms": round(busy, 1),
        "device_idle_gaps": len([g for g in gaps if g[1] - g[0] >= 20.0]),
        "host_ms": host, "device_idle_ms_while": {k: round(v, 1) for k, v in sorted(idle.items(), key=lambda kv: -kv[1])},
        "kernel_launches": launches,
        "top": [{"kernel": name[:90], "ms": round(sum(ms), 2), "share": round(sum(ms) / busy, 3), "calls": len(ms)}
                for name, ms in top],
        "top_host_ops": [{"op": e.key[:60], "self_ms": round(e.self_cpu_time_total / 1e3, 2), "calls": e.count}
                         for e in host_ops],
    }


def device_gaps(kernels: list[tuple[float, float]], start: float, end: float,
                least_us: float = 20.0) -> list[tuple[float, float]]:
    """The spans of [start, end] (microseconds) that no kernel of ``kernels`` (sorted (start, end) pairs) covers,
    those of at least ``least_us``."""
    gaps, reached = [], start
    for kernel_start, kernel_end in kernels:
        if kernel_start - reached >= least_us:
            gaps.append((reached, kernel_start))
        reached = max(reached, kernel_end)
    if end - reached >= least_us:
        gaps.append((reached, end))
    return gaps


def varlen_agrees(folder: str, device: torch.device, rows: int = 8, length: int = 128) -> dict:
    """Logprobs and gradients of packed rows through the variable-length kernel against the per-row block path (bf16,
    the same weights): the largest differences."""
    if device.type != "cuda" or packing.varlen_kernel() is None:
        return {"skipped": "needs CUDA and torch.nn.attention.varlen"}
    if not packing.varlen_kernel()[2]:
        return {"skipped": f"torch {torch.__version__}'s varlen kernel takes no grouped-query heads: the block path runs"}
    from rlhf.models.logprobs import window_logprobs

    out = {}
    model_cfg = OmegaConf.structured(ModelConfig(name_or_path=folder, dtype="bfloat16", logprob_chunk=1024))
    policy = TorchPolicy(OmegaConf.structured(PolicyConfig()), model_cfg, OmegaConf.structured(TrainConfig()), 10, device)
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(length // 4, length, (rows,), generator=g)
    ids = torch.randint(3, 1000, (rows, length), generator=g)
    mask = (torch.arange(length) < lengths[:, None]).long()
    batch = from_completions(ids[:, :8], torch.ones(rows, 8, dtype=torch.long), ids[:, 8:], mask[:, 8:],
                             torch.zeros(rows, length - 8), torch.ones(rows, dtype=torch.bool)).to(device)
    results = []
    weight = policy.model.get_input_embeddings().weight  # bf16 (its float32 master takes the gradient: ask autograd)
    for varlen in (True, False):
        packing.VARLEN_ON_CUDA = varlen
        logp, _ = window_logprobs(policy.module, batch, 1.0, chunk=1024)
        (grad,) = torch.autograd.grad(logp.sum(), [weight])
        results.append((logp.detach().float(), grad.float()))
    packing.VARLEN_ON_CUDA = True
    out["max_logprob_diff"] = round((results[0][0] - results[1][0]).abs().max().item(), 5)
    out["max_grad_diff"] = round((results[0][1] - results[1][1]).abs().max().item(), 5)
    out["grad_scale"] = round(results[1][1].abs().max().item(), 5)
    return out


def train_section(folder: str, shape_cfg, device: torch.device, peak: float, tiny: bool, deadline: float,
                  quick: bool = False, keys: list[str] | None = None, micros: list[int] | None = None,
                  profile_micros: list[int] | None = None) -> dict:
    """Every configuration at 64 rows of 256 + 256 tokens, micro batch 16; the largest micro batch that fits with
    all four; the 2048-token variant (today vs all four); the sync count, the varlen check and the profile.

    ``keys`` (`Switches.key`) picks configurations; ``micros`` runs each at each of these micro batches instead of 16
    (and then leaves out the largest micro batch and the 2048-token rows); ``profile_micros``: the micro batches
    profiled (default 16)."""
    rows, prompt, response = (8, 8, 8) if tiny else (64, 256, 256)
    micro = 4 if tiny else 16
    configs = [c for c in CONFIGS if not (tiny and c.compile)]  # compile at tiny scale: tests/models/test_compile.py
    configs = [c for c in configs if c in (TODAY, ALL, BUDGET)] if quick else configs
    configs = [c for c in configs if c.key in keys] if keys else configs
    out: dict = {"configs": []}
    for switches in configs:
        for size in micros or [micro]:
            if time.perf_counter() > deadline:
                out["configs"].append({"config": switches.name, "micro_batch_rows": size, "result": "skipped: out of time"})
                continue
            row = measure(folder, shape_cfg, device, switches, rows, prompt, response, size, peak, steps=3 if micros else 2)
            out["configs"].append(row)
            print(row, file=sys.stderr, flush=True)
    final = ALL if not tiny else replace(ALL, compile=False)
    out["largest_micro_batch"] = []
    for bigger in [] if micros else [8] if tiny else [32, 64]:
        if time.perf_counter() > deadline:
            break
        row = measure(folder, shape_cfg, device, final, rows, prompt, response, bigger, peak, steps=1)
        out["largest_micro_batch"].append(row)
        print(row, file=sys.stderr, flush=True)
        if row.get("result") == "out of memory":
            break
    long_prompt, long_response = (16, 16) if tiny else (1024, 1024)
    out["long_rows"] = []
    for switches in [] if micros else (TODAY, final):
        if time.perf_counter() > deadline:
            break
        row = measure(folder, shape_cfg, device, switches, rows, long_prompt, long_response, 2 if tiny else 4, peak, steps=1)
        out["long_rows"].append(row)
        print(row, file=sys.stderr, flush=True)
    if time.perf_counter() < deadline:
        out["syncs"] = count_syncs(folder, shape_cfg, device, rows, prompt, response)
        out["varlen_vs_block"] = varlen_agrees(folder, device)
    out["profile"] = []
    for size in profile_micros or [micro]:
        if time.perf_counter() > deadline:
            break
        profiled = attempt(lambda: profile(folder, shape_cfg, device, rows, prompt, response, size, final), tiny, 1500)
        out["profile"].append({"micro_batch_rows": size} | profiled)
        release(device)
        print(out["profile"][-1], file=sys.stderr, flush=True)
    return out
