"""Benchmark: sandbox executions per second with 1, 2 and 4 workers (`reward=code`'s `args.workers`).

Scores the same batch of responses to the built-in code tasks (`dataset=code_tasks`: one sandbox run per response,
its four assert lines run after the program) through the `code` reward, with each worker count in turn,
`--repeats` times alternating so machine noise hits every count alike, and prints per worker count:

  runs/s          median sandbox runs per second (each a fresh interpreter, set up and torn down)
  ms/run          its inverse: the wall time one run costs the batch
  vs first        the speed-up over the first worker count (1 by default), medians compared

A run is mostly the interpreter's start (about 20-40 ms of CPU), so the speed-up is bounded by the machine's cores.

Example:
  python bench/sandbox.py                      # 64 responses, workers 1, 2, 4, 3 repeats
  python bench/sandbox.py --rows 32 --workers 1,8 --repeats 1
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from rlhf.data.code_tasks import FAMILIES, code_tasks
from rlhf.rewards.code import code
from rlhf.rewards.sandbox import run_program, Limits

def batch(rows: int) -> tuple[list[str], list[list[str]]]:
    """``rows`` responses (each defines the task's function as the identity: it passes the asserts it happens to)
    and their tests."""
    tasks = code_tasks(sorted(FAMILIES), rows, 4, random.Random(0))
    responses = []
    for _, asserts in tasks:
        name = asserts[0].split("assert ")[1].split("(")[0]
        responses.append(f"```python\ndef {name}(*args):\n    return args[0]\n```")  # passes the asserts it passes
    return responses, [asserts for _, asserts in tasks]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64, help="responses per batch (one sandbox run each)")
    parser.add_argument("--workers", default="1,2,4", help="worker counts, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="alternating repeats of every worker count")
    args = parser.parse_args()
    counts = [int(n) for n in args.workers.split(",")]
    responses, truths = batch(args.rows)
    enforced = run_program("pass", Limits()).enforced
    rates: dict[int, list[float]] = {n: [] for n in counts}
    for _ in range(args.repeats):
        for n in counts:
            start = time.perf_counter()
            scores = code(prompts=[""] * args.rows, responses=responses, ground_truths=truths, workers=n)
            rates[n].append(args.rows / (time.perf_counter() - start))
            assert scores.metrics["unscored"] == 0, scores.metrics
    print(f"sandbox runs of the code reward: {args.rows} responses x 4 asserts, {os.cpu_count()} CPU cores, "
          f"enforced here: {enforced}")
    print("| workers | runs/s | ms/run | vs first |")
    print("| --- | --- | --- | --- |")
    base = statistics.median(rates[counts[0]])
    for n in counts:
        rate = statistics.median(rates[n])
        print(f"| {n} | {rate:.1f} | {1000 / rate:.1f} | {rate / base:.2f}x |")


if __name__ == "__main__":
    main()
