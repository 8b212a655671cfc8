"""bench/shared_prefix_train.py in its smallest form, so the script cannot rot: the long shape with a short prompt on
the 0.1m model, the built-in task's shape, and the multi-turn episodes' shape (whose agreed turns share too)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "shared_prefix_train.py"


def test_shared_prefix_bench_computes_fewer_tokens_shared_and_prints_both_times():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--shapes", "long,tiny,multiturn", "--long-size", "0.1m", "--prompt", "24", "--repeats", "1"],
        capture_output=True, text=True, timeout=600, check=True, cwd=SCRIPT.parent,
    )
    rows = re.findall(r"^\| (long|tiny|multiturn) \(.*?\) \| .*? \| (\d+) \| (\d+) \| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)x \| (\w+) \|$", proc.stdout, re.M)
    assert [r[0] for r in rows] == ["long", "tiny", "multiturn"], proc.stdout + proc.stderr
    for _, rows_, unshared, shared, *_ in rows:
        assert int(shared) < int(unshared)  # the prompts once per group
    prompt_only = int(re.search(r"^multiturn: the prompt alone shared would compute (\d+) tokens$", proc.stdout, re.M)[1])
    assert int(rows[2][3]) < prompt_only  # the turns a group's episodes agree on are laid out once too
