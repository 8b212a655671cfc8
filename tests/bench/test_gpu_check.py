"""The GPU check script in its CPU form, so it cannot rot between the sessions that have a GPU to run it on."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"
sys.path.insert(0, str(SCRIPT.parent))
from gpu_train import CONFIGS, RANGES, device_gaps  # noqa: E402

from bench_figures import measured  # noqa: E402


@pytest.mark.slow
def test_gpu_check_runs_at_tiny_scale_on_cpu(tmp_path):
    out = tmp_path / "figures.json"
    sections = "peak,generate,train,grpo_step,hybrid,strategies,learn"
    done = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--device", "cpu", "--json", str(out), "--sections", sections],
                          check=True, capture_output=True, text=True, timeout=900)
    figures = json.loads(out.read_text())
    assert figures["peak"]["matmul_tflops"] > 0
    speed = figures["generate"]["speed"]  # every decode path the CPU runs, timed, giving the eager loop's greedy tokens
    assert [row["path"] for row in speed] == ["eager", "static"]
    assert all(row["tokens_per_s"] > 0 and row["greedy_same_as_eager"] for row in speed), speed
    (checked,) = figures["generate"]["float32"]  # float32: the static path's greedy tokens are the eager loop's
    assert checked.pop("nucleus_tokens") > 0, checked
    assert checked == {"path": "static", "dtype": "float32", "rows": 8, "new_tokens": 32, "greedy_same_as_eager": True,
                       "greedy_rows_same": 1.0, "same_after_push": True, "graphs_recorded_by_the_push": 0,
                       "same_after_sleep_wake": True}
    top = figures["generate"]["static_profile"]["top"]  # where the static step's time goes, by operator
    assert top and all(row["ms"] > 0 and 0 < row["share"] <= 1 for row in top), top
    for run in figures["learn"]:  # 10 steps: the run works and is measured (tests/e2e checks that it learns)
        assert run["s_per_step"] > 0 and 0 <= run["sampled_end"] <= 1, run
    train = figures["train"]
    # every configuration but the compiled ones (tests/models/test_compile.py) ran and was measured
    assert [row["config"] for row in train["configs"]] == [c.name for c in CONFIGS if not c.compile]
    for row in train["configs"] + train["largest_micro_batch"] + train["long_rows"]:
        assert row["tokens_per_s"] > 0 and measured(row["mfu"]), row
    assert train["syncs"] == {"skipped": "CUDA only (torch.cuda.set_sync_debug_mode)"}
    (profiled,) = train["profile"]  # the host's side of a pass: each of its parts was seen, and the host's top operators
    assert set(profiled["host_ms"]) == set(RANGES) and all(ms > 0 for ms in profiled["host_ms"].values()), profiled
    assert profiled["top_host_ops"] and profiled["device_idle_ms_while"] == {}, profiled
    step = figures["grpo_step"]
    assert step["training_tokens_per_s"] > 0 and measured(step["training_mfu"]), step
    assert step["planned_gib"] > 0, step  # the planner's figure (compared with max_memory_allocated on CUDA)
    assert figures["hybrid"]["freed_bytes_reported"] > 0
    assert "#### configs" in done.stdout and "| config |" in done.stdout  # the table printed last
    for row in figures["strategies"]:
        assert row["loss"] == row["loss_single"] and row["max_weight_diff_vs_single"] == 0.0, row


def test_device_gaps_are_the_spans_no_kernel_covers():
    kernels = [(10.0, 50.0), (40.0, 60.0), (100.0, 130.0), (135.0, 140.0)]  # overlapping, then a 40 us and a 5 us gap
    assert device_gaps(kernels, 0.0, 200.0) == [(60.0, 100.0), (140.0, 200.0)]  # 0-10 and 130-135: under 20 us
    assert device_gaps(kernels, 0.0, 200.0, least_us=1.0) == [(0.0, 10.0), (60.0, 100.0), (130.0, 135.0), (140.0, 200.0)]
    assert device_gaps([], 5.0, 105.0) == [(5.0, 105.0)]


def test_micro_batches_are_whole_rows_from_one():
    from gpu_check import numbers  # noqa: E402 (bench/ is on the path above)

    assert numbers("16,64") == [16, 64] and numbers(None) is None and numbers("") is None
    for bad in ("0", "16,x", "-4", "16,,64"):
        with pytest.raises(argparse.ArgumentTypeError, match="whole numbers from 1"):
            numbers(bad)
