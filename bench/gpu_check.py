"""The GPU path, checked in one script: the hf generator's decode paths (`bench/generate.py`), the trainer's speed on a Qwen2.5-0.5B-shaped model under today's path and
each speed change (`bench/gpu_train.py`), one whole GRPO step with its stage times and the memory plan's estimate
beside the measured peak, hybrid sleep/wake memory, the DDP / FSDP2 strategies at world size 1 (a process group
started in this process, FSDP2 also with compiled blocks), and learning on the built-in task.

    python bench/gpu_check.py --json $OUT/gpu.json   # full scale on CUDA, within --budget-s (default 420 s)
    python bench/gpu_check.py --tiny --device cpu    # the same code at tiny scale: what CI runs
    python bench/gpu_check.py --sections train,grpo_step

Models are built locally with random weights in the real shapes (no hub). The JSON is rewritten after each section
(a run cut short keeps what it measured); figures print as Markdown last.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from omegaconf import OmegaConf
from transformers import Qwen2Config, Qwen2ForCausalLM

from cli_runs import attempt, matmul_peak, release, sync, train_flops
from generate import bench as generate_bench, decode_profile, float32_checks, path_generator
from gpu_train import CONFIGS, train_section
from rlhf.algorithms import build_algorithm
from rlhf.config.schema import ModelConfig, PolicyConfig, ReferenceConfig
from rlhf.config import compose_config
from rlhf.config.schema import TrainConfig
from rlhf.generators.base import SamplingParams
from rlhf.generators.hf import HFGenerator, HfGeneratorConfig
from rlhf.training.policy import TorchPolicy
from rlhf.models.reference import FrozenReference
from rlhf.models.tiny import build_char_tokenizer
from rlhf.plan import make_plan, memory
from rlhf.run.state import NonFiniteGuard
from rlhf.step.learner import Learner
from rlhf.step.scored import Scored
from rlhf.trajectory import with_groups

SECTIONS = ("peak", "generate", "train", "grpo_step", "hybrid", "strategies", "learn")
DEFAULT = ("peak", "generate", "train", "grpo_step", "hybrid", "strategies")  # learn: measured on 2026-11-23, unchanged since
QWEN2_5_0_5B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                    num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, max_position_embeddings=128, tie_word_embeddings=True)


def timed(device: torch.device, fn):
    """(result, seconds) of ``fn()``, with the device synchronised around it."""
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return result, time.perf_counter() - start


def peak_matmul_flops(device: torch.device, tiny: bool) -> float:
    """Measured FLOP/s of a square matrix product: bf16 8192^3 on CUDA, float32 256^3 on CPU (tiny)."""
    if tiny or device.type != "cuda":
        return matmul_peak(device, (256,), torch.float32)
    return matmul_peak(device, (8192,), torch.bfloat16)


def save_model(folder: Path, shape: dict) -> str:
    """A randomly initialised Qwen2 of ``shape`` and a character tokenizer, saved as a model folder."""
    torch.manual_seed(0)
    tokenizer = build_char_tokenizer("0123456789+=")
    model = Qwen2ForCausalLM(Qwen2Config(pad_token_id=0, bos_token_id=1, eos_token_id=2, attention_dropout=0.0, **shape))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def run_cli(args: list[str], out: Path) -> dict:
    """`python -m rlhf.train <args>` in ``out``; the first and last evaluations and seconds per step."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "rlhf.train", f"hydra.run.dir={out}", "logging.tensorboard=false", *args]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/greedy_correct_rate" in r]
    steps = [r["time/step"] for r in rows if "time/step" in r]
    return {
        "args": " ".join(args), "wall_s": round(wall, 1), "s_per_step": round(sum(steps) / len(steps), 4),
        "greedy_start": evals[0]["eval/greedy_correct_rate"], "greedy_end": evals[-1]["eval/greedy_correct_rate"],
        "sampled_start": evals[0]["eval/sampled_correct_rate"], "sampled_end": evals[-1]["eval/sampled_correct_rate"],
    }


