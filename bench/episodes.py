"""Benchmark: multi-turn episodes per second on the built-in task, hf vs vLLM generator, sync vs async, and the
in-process agent loop vs an OpenAI-SDK agent through the endpoint, side by side.

Every variant trains the same work (`experiment=multiturn_tiny`; `--loops endpoint`: `experiment=agent_tiny`, the same
task, model and budget played by examples/agents/arith_retry.py over HTTP) from the same seed through the real CLI
(`python -m rlhf.train`); the variants alternate `--repeats` times so machine noise hits all alike. Step 1 is a
warm-up and is left out. Per variant it prints the medians over steps of:

  episodes/s (step)        = episodes trained per step / seconds per step (the whole loop: play, learn, push)
  episodes/s (generation)  = episodes per step / seconds spent playing them (in async: the producer's, overlapped)
  turns per episode, and the step's seconds

Examples:
  python bench/episodes.py                          # hf and vllm (if installed), sync and async
  python bench/episodes.py --generators hf          # without vLLM
  python bench/episodes.py -- train.prompts_per_step=64
  python bench/episodes.py --loops env,endpoint --generators hf --schedules sync   # the endpoint's cost
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import tempfile
from pathlib import Path

from cli_runs import train_records

LOOPS = {"env": ["experiment=multiturn_tiny"], "endpoint": ["experiment=agent_tiny"]}  # the task in process, or through HTTP
WORK = ["eval.every=0", "eval.max_prompts=4", "logging.tensorboard=false", "checkpoint.save_final_model=false"]
GENERATORS = {"hf": [], "vllm": ["generator=vllm", "generator.kv_cache_memory_bytes=67108864"]}


def run(loop: str, generator: str, schedule: str, steps: int, extra: list[str], folder: Path) -> list[dict]:
    """One training run; its per-step metric records (steps 2..)."""
    overrides = [*LOOPS[loop], *WORK, *GENERATORS[generator], f"schedule={schedule}", f"train.num_steps={steps}", *extra]
    return train_records(f"{loop}-{generator}-{schedule}", overrides, folder)


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
    parser.add_argument("--schedules", default="sync,async", help="comma-separated: sync, async, hybrid")
    parser.add_argument("--loops", default="env", help="comma-separated: env (in process), endpoint (an OpenAI-SDK agent over HTTP)")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every variant (after --)")
    args = parser.parse_args()
    generators = [g for g in args.generators.split(",") if g != "vllm" or importlib.util.find_spec("vllm")]
    variants = [(l, g, s) for l in args.loops.split(",") for g in generators for s in args.schedules.split(",")]
    results: dict[tuple[str, str, str], list[dict]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            for loop, generator, schedule in variants:
                results[(loop, generator, schedule)] += run(loop, generator, schedule, args.steps, args.overrides, Path(tmp))
    print(f"work: {' '.join(WORK + args.overrides)}, {args.steps} steps x {args.repeats} (medians over steps 2..)")
    print(f"{'loop':<9}{'generator':<10}{'schedule':<9}{'episodes/s':>11}{'play eps/s':>11}{'turns/ep':>9}{'s/step':>8}")
    base = None
    for (loop, generator, schedule), records in results.items():
        s = summary(records)
        base = base or s["play_rate"]
        print(f"{loop:<9}{generator:<10}{schedule:<9}{s['step_rate']:>11.1f}{s['play_rate']:>11.1f}{s['turns']:>9.2f}{s['step']:>8.3f}"
              f"   play x{s['play_rate'] / base:.2f} vs {'/'.join(variants[0])}")


if __name__ == "__main__":
    main()
