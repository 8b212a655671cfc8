"""Benchmark: the same GRPO work under schedule=sync and schedule=async, side by side in one run.

Each schedule trains the same number of steps from the same seed through the real CLI (`python -m rlhf.train`),
alternating sync and async runs `--repeats` times so machine noise hits both alike. Step 1 is a warm-up and is
left out. Prints, per schedule, the median seconds per step, generation (in async: the producer's, overlapped)
and trainer work (logprobs, update, weight push), then:

  ideal async step = max(generation, trainer work) of the sync run (perfect overlap)
  overlap ratio    = ideal / measured async step   (1.0 = the overlap is as good as it can be)
  speed-up         = sync step / async step

Examples:
  python bench/async_vs_sync.py                                   # tiny model, HF generator, one process
  python bench/async_vs_sync.py --ray                             # generator and trainer in separate Ray workers
  python bench/async_vs_sync.py --ray -- generator=vllm           # the same with a vLLM engine
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from cli_runs import train_records

# the same GRPO work for both schedules: enough tokens per step that generation and training both take time
WORK = [
    "algorithm=grpo", "train.prompts_per_step=64", "algorithm.num_samples_per_prompt=8", "train.micro_batch_size=128",
    "generator.max_new_tokens=8", "eval.every=0", "eval.max_prompts=8", "logging.tensorboard=false",
    "checkpoint.save_final_model=false", "algorithm.beta=0",
]
# Ray: one trainer rank and one generation engine, each its own process (the machine's two cores)
RAY = ["cluster=ray_local", "cluster.roles.policy.devices_per_node=1", "cluster.colocate=[]", "cluster.num_cpus=2"]


def run(schedule: str, steps: int, extra: list[str], folder: Path) -> list[dict]:
    """One training run; its per-step metric records (steps 2..)."""
    return train_records(schedule, [f"schedule={schedule}", f"train.num_steps={steps}", *WORK, *extra], folder)


def medians(records: list[dict]) -> dict[str, float]:
    """Median seconds per step: the whole step, generation, and the trainer's own work (logprobs, update, push)."""
    med = lambda f: statistics.median(f(r) for r in records)  # noqa: E731
    return {
        "step": med(lambda r: r["time/step"]),
        "generation": med(lambda r: r["time/generation"]),
        "trainer": med(lambda r: r["time/logprobs"] + r["time/training"] + r["time/weight_sync"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="training steps per run (step 1 is a warm-up)")
    parser.add_argument("--repeats", type=int, default=2, help="sync/async run pairs, alternated")
    parser.add_argument("--ray", action="store_true", help="generator and trainer as separate Ray workers")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for both schedules (after --)")
    args = parser.parse_args()
    extra = (RAY if args.ray else []) + args.overrides
    results: dict[str, list[dict]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            for schedule in ("sync", "async"):
                results[schedule] += run(schedule, args.steps, extra, Path(tmp))
    sync, async_ = medians(results["sync"]), medians(results["async"])
    ideal = max(sync["generation"], sync["trainer"])
    staleness = statistics.mean(r["async/staleness_mean"] for r in results["async"])
    print(f"work: {' '.join(WORK + extra)}")
    print(f"{'schedule':<8} {'s/step':>8} {'generation':>11} {'trainer work':>13}   (medians over {len(results['sync'])} steps each)")
    for name, m in (("sync", sync), ("async", async_)):
        print(f"{name:<8} {m['step']:>8.3f} {m['generation']:>11.3f} {m['trainer']:>13.3f}")
    print(f"ideal async s/step = max(sync generation, sync trainer work) = {ideal:.3f}")
    print(f"overlap ratio (ideal / async) = {ideal / async_['step']:.2f}")
    print(f"speed-up (sync / async)       = {sync['step'] / async_['step']:.2f}")
    print(f"mean staleness trained on     = {staleness:.2f} policy versions")

if __name__ == "__main__":
    main()
