"""Corrupt checkpoints never block the next run: resume=auto skips a broken newest checkpoint (naming it and why)
and resumes from the newest that loads; an explicit resume=<broken checkpoint> is a config error naming the file."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from rlhf.run.checkpoint import STATE_FILE, complete_checkpoints
from rlhf.config import ConfigError, compose_config
from rlhf.train import train

SMALL = [
    "train.prompts_per_step=4", "algorithm.num_samples_per_prompt=2", "eval.num_samples=0", "eval.greedy=false",
    "logging.tensorboard=false", "checkpoint.every=2",
]
WEIGHTS = Path("policy") / "model" / "model.safetensors"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A run folder whose checkpoints are step 2 and step 4 (built once; tests work on copies)."""
    out = tmp_path_factory.mktemp("trained")
    train(compose_config([*SMALL, "train.num_steps=4"]), out)
    assert [p.name for p in complete_checkpoints(out / "checkpoints")] == ["step_00000002", "step_00000004"]
    return out


@pytest.fixture
def run_dir(trained, tmp_path) -> Path:
    shutil.copytree(trained / "checkpoints", tmp_path / "checkpoints")
    return tmp_path


def truncate(file: Path, keep: float = 0.5) -> None:
    """Cut ``file`` short, as a full disk or a copy that was stopped would."""
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])


def test_truncated_weights_resume_auto_falls_back_to_the_older_checkpoint(run_dir, caplog):
    broken = run_dir / "checkpoints" / "step_00000004"
    truncate(broken / WEIGHTS)
    with caplog.at_level(logging.INFO, logger="rlhf"):
        state = train(compose_config([*SMALL, "train.num_steps=5", "resume=auto"]), run_dir)
    warning = next(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "corrupt" in r.getMessage())
    assert str(broken) in warning and str(broken / WEIGHTS) in warning and "truncated" in warning
    assert "starting at step 2" in caplog.text
    assert state.step == 5


@pytest.mark.parametrize("content", ['{"step": 4, "run": {"run_id"', "[]", '{"step": 4}'])
def test_broken_trainer_state_resume_auto_falls_back(run_dir, caplog, content):
    """A truncated, non-object, or incomplete trainer_state.json is skipped, naming the file."""
    broken = run_dir / "checkpoints" / "step_00000004"
    (broken / STATE_FILE).write_text(content)
    cfg = compose_config([*SMALL, "train.num_steps=5", "resume=auto"])
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        from rlhf.run.checkpoint import resume_path

        assert resume_path(cfg, run_dir / "checkpoints") == run_dir / "checkpoints" / "step_00000002"
    assert str(broken / STATE_FILE) in caplog.text


def test_explicit_resume_of_a_corrupt_checkpoint_is_an_error_naming_the_file(run_dir):
    broken = run_dir / "checkpoints" / "step_00000004"
    truncate(broken / "policy" / "optim.pt")
    with pytest.raises(ConfigError, match="corrupt") as err:
        train(compose_config([*SMALL, "train.num_steps=5", f"resume={broken}"]), run_dir)
    assert str(broken / "policy" / "optim.pt") in str(err.value)


def test_resume_auto_with_every_checkpoint_broken_is_an_error_naming_each(run_dir):
    for step in ("step_00000002", "step_00000004"):
        truncate(run_dir / "checkpoints" / step / WEIGHTS)
    with pytest.raises(ConfigError, match="no checkpoint .* loads") as err:
        train(compose_config([*SMALL, "train.num_steps=5", "resume=auto"]), run_dir)
    assert all(str(run_dir / "checkpoints" / s / WEIGHTS) in str(err.value) for s in ("step_00000002", "step_00000004"))


def test_a_checkpoint_missing_its_optimiser_state_is_skipped_by_resume_auto(run_dir, caplog):
    """A newest checkpoint whose `policy/optim.pt` is gone (its trainer_state.json intact): resume=auto names the
    missing file and resumes from the older one (before, it picked the broken one and failed loading it)."""
    broken = run_dir / "checkpoints" / "step_00000004"
    (broken / "policy" / "optim.pt").unlink()
    with caplog.at_level(logging.INFO, logger="rlhf"):
        state = train(compose_config([*SMALL, "train.num_steps=5", "resume=auto"]), run_dir)
    assert f"{broken / 'policy' / 'optim.pt'} is missing" in caplog.text
    assert state.step == 5 and "starting at step 2" in caplog.text
