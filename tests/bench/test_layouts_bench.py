"""bench/layouts.py in its smallest form, so the script cannot rot: the 0.1m shape, a few short rows."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "layouts.py"


def test_layouts_bench_computes_fewer_tokens_justified_and_fewest_packed():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--sizes", "0.1m", "--rows", "8", "--prompts", "2:12", "--responses", "1:8",
         "--tokens", "256", "--repeats", "1"],
        capture_output=True, text=True, timeout=600, check=True, cwd=SCRIPT.parent,
    )
    rows = dict(re.findall(r"^\| 0\.1m \| (aligned|justified|packed) \| (\d+) \|", proc.stdout, re.M))
    assert set(rows) == {"aligned", "justified", "packed"}, proc.stdout + proc.stderr
    assert int(rows["packed"]) < int(rows["justified"]) < int(rows["aligned"])