def generate_section(device: torch.device, tiny: bool, folder: str, deadline: float, paths=None, sizes=None) -> dict:
    """The hf generator's decode paths (`bench/generate.py`): tokens/s for 64 and 256 rows x 256 and 1024 new tokens
    against the memory-bandwidth floor (tiny: 4 rows x 8 tokens, uncompiled), and whether the static
    path (on CUDA, its recorded graphs) gives the eager loop's greedy tokens in float32 and follows a weight push and a
    sleep/wake there."""
    cuda = device.type == "cuda"
    # the compiled paths are asked for by name (--paths): at the 0.5B shape their compiles outlast a lease's call
    paths = paths or ["eager", "static"] + (["graphs", "graphs-ungrouped"] if cuda else [])
    if tiny:  # the compiled paths' code is the same generators' (tests/generators compile them): CI skips their compile
        paths = ["eager", "static"]
        figures, made = generate_bench(folder, device, [(4, 8)], paths, prompt_len=8, repeats=1, deadline=deadline)
    else:  # the target's size first, so a run short of time still measures it
        sizes = sizes or [(256, 1024), (64, 256), (256, 256), (64, 1024)]
        figures, made = generate_bench(folder, device, sizes, paths, prompt_len=64, repeats=1, deadline=deadline, strict=False)
    # the static step's kernels, one by one (the graphs replay the same ones): where its time goes
    rows, prompt_len = (4, 8) if tiny else (max(r for r, _ in sizes), 64)
    prompts = [[3 + (row * 7 + i) % 9 for i in range(prompt_len)] for row in range(rows)]

    def profile() -> dict:
        if "static" not in made:  # not among the timed paths: built for the profile (and freed with them below)
            made["static"] = path_generator(folder, device, "static", rows)
        return {"rows": rows, "new_tokens": 16, "top": decode_profile(made["static"], prompts, 16)}

    profiled = attempt(profile, tiny)
    for generator in made.values():  # the sections after this one measure memory: nothing of the generators stays
        if generator.static is not None:
            generator.static.free()
    made.clear()
    torch._dynamo.reset()
    release(device)
    # float32: a bug, not bf16 rounding of near-tied logits, if the tokens differ
    float32 = attempt(lambda: float32_checks(folder, device, ["static"] + (["graphs"] if cuda else [])), tiny)
    return {"speed": figures, "float32": float32, "static_profile": profiled}


def learn(device: torch.device, tiny: bool, work: Path) -> list[dict]:
    """The default run and experiment=ppo_arith_tiny on ``device``: eval correct rates before and after (tiny: the
    default run for 10 steps; tests/e2e checks that every algorithm learns)."""
    short = ["train.num_steps=10", "eval.every=0", "eval.num_samples=1", "eval.max_prompts=20"] if tiny else []
    runs = [[]] if tiny else [[], ["experiment=ppo_arith_tiny"]]
    return [run_cli([f"cluster.device={device}", *extra, *short], work / f"learn{i}") for i, extra in enumerate(runs)]


def grpo_step(device: torch.device, tiny: bool, folder: str, peak: float, compile: bool = True) -> dict:
    """One whole GRPO step on the Qwen2.5-0.5B shape (16 prompts x 4 samples, 256 + 256 tokens, micro batch 16, no
    gradient checkpointing), every trainer speed change on (bf16 weights with fp32 masters, fused output layer,
    varlen attention, `policy.compile` on CUDA): stage seconds, tokens/s, training MFU, peak memory against the
    memory plan's figure."""
    shape = TINY if tiny else QWEN2_5_0_5B
    sizes = (8, 8, 4, 2) if tiny else (256, 256, 16, 4)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    model_cfg = OmegaConf.structured(ModelConfig(name_or_path=folder, dtype=dtype, logprob_chunk=1024))
    algo_cfg = compose_config(["algorithm=grpo", f"algorithm.num_samples_per_prompt={sizes[3]}", "algorithm.beta=0.04"]).algorithm
    gen_cfg = HfGeneratorConfig(name="hf", max_new_tokens=sizes[1], batch_size=sizes[2] * sizes[3], stop_token="<eos>")
    micro = 4 if tiny else 16
    try:
        return grpo_steps(device, folder, shape, model_cfg, algo_cfg, gen_cfg, micro, sizes, peak, compile=compile and not tiny)
    except torch.OutOfMemoryError:
        return {"micro_batch_rows": micro, "result": "out of memory"}


