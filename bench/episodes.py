"""Benchmark: multi-turn episodes per second on the built-in task, hf vs vLLM generator and sync vs async, side by side.

Every variant trains the same `experiment=multiturn_tiny` work from the same seed through the real CLI
(`python -m rlhf.train`); the variants alternate `--repeats` times so machine noise hits all alike. Step 1 is a
warm-up and is left out. Per variant it prints the medians over steps of:

  episodes/s (step)        = episodes trained per step / seconds per step (the whole loop: play, learn, push)
  episodes/s (generation)  = episodes per step / seconds spent playing them (in async: the producer's, overlapped)
  turns per episode, and the step's seconds

Examples:
  python bench/episodes.py                          # hf and vllm (if installed), sync and async
  python bench/episodes.py --generators hf          # without vLLM
  python bench/episodes.py -- train.prompts_per_step=64
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import tempfile
from pathlib import Path

from cli_runs import train_records

WORK = ["experiment=multiturn_tiny", "eval.every=0", "eval.max_prompts=4", "logging.tensorboard=false", "checkpoint.save_final_model=false"]
GENERATORS = {"hf": [], "vllm": ["generator=vllm", "generator.kv_cache_memory_bytes=67108864"]}


def run(generator: str, schedule: str, steps: int, extra: list[str], folder: Path) -> list[dict]:
    """One training run; its per-step metric records (steps 2..)."""
    overrides = [*WORK, *GENERATORS[generator], f"schedule={schedule}", f"train.num_steps={steps}", *extra]
    return train_records(f"{generator}-{schedule}", overrides, folder)


def summary(records: list[dict]) -> dict[str, float]:
    """Medians over steps: episodes per second of the step and of playing alone, turns per episode, seconds per step."""
    med = lambda f: statistics.median(f(r) for r in records)  # noqa: E731
    return {
        "step_rate": med(lambda r: r["env/num_episodes"] / r["time/step"]),
        "play_rate": med(lambda r: r["env/num_episodes"] / r["time/generation"]),
        "turns": med(lambda r: r["env/num_turns_per_episode"]),
        "step": med(lambda r: r["time/step"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="training steps per run (step 1 is a warm-up)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds over every variant, alternated")
    parser.add_argument("--generators", default="hf,vllm", help="comma-separated: hf, vllm (skipped when not installed)")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every variant (after --)")
    args = parser.parse_args()
    generators = [g for g in args.generators.split(",") if g != "vllm" or importlib.util.find_spec("vllm")]
    variants = [(g, s) for g in generators for s in ("sync", "async")]
    results: dict[tuple[str, str], list[dict]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            for generator, schedule in variants:
                results[(generator, schedule)] += run(generator, schedule, args.steps, args.overrides, Path(tmp))
    print(f"work: {' '.join(WORK + args.overrides)}, {args.steps} steps x {args.repeats} (medians over steps 2..)")
    print(f"{'generator':<10}{'schedule':<9}{'episodes/s':>11}{'play eps/s':>11}{'turns/ep':>9}{'s/step':>8}")
    base = None
    for (generator, schedule), records in results.items():
        s = summary(records)
        base = base or s["step_rate"]
        print(f"{generator:<10}{schedule:<9}{s['step_rate']:>11.1f}{s['play_rate']:>11.1f}{s['turns']:>9.2f}{s['step']:>8.3f}"
              f"   x{s['step_rate'] / base:.2f} vs {variants[0][0]}/{variants[0][1]}")


if __name__ == "__main__":
    main()
