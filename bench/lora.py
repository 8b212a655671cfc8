"""Benchmark: full fine-tuning against LoRA on the same GRPO run, side by side, and the generator's speed on merged
weights against unmerged adapters.

Part 1: the real CLI trains a random Llama (the built-in task's 32-token vocabulary) for a few steps with the KL
term on (`algorithm.beta=0.05`, so full fine-tuning loads a frozen reference copy while LoRA switches its adapters
off instead), once with every weight trained and once with `policy.lora.rank=R`, one child process at a time. Per
run: the child's own peak resident memory (`os.wait4`'s rusage), the trainable parameters and AdamW state of the
"policy trains" log line, and from metrics.jsonl the medians of `perf/weight_sync_mb`, `time/weight_sync` and
`time/step` (step 1 is a warm-up, left out when there are more). ``--repeats N`` alternates N runs of each setting
and prints the medians of their figures (this machine's noise between runs is large).

Part 2, in this process: `rlhf.generators.decode` on the same prompts, every row decoding the full budget, with the
model the hf generator holds under LoRA (base model, merged weights `W + (alpha/r) B A` loaded into it) and with a
peft model whose adapters stay unmerged (two extra matmuls per adapted layer and token). Tokens/s of each.

    python bench/lora.py                          # ~27M-parameter Llama, 3 steps, rank 8
    python bench/lora.py --size 3m --steps 3 --repeats 2
    python bench/lora.py --targets q_proj,v_proj  # attention only: a smaller push
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from cli_runs import save_random_llama

# name: (hidden, layers, intermediate, heads), as in throughput.py
SHAPES = {"0.1m": (64, 2, 128, 2), "3m": (256, 4, 512, 4), "30m": (512, 8, 1536, 8)}
VOCAB = 32
WORK = [
    "algorithm=grpo", "algorithm.beta=0.05", "train.prompts_per_step=4", "algorithm.num_samples_per_prompt=4",
    "train.micro_batch_size=16", "generator.max_new_tokens=32", "dataset.max_prompt_length=16", "eval.every=0",
    "eval.max_prompts=4", "eval.num_samples=1", "logging.tensorboard=false", "checkpoint.save_final_model=false",
]
POLICY_LINE = re.compile(r"policy trains .*?: ([\d,]+) of ([\d,]+) parameters .*?AdamW state ([\d.]+) MiB")
COLUMNS = [("peak_rss_mib", "peak RSS MiB", ".0f"), ("trainable", "trainable params", ",.0f"),
           ("optimizer_mib", "AdamW state MiB", ".2f"), ("sync_mb", "weight sync MiB/step", ".2f"),
           ("sync_s", "weight sync s/step", ".3f"), ("step_s", "s/step", ".2f")]


def train(name: str, overrides: list[str], folder: Path) -> dict[str, float]:
    """Run `python -m rlhf.train <overrides>` alone in a child; its peak RSS, policy-line figures and step medians."""
    out = folder / name
    log = folder / f"{name}.log"
    cmd = [sys.executable, "-m", "rlhf.train", *overrides, f"hydra.run.dir={out}"]
    with log.open("w") as sink:
        child = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        _, status, usage = os.wait4(child.pid, 0)  # this child's own rusage, not the max over every child so far
    child.returncode = os.waitstatus_to_exitcode(status)
    text = log.read_text()
    if child.returncode != 0:
        sys.exit(f"{name} run failed ({child.returncode}):\n{text[-3000:]}")
    found = POLICY_LINE.search(text)
    if found is None:
        sys.exit(f"{name}: no 'policy trains' line in the log")
    steps = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "time/step" in r]
    steps = steps[1:] or steps
    med = lambda key: statistics.median(r[key] for r in steps)  # noqa: E731
    return {
        "peak_rss_mib": usage.ru_maxrss / 1024,  # KiB on Linux
        "trainable": int(found.group(1).replace(",", "")),
        "total": int(found.group(2).replace(",", "")),
        "optimizer_mib": float(found.group(3)),
        "sync_mb": med("perf/weight_sync_mb"),
        "sync_s": med("time/weight_sync"),
        "step_s": med("time/step"),
    }


def generation_speed(model_dir: Path, rank: int, targets: list[str], rows: int = 64, prompt_len: int = 16, new_tokens: int = 32,
                     repeats: int = 3) -> dict[str, float]:
    """Tokens/s of `decode` with merged weights and with unmerged peft adapters (same prompts, alternated), and the
    largest logit difference between the two models."""
    from rlhf.generators.base import SamplingParams
    from rlhf.generators.decode import decode
    from rlhf.models import lora
    from rlhf.models.loading import load_causal_lm

    torch.manual_seed(0)
    cfg = SimpleNamespace(rank=rank, alpha=2.0 * rank, dropout=0.0, target_modules=targets)
    unmerged = lora.add_adapters(load_causal_lm(str(model_dir)), cfg).eval()
    for name, param in unmerged.named_parameters():
        if ".lora_B." in name:  # a trained adapter: B != 0, so the merge changes the weights
            torch.nn.init.normal_(param, std=0.02)
    merged = load_causal_lm(str(model_dir)).eval()
    merged.load_state_dict(lora.merged_weights(unmerged.state_dict(), lora.scaling(cfg), adapted_only=True), strict=False)
    prompts = torch.randint(3, VOCAB, (rows, prompt_len))
    mask = torch.ones_like(prompts)
    with torch.no_grad():
        gap = (merged(prompts).logits - unmerged(input_ids=prompts).logits).abs().max().item()
    sampling = SamplingParams(max_new_tokens=new_tokens, greedy=True)
    models = {"merged": merged, "unmerged": unmerged}
    times = {name: [] for name in models}
    for repeat in range(repeats + 1):  # the first round is a warm-up
        for name, model in models.items():
            start = time.perf_counter()
            tokens, _ = decode(model, prompts, mask, sampling, stop_id=-1, pad_id=0)  # no stop: every row runs the budget
            if repeat:
                times[name].append(time.perf_counter() - start)
    produced = tokens.numel()
    return {**{name: produced / statistics.median(t) for name, t in times.items()}, "logit_gap": gap}


def table(rows: dict[str, dict[str, float]]) -> str:
    """The side-by-side table: one row per run and the LoRA/full ratio."""
    (full_name, full), (lora_name, lora_row) = rows.items()
    lines = ["| run | " + " | ".join(title for _, title, _ in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for name, row in rows.items():
        lines.append(f"| {name} | " + " | ".join(format(row[key], spec) for key, _, spec in COLUMNS) + " |")
    lines.append(f"| {lora_name} / {full_name} | " + " | ".join(f"{lora_row[key] / full[key]:.3f}" for key, _, _ in COLUMNS) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    """Run both trainings and the generation comparison; print the tables and return their figures."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="30m", choices=list(SHAPES), help="random Llama shape")
    parser.add_argument("--steps", type=int, default=3, help="training steps per run (step 1 is a warm-up)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (policy.lora.rank; alpha stays the default)")
    parser.add_argument("--targets", default="all-linear", help="policy.lora.target_modules, comma-separated")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each setting, alternated; figures are their medians")
    args = parser.parse_args(argv)
    hidden, layers, intermediate, heads = SHAPES[args.size]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = save_random_llama(tmp / "model", hidden=hidden, layers=layers, intermediate=intermediate, vocab=VOCAB,
                                  heads=heads, positions=512)
        common = [f"model.name_or_path={model}", f"train.num_steps={args.steps}", *WORK]
        targets = args.targets.split(",")
        lora_run = [*common, f"policy.lora.rank={args.rank}", f"policy.lora.target_modules=[{args.targets}]"]
        settings = {"full": common, f"LoRA r{args.rank}": lora_run}
        runs = {name: [] for name in settings}
        for repeat in range(args.repeats):
            for i, (name, overrides) in enumerate(settings.items()):
                runs[name].append(train(f"run{i}-{repeat}", overrides, tmp))
        rows = {name: {key: statistics.median(r[key] for r in done) for key in done[0]} for name, done in runs.items()}
        total = next(iter(rows.values()))["total"]
        print(f"\nrandom Llama {args.size} ({total / 1e6:.1f}M parameters), {args.steps} steps, beta 0.05, LoRA rank {args.rank} "
              f"on {args.targets}, medians of {args.repeats} run(s) each:\n")
        print(table(rows))
        speed = generation_speed(model, args.rank, targets)
    print(f"\ndecode of 64 prompts x 32 new tokens (max logit gap merged vs unmerged {speed['logit_gap']:.1e}):\n")
    print("| generator model | tokens/s |\n|---|---|")
    print(f"| merged weights (what the hf generator holds) | {speed['merged']:.0f} |")
    print(f"| peft model, adapters unmerged | {speed['unmerged']:.0f} |")
    print(f"| merged / unmerged | {speed['merged'] / speed['unmerged']:.2f}x |")
    return {"runs": rows, "generation": speed}


if __name__ == "__main__":
    main()