def grpo_steps(device, folder, shape, model_cfg, algo_cfg, gen_cfg, micro, sizes, peak, compile: bool) -> dict:
    """Three GRPO steps (the first warms up and compiles) of one configuration; the figures of the last two."""
    prompt_len, new_tokens, prompts, samples = sizes
    train_cfg = OmegaConf.structured(TrainConfig(micro_batch_size=micro, lr=1e-6))
    torch._dynamo.reset()
    policy = TorchPolicy(OmegaConf.structured(PolicyConfig(compile=compile)), model_cfg, train_cfg,
                         total_optimizer_steps=10, device=device)
    reference = FrozenReference(OmegaConf.structured(ReferenceConfig()), model_cfg, device)
    tokenizer = build_char_tokenizer("0123456789+=")
    generator = HFGenerator(gen_cfg, model_cfg, tokenizer, device)
    generator.update_weights(policy.state_dict())
    algorithm = build_algorithm(algo_cfg, new_tokens)
    learner = Learner(policy, reference, None, algorithm, train_cfg, device, torch.Generator().manual_seed(0),
                      policy_packs=policy.packs())
    vocab = shape["vocab_size"]
    times: dict[str, float] = {}
    for step in range(3):  # step 0 warms up
        if step == 1 and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        prompt_ids = torch.randint(3, vocab, (prompts, prompt_len)).tolist()
        repeated = [p for p in prompt_ids for _ in range(samples)]
        sampling = SamplingParams(new_tokens, temperature=1.0)
        batch, gen_s = timed(device, lambda: generator.generate(repeated, sampling))
        batch = replace(with_groups(batch, samples), scores=torch.randn(len(repeated)))
        scored = Scored(batch.to("cpu"), [""] * len(repeated), [""] * len(repeated), {})
        (trained, _), logp_s = timed(device, lambda: learner.prepare(scored))
        _, train_s = timed(device, lambda: learner.train(trained, NonFiniteGuard(3)))
        _, sync_s = timed(device, lambda: generator.update_weights(policy.state_dict()))
        if step:
            for key, value in (("generation", gen_s), ("logprobs", logp_s), ("training", train_s), ("weight_sync", sync_s)):
                times[key] = times.get(key, 0.0) + value / 2
    rows, seq = len(repeated), prompt_len + new_tokens
    flops = train_flops(policy.model.config, rows * seq, rows * new_tokens, rows * seq * seq)
    result = {
        "rows": rows, "tokens_per_row": seq, "micro_batch_rows": micro, "compiled": compile,
        **{f"s_{k}": round(v, 3) for k, v in times.items()}, "s_step": round(sum(times.values()), 3),
        "generation_tokens_per_s": round(rows * new_tokens / times["generation"], 1),
        "training_tokens_per_s": round(rows * seq / times["training"], 1),
        "training_mfu": round(flops / times["training"] / peak, 4),
        "max_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
        "planned_gib": round(planned_bytes(folder, model_cfg.dtype, device, False, micro, sizes, gen_cfg, compile) / 2**30, 4),
    }
    if result["max_memory_gib"]:
        result["planned_over_measured"] = round(result["planned_gib"] / result["max_memory_gib"], 3)
    return result


def planned_bytes(folder, dtype: str, device, checkpointing: bool, micro: int, sizes, gen_cfg, compile: bool = False) -> int:
    """What `rlhf.plan` expects the same work to take on the device, without the runtime (max_memory_allocated
    counts neither the CUDA context nor the process's libraries)."""
    prompt_len, new_tokens, prompts, samples = sizes
    cfg = compose_config([
        f"model.name_or_path={folder}", f"model.dtype={dtype}", f"cluster.device={device.type}",
        f"policy.gradient_checkpointing={str(checkpointing).lower()}", f"train.micro_batch_size={micro}",
        f"train.prompts_per_step={prompts}", f"algorithm.num_samples_per_prompt={samples}", "algorithm.beta=0.04",
        f"dataset.max_prompt_length={prompt_len}", f"generator.max_new_tokens={new_tokens}",
        f"generator.batch_size={gen_cfg.batch_size}", f"policy.compile={str(compile).lower()}",
    ])
    plan = make_plan(cfg)
    (group,) = plan.groups
    return memory.peak([i for i in group.items if i.role != "runtime"])[0]


