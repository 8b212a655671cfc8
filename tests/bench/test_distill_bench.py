"""bench/distill.py in its smallest form (two steps, one seed, two arms), so the script cannot rot."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # the script imports its neighbour cli_runs
    spec = importlib.util.spec_from_file_location("distill_bench", BENCH / "distill.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_distill_bench_evaluates_the_teacher_and_both_arms_from_the_same_start(bench, capsys):
    result = bench.main(["--steps", "2", "--every", "2", "--seeds", "1", "--arms", "opd-64x1,grpo-16x4", "--eval-prompts", "16"])
    out = capsys.readouterr().out
    assert result["teacher"][0] >= 0.95  # the counting teacher is greedy-perfect; the warm start is not
    (opd,), (grpo,) = result["curves"]["opd-64x1"], result["curves"]["grpo-16x4"]
    assert sorted(opd) == sorted(grpo) == [0, 2]
    assert opd[0] == grpo[0] and opd[0][0] < result["teacher"][0] - 0.2  # one warm start, well below the teacher
    assert opd[2] != opd[0] and grpo[2] != grpo[0]  # both arms trained
    assert "| opd-64x1 | " in out and "| grpo-16x4 | " in out and "teacher (builtin:tiny_count_teacher)" in out


def test_an_unknown_arm_is_refused_naming_the_choices(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--arms", "opd-64x1,ppo"])
    assert "--arms: unknown ppo; choose from opd-64x1, grpo-8x8" in capsys.readouterr().err
