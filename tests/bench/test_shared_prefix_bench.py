"""`bench/shared_prefix.py` at a tiny size, so it cannot rot: both decode paths, shared and unshared, with ratios and
what `auto` picks at each shape."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "shared_prefix.py"


def test_the_shared_prefix_bench_prints_both_layouts_and_their_ratios_per_shape_and_path():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--shapes", "long,tiny", "--prompts", "long=1,tiny=2", "--samples", "2", "--repeats", "1"],
        check=True, capture_output=True, text=True, timeout=600, cwd=SCRIPT.parent,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = [dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")))) for line in lines[1:]]
    assert [(row["shape"], row["path"]) for row in rows] == [("long", "eager"), ("long", "static"), ("tiny", "eager"), ("tiny", "static")]
    for row in rows:
        assert float(row["prompt_pass_unshared_s"]) > 0 and float(row["generate_shared_s"]) > 0
        assert float(row["prompt_pass_x"].rstrip("x")) > 0 and float(row["generate_x"].rstrip("x")) > 0
        assert row["auto"] == ("shared" if row["shape"] == "long" else "unshared")
        assert row["rows"] == ("2" if row["shape"] == "long" else "4")
