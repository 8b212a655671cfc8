"""Benchmark: what the default-on self-checks (`checks.*`) cost, on the default run and on a ~3M-parameter model.

Runs the same GRPO work through the real CLI with the checks on (the defaults) and off (`checks.weight_sync=off
checks.parity_prompts=0`), alternating `--repeats` times so machine noise hits both alike, and prints per model:

  s/step on, off     median seconds per step (step 1, a warm-up, left out) and their ratio: the end-to-end
                     figure, as noisy as the machine (compare the two columns below)
  push on - off      median `time/weight_sync` with the checks minus without: the verification inside the runs
  verify/push        the checks' own per-step work timed alone: fingerprinting the pushed state and the
                     generator's weights (the log-prob figures and the jump watch reuse tensors the step has)
  share              push on - off over s/step (off): the checks' per-step cost, free of the step times' noise
  probe              the one-time parity gate before step 1 (from the run's log), and its share of a 200-step run

Example:
  python bench/checks_overhead.py                 # built-in tiny model and a 3.2M-parameter Llama
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch
from cli_runs import save_random_llama, train_records

from rlhf.models.loading import load_causal_lm
from rlhf.models.fingerprint import fingerprint

WORK = ["eval.every=0", "eval.max_prompts=4", "logging.tensorboard=false", "checkpoint.save_final_model=false"]
OFF = ["checks.weight_sync=off", "checks.parity_prompts=0"]
PROBE_LINE = re.compile(r"log-prob parity .*, (\d+\.\d+) s\)")  # rlhf.checks.parity.gate's line
DEFAULT_RUN_STEPS = 200  # train.num_steps of the default run, for the probe's share


def verify_seconds(model_path: str, repeats: int = 20) -> float:
    """Median seconds of one verified push's own work: the trainer's and the generator's fingerprints."""
    state = load_causal_lm(model_path).state_dict()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fingerprint(state, torch.float32)
        fingerprint(state)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def probe_seconds(run_folder: Path) -> float | None:
    log_file = next(run_folder.glob("*.log"), None)
    found = PROBE_LINE.search(log_file.read_text()) if log_file else None
    return float(found.group(1)) if found else None


def measure(name: str, model: list[str], steps: int, repeats: int, folder: Path) -> dict:
    records = {"on": [], "off": []}
    probes = []
    for repeat in range(repeats):
        for mode in ("on", "off") if repeat % 2 == 0 else ("off", "on"):  # alternate which goes first
            records[mode] += train_records(f"{name}-{mode}", [*model, *WORK, f"train.num_steps={steps}", *(OFF if mode == "off" else [])], folder)
            if mode == "on":
                probes.append(probe_seconds(max(folder.glob(f"{name}-on-*"), key=lambda p: p.stat().st_mtime)))
    step = {mode: statistics.median(r["time/step"] for r in rs) for mode, rs in records.items()}
    push = {mode: statistics.median(r["time/weight_sync"] for r in rs) for mode, rs in records.items()}
    return {"step": step, "push": push["on"] - push["off"], "probe": statistics.median(p for p in probes if p is not None)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="training steps per run (step 1 is a warm-up)")
    parser.add_argument("--repeats", type=int, default=2, help="on/off run pairs, alternated")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        llama = save_random_llama(folder / "llama_3m", hidden=256, layers=4, intermediate=512, vocab=2048, heads=4)
        models = {
            "built-in tiny (default run)": ("builtin:tiny_arith", []),
            "Llama 3.2M": (str(llama), [f"model.name_or_path={llama}", "generator.max_new_tokens=32", "dataset.max_prompt_length=16"]),
        }
        print(f"{'model':<28} {'s/step on':>9} {'off':>7} {'on/off':>7} {'push on-off':>12} {'verify/push':>12} {'share':>7} "
              f"{'probe s':>8} {'probe share':>12}")
        for name, (path, overrides) in models.items():
            result = measure(name.split()[0], overrides, args.steps, args.repeats, folder)
            on, off = result["step"]["on"], result["step"]["off"]
            verify = verify_seconds(path)
            probe = result["probe"]
            print(
                f"{name:<28} {on:>9.3f} {off:>7.3f} {on / off:>7.3f} {result['push'] * 1e3:>10.2f}ms {verify * 1e3:>10.2f}ms "
                f"{result['push'] / off:>7.2%} {probe:>8.2f} {probe / (DEFAULT_RUN_STEPS * off):>12.2%}"
            )


if __name__ == "__main__":
    main()
