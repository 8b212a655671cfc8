"""bench/cpu_limits.py in its smallest form (the 0.1m shape, no compile), so the script cannot rot."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from bench_figures import measured

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "cpu_limits.py"


@pytest.mark.slow
def test_cpu_limits_prints_product_rates_training_share_and_decode_steps():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--size", "0.1m", "--no-compile", "--repeats", "1"],
                          capture_output=True, text=True, timeout=900, check=True, cwd=SCRIPT.parent)
    out = proc.stdout
    peak, own = (float(x) for x in re.search(r"square peak (\d+) GFLOP/s.* tokens (\d+) GFLOP/s", out).groups())
    assert peak > 0 and own > 0
    found = re.search(r"eager ([\d.]+) s, MFU (\d+)% on real tokens; matrix products (\d+)% of the time, at (\d+) GFLOP/s", out)
    seconds, mfu, share, rate = found.groups()
    assert float(seconds) > 0 and measured(int(mfu)) and 0 < int(share) < 100 and int(rate) > 0
    steps = re.findall(r"^\| (\d+) \| ([\d.]+) \|$", out, re.M)
    assert [int(rows) for rows, _ in steps] == [1, 8, 32, 64], out + proc.stderr
    assert all(float(ms) > 0 for _, ms in steps)