def allocated(device: torch.device) -> float | None:
    return round(torch.cuda.memory_allocated(device) / 2**20, 1) if device.type == "cuda" else None


def hybrid(device: torch.device, folder: str) -> dict:
    """What sleeping frees on the device and waking re-takes (hf generator), and what optimiser offload frees."""
    dtype = "float32" if device.type == "cpu" else "bfloat16"
    model_cfg = OmegaConf.structured(ModelConfig(name_or_path=folder, dtype=dtype))
    policy = TorchPolicy(OmegaConf.structured(PolicyConfig()), model_cfg, OmegaConf.structured(TrainConfig(lr=1e-6)), 10, device)
    generator = HFGenerator(HfGeneratorConfig(name="hf", max_new_tokens=4), model_cfg, build_char_tokenizer("0123456789+="), device)
    weights = policy.state_dict()
    out = {"awake_mib": allocated(device)}
    generator.sleep()
    out |= {"asleep_mib": allocated(device), "freed_bytes_reported": generator.freed_bytes}
    generator.update_weights(weights)
    out["woken_mib"] = allocated(device)
    batch = generator.generate([[1, 5, 6]] * 2, SamplingParams(4))  # one optimiser step, so Adam's state exists
    logp, _ = policy.logprobs(replace(batch, group_id=torch.zeros(2, dtype=torch.long)).to(device))
    policy.backward(-logp.sum())
    policy.optimizer_step()
    out["with_optimizer_state_mib"] = allocated(device)
    policy.offload_optimizer()
    policy.release_cached_memory()
    out["optimizer_offloaded_mib"] = allocated(device)
    policy.reload_optimizer()
    out["optimizer_reloaded_mib"] = allocated(device)
    return out


def strategies(device: torch.device, tiny: bool, folder: str) -> list[dict]:
    """One optimiser step under single, ddp and fsdp2 in a process group of world size 1 (NCCL on CUDA, gloo on
    CPU), started in this process."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    return strategy_steps(["ddp", "fsdp2"] + ([] if tiny else ["fsdp2+compile"]), device, folder)


def strategy_steps(names: list[str], device: torch.device, folder: str) -> list[dict]:
    """The same step under `single` (no wrapper) and under each of ``names`` (``<strategy>+compile``: with
    `policy.compile`); how each compares to `single`. On CUDA in bf16 each keeps its own precision (single: bf16
    weights and fp32 masters; ddp: autocast; fsdp2: its MixedPrecisionPolicy), so they agree to bf16 rounding only."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    torch.distributed.init_process_group(backend)
    model_cfg = OmegaConf.structured(ModelConfig(name_or_path=folder, dtype="bfloat16" if device.type == "cuda" else "float32"))
    train_cfg = OmegaConf.structured(TrainConfig(lr=1e-3, adam_eps=1e-4))
    ids = torch.randint(3, 400, (4, 32), generator=torch.Generator().manual_seed(0)).to(device)
    steps = {}
    for label in ("single", *names):
        strategy, _, compiled = label.partition("+")
        torch._dynamo.reset()
        policy_cfg = OmegaConf.structured(PolicyConfig(strategy={"name": strategy}, compile=bool(compiled)))
        policy = TorchPolicy(policy_cfg, model_cfg, train_cfg, total_optimizer_steps=1, device=device)
        with policy.autocast():
            logits = policy.module(input_ids=ids, use_cache=False).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        policy.backward(loss)
        norm = policy.optimizer_step()
        steps[label] = (loss.item(), norm, {k: v.detach().float().cpu() for k, v in policy.full_state_dict().items()})
        del policy
    loss_a, norm_a, w_a = steps["single"]
    rows = []
    for name in names:
        loss_b, norm_b, w_b = steps[name]
        diff = max((w_a[k] - w_b[k]).abs().max().item() for k in w_a)
        rows.append({"strategy": name, "backend": backend, "loss": loss_b, "loss_single": loss_a, "grad_norm": norm_b,
                     "grad_norm_single": norm_a, "max_weight_diff_vs_single": diff})
    torch.distributed.destroy_process_group()
    return rows


