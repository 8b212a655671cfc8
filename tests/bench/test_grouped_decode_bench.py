"""`bench/grouped_decode.py` at a tiny size, so it cannot rot: it times both attentions and prints their ratio."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "grouped_decode.py"


def test_the_grouped_decode_bench_prints_both_times_and_the_ratio():
    done = subprocess.run([sys.executable, str(SCRIPT), "--layers", "1", "--rows", "2", "--columns", "8", "--repeats", "1"],
                          check=True, capture_output=True, text=True, timeout=600)
    (row,) = [line for line in done.stdout.splitlines() if line.startswith("| 2 |")]
    copied, grouped, ratio = re.match(r"\| 2 \| 8 \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)x \|", row).groups()
    assert float(copied) > 0 and float(grouped) > 0 and float(ratio) > 0
