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


@pytest.mark.parametrize("damage", ["weights deleted", "policy folder deleted", "optimiser state shortened", "config not YAML"])
def test_a_checkpoint_missing_what_its_save_wrote_is_skipped_naming_the_file(run_dir, caplog, damage):
    """trainer_state.json lists every file the save wrote, with its size: a file deleted or changed since is named and
    the checkpoint skipped (before, a deleted weights file passed the checks and the run failed once the models had
    loaded, advising the same resume again); a recorded config.yaml that does not parse is named too."""
    broken = run_dir / "checkpoints" / "step_00000004"
    if damage == "weights deleted":
        (broken / WEIGHTS).unlink()
        named = broken / WEIGHTS
    elif damage == "policy folder deleted":
        shutil.rmtree(broken / "policy")
        named = broken / "policy"
    elif damage == "optimiser state shortened":  # a torch file still readable as a zip, but not the one saved
        import torch

        torch.save({}, broken / "policy" / "optim.pt")
        named = broken / "policy" / "optim.pt"
    else:
        (broken / "config.yaml").write_text("train: {lr: [")
        named = broken / "config.yaml"
    cfg = compose_config([*SMALL, "train.num_steps=5", "resume=auto"])
    from rlhf.run.checkpoint import resume_path

    with caplog.at_level(logging.WARNING, logger="rlhf"):
        assert resume_path(cfg, run_dir / "checkpoints") == run_dir / "checkpoints" / "step_00000002"
    assert str(named) in caplog.text
    with pytest.raises(ConfigError, match="the checkpoint is corrupt"):
        resume_path(compose_config([*SMALL, "train.num_steps=5", f"resume={broken}"]), run_dir / "checkpoints")


def test_a_removal_cut_short_leaves_no_step_folder_missing_files_and_the_next_save_clears_it(run_dir, monkeypatch):
    """Pruning renames a checkpoint to a `.tmp-` name before deleting it: a prune stopped half way (kill -9) leaves no
    step folder that lacks some of its files (before, a step folder holding only config.yaml stayed forever)."""
    import os

    from rlhf.run import checkpoint

    root = run_dir / "checkpoints"
    older = root / "step_00000002"

    def stopped(path, ignore_errors=False):
        raise KeyboardInterrupt  # the removal stops before deleting anything

    monkeypatch.setattr(checkpoint.shutil, "rmtree", stopped)
    with pytest.raises(KeyboardInterrupt):
        checkpoint._remove(older)
    monkeypatch.undo()
    assert not older.exists() and [p.name for p in complete_checkpoints(root)] == ["step_00000004"]
    leftover = [p.name for p in root.iterdir() if p.name.startswith(".tmp-removing-step_00000002")]
    assert leftover == [f".tmp-removing-step_00000002-{os.getpid()}"]
    train(compose_config([*SMALL, "train.num_steps=5", "resume=auto"]), run_dir)
    assert not any(p.name.startswith(".tmp-") for p in root.iterdir())
