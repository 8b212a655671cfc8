"""bench/lora.py in its smallest form (0.1M-parameter Llama, one step per run), so the script cannot rot."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.slow
def test_lora_bench_prints_both_runs_and_lora_trains_and_syncs_less(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCH))  # the script imports its neighbour cli_runs
    spec = importlib.util.spec_from_file_location("lora_bench", BENCH / "lora.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--size", "0.1m", "--steps", "1"])
    out = capsys.readouterr().out
    full, lora = result["runs"]["full"], result["runs"]["LoRA r8"]
    for row in (full, lora):
        assert all(row[key] > 0 for key, _, _ in bench.COLUMNS), row
    assert lora["trainable"] < full["trainable"] and lora["optimizer_mib"] < full["optimizer_mib"]
    assert lora["sync_mb"] < full["sync_mb"]
    assert "| full | " in out and "| LoRA r8 | " in out and "| LoRA r8 / full | " in out
    assert result["generation"]["merged"] > 0 and result["generation"]["unmerged"] > 0
    assert result["generation"]["logit_gap"] < 1e-4  # merged weights compute what the adapters do
