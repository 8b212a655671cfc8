"""`preflight=true` (rlhf.run.rehearsal): one step rehearsed on a tiny batch, a report, and the exit code of the run."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlhf import exits
from rlhf.config import compose_config
from rlhf.run.rehearsal import rehearse

RAISING_REWARD = '''
def always_fails(prompts, responses, ground_truths, **_):
    raise ValueError("the scoring service is down")
'''


def statuses(results) -> dict[str, str]:
    return {r.name: r.status for r in results}


@pytest.mark.parametrize("schedule", ["sync", "hybrid"])
def test_every_stage_of_a_step_runs_and_nothing_is_left_behind(schedule, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    results = rehearse(compose_config([f"schedule={schedule}", "algorithm=ppo"]), out)
    assert set(statuses(results).values()) == {"ok"}, [(r.name, r.detail) for r in results if r.status != "ok"]
    names = [r.name for r in results]
    assert ("generator sleep and wake" in names) == (schedule == "hybrid")
    assert {"log-prob parity", "update", "weight push (verified)", "checkpoint save and reload"} <= set(names)
    by_name = {r.name: r for r in results}
    assert "weights equal" in by_name["checkpoint save and reload"].detail
    assert all(r.seconds >= 0 and r.peak_mib > 0 for r in results)
    assert list(out.iterdir()) == []  # the checkpoint and export went to temporary folders, now gone


def test_a_lora_policy_rehearses_the_hybrid_wake_with_every_weight(tmp_path):
    """Asleep, the generator holds no weights: the rehearsed wake sends all of them, as schedule=hybrid's does, not
    the adapted layers a LoRA policy pushes after a step (which a sleeping generator cannot load)."""
    out = tmp_path / "run"
    out.mkdir()
    results = rehearse(compose_config(["schedule=hybrid", "policy.lora.rank=8", "policy.lora.alpha=16"]), out)
    assert set(statuses(results).values()) == {"ok"}, [(r.name, r.detail) for r in results if r.status != "ok"]


def test_a_failing_stage_is_named_with_its_error_and_the_rest_are_not_run(tmp_path, monkeypatch):
    (tmp_path / "raising_rewards.py").write_text(RAISING_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = compose_config(["reward.functions=[{name: raising_rewards.always_fails}]"])
    results = rehearse(cfg, tmp_path)
    failed = [r for r in results if r.status == "error"]
    assert [r.name for r in failed] == ["generate and score"]
    assert "the scoring service is down" in failed[0].detail and failed[0].exit_code == exits.RUN_RAISED
    after = results[results.index(failed[0]) + 1:]
    assert after and all(r.status == "not run" for r in after)
    assert all(r.status == "ok" for r in results[: results.index(failed[0])])


@pytest.mark.slow
def test_the_cli_prints_the_report_and_exits_with_the_runs_code(tmp_path):
    """A plan that cannot fit: the report names the stage and the fix, the exit code is the config error's (2)."""
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf.train", "preflight=true", "cluster.device_memory_gb=0.2", f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=600,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == exits.CONFIG_ERROR, output[-3000:]
    assert "preflight failed at 'memory plan'" in output and "does not fit its devices" in output
    assert "load models and data           not run" in output
