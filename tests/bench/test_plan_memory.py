"""The memory plan against the measured peak memory of a real CPU run (bench/plan_memory.py), within +-25%."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "plan_memory.py"


@pytest.mark.slow
def test_the_plan_of_the_builtin_run_is_within_25_percent_of_its_peak_rss():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--only", "builtin", "--steps", "2"], capture_output=True,
                          text=True, timeout=900, check=True)
    found = re.search(r"planned\s+(\d+) MiB\s+measured peak RSS\s+(\d+) MiB", proc.stdout)
    assert found, proc.stdout + proc.stderr
    planned, measured = (int(x) for x in found.groups())
    assert 0.75 <= planned / measured <= 1.25, proc.stdout
