"""bench/sandbox.py in its smallest form, so the script cannot rot."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "sandbox.py"


def test_sandbox_bench_prints_runs_per_second_per_worker_count():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--rows", "4", "--workers", "1,2", "--repeats", "1"],
                          capture_output=True, text=True, timeout=600, check=True, cwd=SCRIPT.parent)
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)x \|$", proc.stdout, re.M)
    assert [int(workers) for workers, *_ in rows] == [1, 2], proc.stdout + proc.stderr
    assert all(float(rate) > 0 and abs(float(rate) * float(ms) - 1000) < 0.1 * 1000 for _, rate, ms, _ in rows)
    assert rows[0][3] == "1.00" and "enforced here: {'network'" in proc.stdout
