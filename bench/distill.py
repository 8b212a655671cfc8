"""Benchmark: on-policy distillation against GRPO from the same start, on the same sample budget, in one run.

The task is the long-tail counting task (`dataset=count`: correct responses of 1 to 60 tokens), where a sequence
reward says only how the whole count ended and the teacher says which token went wrong. Every arm starts from the
warm start `tiny_count` and takes 64 samples a step through the real CLI:
- `opd 64x1`: `experiment=opd_count_tiny`, one sample of each of 64 prompts, each token scored by
  `builtin:tiny_count_teacher` (the reward is logged, not trained on);
- `grpo 8x8`, `grpo 16x4`, `grpo 32x2`: the same preset with `algorithm=grpo` and no teacher, the task's reward (exact
  count plus partial credit for stopping near it), prompts x samples a step as named (GRPO needs a group of two or more).
The teacher is evaluated first, in the same run. Prints each arm's evaluation curve (greedy / sampled correct rate
over all 95 prompts, averaged over the seeds) and the samples it took to come within `--margin` of the teacher's
greedy and sampled correct rates (per seed; "-" where the budget ran out first).

Examples:
  python bench/distill.py                            # 60 steps, seeds 1-3, every arm: about 9 minutes on 2 cores
  python bench/distill.py --steps 20 --seeds 1 --arms opd,grpo-8x8
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from cli_runs import train_records

BASE = ["experiment=opd_count_tiny", "logging.tensorboard=false", "checkpoint.save_final_model=false"]
GRPO = ["algorithm=grpo", "teacher.name_or_path=null"]
ARMS = {
    "opd-64x1": [],
    "grpo-8x8": [*GRPO, "train.prompts_per_step=8", "algorithm.num_samples_per_prompt=8"],
    "grpo-16x4": [*GRPO, "train.prompts_per_step=16", "algorithm.num_samples_per_prompt=4"],
    "grpo-32x2": [*GRPO, "train.prompts_per_step=32", "algorithm.num_samples_per_prompt=2"],
}
SAMPLES_PER_STEP = 64  # every arm: prompts x samples
KEYS = ("eval/greedy_correct_rate", "eval/sampled_correct_rate")


def curve(arm: str, seed: int, steps: int, every: int, folder: Path, prompts: int) -> dict[int, tuple[float, float]]:
    """{step: (greedy, sampled correct rate)} of one training run over ``prompts`` evaluation prompts, step 0 included."""
    overrides = [*BASE, *ARMS[arm], f"seed={seed}", f"train.num_steps={steps}", f"eval.every={every}",
                 f"eval.max_prompts={prompts}"]
    records = train_records(arm, overrides, folder, keep_eval=True)
    return {r["step"]: tuple(r[k] for k in KEYS) for r in records if KEYS[0] in r}


def teacher_rates(folder: Path, prompts: int) -> tuple[float, float]:
    """The teacher's greedy and sampled correct rates: the step-0 evaluation of a run that starts from it."""
    overrides = [*BASE, *ARMS["grpo-8x8"], "model.name_or_path=builtin:tiny_count_teacher", "train.num_steps=1", "eval.every=1",
                 f"eval.max_prompts={prompts}"]
    records = train_records("teacher", overrides, folder, keep_eval=True)
    return next(tuple(r[k] for k in KEYS) for r in records if KEYS[0] in r and r["step"] == 0)


def samples_to(points: dict[int, tuple[float, float]], which: int, target: float) -> int | None:
    """Samples trained before the first evaluation at or above ``target`` (``which``: 0 greedy, 1 sampled)."""
    return next((step * SAMPLES_PER_STEP for step, rates in sorted(points.items()) if rates[which] >= target), None)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="training steps per run (64 samples each)")
    parser.add_argument("--every", type=int, default=10, help="evaluate every N steps")
    parser.add_argument("--seeds", default="1,2,3", help="seeds, comma-separated; each arm runs once per seed")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"which arms, comma-separated, of {', '.join(ARMS)}")
    parser.add_argument("--margin", type=float, default=0.05, help="how close to the teacher's rates counts as reached")
    parser.add_argument("--eval-prompts", type=int, default=95, help="evaluation prompts (95: every counting prompt)")
    args = parser.parse_args(argv)
    arms, seeds = args.arms.split(","), [int(s) for s in args.seeds.split(",")]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        parser.error(f"--arms: unknown {', '.join(unknown)}; choose from {', '.join(ARMS)}")
    with tempfile.TemporaryDirectory() as tmp:
        teacher = teacher_rates(Path(tmp), args.eval_prompts)
        curves = {arm: [curve(arm, seed, args.steps, args.every, Path(tmp), args.eval_prompts) for seed in seeds]
                  for arm in arms}
    targets = tuple(rate - args.margin for rate in teacher)
    print(f"teacher (builtin:tiny_count_teacher): greedy {teacher[0]:.2f}, sampled {teacher[1]:.2f}; "
          f"reached = within {args.margin} of these; {SAMPLES_PER_STEP} samples a step, seeds {args.seeds}")
    steps = sorted(curves[arms[0]][0])
    print("| arm | " + " | ".join(f"step {s}" for s in steps) + " | samples to greedy | samples to sampled |")
    print("|---|" + "---|" * (len(steps) + 2))
    reached = {}
    for arm in arms:
        mean = {s: [statistics.mean(c[s][i] for c in curves[arm]) for i in (0, 1)] for s in steps}
        reached[arm] = [[samples_to(c, i, targets[i]) for c in curves[arm]] for i in (0, 1)]
        cells = [f"{mean[s][0]:.2f} / {mean[s][1]:.2f}" for s in steps]
        hits = [", ".join("-" if n is None else f"{n:,}" for n in per_seed) for per_seed in reached[arm]]
        print(f"| {arm} | " + " | ".join(cells) + f" | {hits[0]} | {hits[1]} |")
    return {"teacher": teacher, "curves": curves, "reached": reached}


if __name__ == "__main__":
    main()