def numbers(text: str | None) -> list[int] | None:
    """``"16,64"`` as [16, 64]; nothing as None. Each must be a whole number of rows, at least 1 (a micro batch of 0
    rows would mean one row per micro batch)."""
    if not text:
        return None
    values = [int(n) if n.strip().isdigit() else 0 for n in text.split(",")]
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"micro batches are rows, whole numbers from 1: got {text!r}")
    return values


def markdown(results: dict, level: int = 3) -> str:
    """Each section as a Markdown table (a section of several tables, such as ``train``, as one table each)."""
    lines = []
    for section, value in results.items():
        lines.append(f"{'#' * level} {section}")
        if isinstance(value, dict) and any(isinstance(v, (list, dict)) for v in value.values()):
            lines.append(markdown(value, level + 1))
            continue
        rows = value if isinstance(value, list) else [value]
        if rows and isinstance(rows[0], dict):
            keys = list(dict.fromkeys(k for r in rows for k in r))
            lines += ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
        else:
            lines.append(str(value))
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes and short runs (the CPU form CI runs)")
    parser.add_argument("--sections", default=",".join(DEFAULT), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--json", help="also write the figures to this JSON file (rewritten after each section)")
    parser.add_argument("--quick", action="store_true", help="train: today's path, all changes, and all with an activation memory budget only")
    parser.add_argument("--configs", help=f"train: comma-separated configurations, of {', '.join(c.key for c in CONFIGS)}")
    parser.add_argument("--micro-batches", type=numbers, help="train: run each configuration at each of these micro batches, such as 16,64")
    parser.add_argument("--profile-micro-batches", type=numbers, help="train: the micro batches profiled (default 16)")
    parser.add_argument("--paths", help="generate: comma-separated decode paths of bench/generate.py (default: every one)")
    parser.add_argument("--sizes", help="generate: rows x new tokens to measure, in order, such as 256x1024,64x256")
    parser.add_argument("--no-policy-compile", action="store_true", help="grpo_step: without policy.compile (no compile wait)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="train: configurations past this many seconds are skipped")
    args = parser.parse_args()
    device = torch.device(args.device)
    wanted = args.sections.split(",")
    unknown = set(wanted) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    unknown = set(args.configs.split(",") if args.configs else []) - {c.key for c in CONFIGS}
    if unknown:
        parser.error(f"unknown --configs {sorted(unknown)}; choose from {', '.join(c.key for c in CONFIGS)}")
    start = time.perf_counter()
    results: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                     "torch": torch.__version__}
    peak = peak_matmul_flops(device, args.tiny)
    results["peak"] = {"matmul_tflops": round(peak / 1e12, 4)}
    print(f"peak: {results['peak']}", file=sys.stderr, flush=True)
    shape = TINY if args.tiny else QWEN2_5_0_5B
    runs = {
        "train": lambda work, folder: train_section(
            folder, Qwen2Config(**shape), device, peak, args.tiny, start + args.budget_s * 0.6, args.quick,
            args.configs and args.configs.split(","), args.micro_batches, args.profile_micro_batches,
        ),
        "generate": lambda work, folder: generate_section(
            device, args.tiny, folder, start + args.budget_s * 0.8, args.paths and args.paths.split(","),
            args.sizes and [tuple(int(n) for n in size.split("x")) for size in args.sizes.split(",")],
        ),
        "grpo_step": lambda work, folder: grpo_step(device, args.tiny, folder, peak, not args.no_policy_compile),
        "hybrid": lambda work, folder: hybrid(device, folder),
        "strategies": lambda work, folder: strategies(device, args.tiny, folder),
        "learn": lambda work, folder: learn(device, args.tiny, work),
    }
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_model(Path(tmp) / "model", shape)  # random weights in the real shapes, shared by the sections
        for section in [s for s in SECTIONS if s in wanted and s in runs]:
            began = time.perf_counter()
            if began - start > args.budget_s:
                results[section] = {"skipped": f"out of time ({args.budget_s:g} s budget)"}
                continue
            # one broken section must not cost the others' figures
            results[section] = attempt(lambda: runs[section](Path(tmp), folder), args.tiny, limit=2000)
            results.setdefault("seconds", {})[section] = round(time.perf_counter() - began, 1)
            print(f"{section}: {results[section]}", file=sys.stderr, flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    print(markdown(results))


if __name__ == "__main__":
    main()
