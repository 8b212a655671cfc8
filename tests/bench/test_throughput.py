"""bench/throughput.py in its smallest form, so the script cannot rot: one model, one budget, the hf generator."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from bench_figures import measured

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "throughput.py"


@pytest.mark.slow
def test_throughput_prints_stages_padding_and_mfu():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--sizes", "0.1m", "--budgets", "16", "--generators", "hf", "--steps", "3"],
                          capture_output=True, text=True, timeout=900, check=True, cwd=SCRIPT.parent)
    rows = re.findall(r"^\| 0\.1m \| 16 \| hf \| (.*) \|$", proc.stdout, re.M)
    assert rows, proc.stdout + proc.stderr
    cells = [c.strip() for c in rows[-1].split("|")]
    step, generation, logprobs, training = (float(c) for c in cells[:4])
    assert step > 0 and generation > 0 and training > 0
    assert logprobs < training  # one optimiser step per step: no separate logprob pass
    padding, mfu = (float(c.rstrip("%")) for c in cells[-2:])
    assert 0 <= padding < 100 and measured(mfu)
