"""No command deletes or overwrites what it did not write: every folder a command replaces whole (an exported model,
a reward model, a warm start) or prunes (a checkpoint root) must be missing, empty, or that command's earlier output,
checked before anything trains; bad warm-start flags end in one usage line (exit 2), not a traceback."""

from __future__ import annotations

import sys

import pytest

import rlhf.train_reward
from rlhf import disk, exits, warmstart
from rlhf.config import ConfigError, compose_config
from rlhf.run import checkpoint
from rlhf.train import train

SMALL = [
    "train.prompts_per_step=4", "algorithm.num_samples_per_prompt=2", "eval.num_samples=0", "eval.greedy=false",
    "logging.tensorboard=false", "train.num_steps=1",
]


def user_folder(path, name="notes.txt"):
    """A folder of the user's, holding one file; returns the file."""
    path.mkdir(parents=True)
    (path / name).write_text("mine")
    return path / name


def test_a_checkpoint_dir_holding_other_files_is_refused_before_training(tmp_path):
    kept = user_folder(tmp_path / "mine")
    with pytest.raises(ConfigError, match=r"checkpoint.dir=.*mine is a folder holding files this command did not write \(notes.txt\).*choose another checkpoint.dir"):
        train(compose_config([*SMALL, f"checkpoint.dir={tmp_path / 'mine'}"]), tmp_path / "run")
    assert kept.read_text() == "mine" and not (tmp_path / "run").exists()


def test_a_final_model_folder_the_run_did_not_write_is_refused_before_training(tmp_path):
    kept = user_folder(tmp_path / "run" / "final_model", "data.jsonl")
    with pytest.raises(ConfigError, match=r"checkpoint.save_final_model=.*final_model is a folder holding files .*choose another hydra.run.dir, or set checkpoint.save_final_model=false"):
        train(compose_config(SMALL), tmp_path / "run")
    assert kept.read_text() == "mine"


def test_a_checkpoint_dir_inside_the_exported_model_is_refused(tmp_path):
    """The export replaces final_model whole: checkpoints saved inside it would go with it."""
    with pytest.raises(ConfigError, match=r"checkpoint.dir=.* lies in checkpoint.save_final_model=.*final_model, a folder replaced whole"):
        train(compose_config([*SMALL, f"checkpoint.dir={tmp_path / 'run' / 'final_model' / 'ckpt'}"]), tmp_path / "run")


def test_a_run_replaces_its_own_earlier_export_and_keeps_its_checkpoints(tmp_path):
    """The same run folder again (resume=auto): its final_model and checkpoint root are its own, so it goes on."""
    for _ in range(2):
        train(compose_config([*SMALL, "checkpoint.every=1", "resume=auto"]), tmp_path / "run")
    assert disk.owner_of(tmp_path / "run" / "final_model") == disk.TRAIN_EXPORT
    assert disk.owner_of(tmp_path / "run" / "checkpoints") == disk.TRAIN_CHECKPOINTS


def test_a_checkpoint_root_saved_before_roots_were_marked_still_resumes(tmp_path):
    root = tmp_path / "checkpoints"
    (root / "step_00000001").mkdir(parents=True)
    (root / ".tmp-step_00000002-123").mkdir()
    disk.check_own_output(root, "checkpoint.dir", disk.TRAIN_CHECKPOINTS, ours=checkpoint.is_checkpoint_entry)


def test_one_commands_output_is_not_anothers(tmp_path):
    (tmp_path / "m").mkdir()
    disk.claim(tmp_path / "m", disk.TRAIN_EXPORT)
    disk.check_own_output(tmp_path / "m", "checkpoint.save_final_model", disk.TRAIN_EXPORT)
    with pytest.raises(ConfigError, match=r"save_dir=.*m holds the output of `rlhf.train checkpoint.save_final_model`"):
        disk.check_own_output(tmp_path / "m", "save_dir", disk.REWARD_MODEL)


def train_reward(monkeypatch, *overrides: str) -> int:
    """`python -m rlhf.train_reward *overrides` in this process; its exit code."""
    monkeypatch.setattr(sys, "argv", ["rlhf.train_reward", *overrides])
    with pytest.raises(SystemExit) as exited:
        rlhf.train_reward.main()
    return exited.value.code


def test_train_reward_refuses_a_save_dir_holding_files_with_exit_2_before_training(tmp_path, monkeypatch, capsys):
    kept = user_folder(tmp_path / "mine")
    assert train_reward(monkeypatch, f"hydra.run.dir={tmp_path / 'run'}", f"save_dir={tmp_path / 'mine'}") == exits.CONFIG_ERROR
    assert f"save_dir={tmp_path / 'mine'} is a folder holding files this command did not write (notes.txt)" in capsys.readouterr().out
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"] and kept.read_text() == "mine"


def test_train_reward_refuses_save_dir_dot_before_training(tmp_path, monkeypatch, capsys):
    """`save_dir=.` names the working folder itself (before, it trained, then failed leaving the model hidden)."""
    kept = user_folder(tmp_path / "work")
    monkeypatch.chdir(tmp_path / "work")
    assert train_reward(monkeypatch, f"hydra.run.dir={tmp_path / 'run'}", "save_dir=.") == exits.CONFIG_ERROR
    assert f"save_dir={tmp_path / 'work'} is a folder holding files" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "work"] and kept.read_text() == "mine"


def warmstart_error(capsys, *argv: str) -> str:
    """The one-line error `python -m rlhf.warmstart *argv` ends with (exit 2, no traceback)."""
    with pytest.raises(SystemExit) as exited:
        warmstart.main(list(argv))
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in err and err.startswith("usage:")
    return err.strip().splitlines()[-1]


def test_warmstart_refuses_an_output_dir_that_is_a_file(tmp_path, capsys):
    data = tmp_path / "good.jsonl"
    data.write_text('{"prompt": "1+1="}\n')
    line = warmstart_error(capsys, "--output-dir", str(data), "--steps", "1")
    assert f"--output-dir={data} is a file, which this command did not write" in line
    assert data.read_text() == '{"prompt": "1+1="}\n'


def test_warmstart_refuses_a_folder_holding_files(tmp_path, capsys):
    kept = user_folder(tmp_path / "mine")
    assert "is a folder holding files this command did not write (notes.txt)" in warmstart_error(capsys, "--output-dir", str(tmp_path / "mine"))
    assert kept.read_text() == "mine"


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--steps", "-5"], "--steps=-5 must be >= 1"),
        (["--max-operand", "500"], "--max-operand=500 must be within 0..49"),
        (["--batch-size", "0"], "--batch-size=0 must be within 1..6400"),
        (["--lr", "nan"], "--lr=nan must be a positive number"),
        (["--max-operand", "x"], "argument --max-operand: invalid int value: 'x'"),
    ],
)
def test_warmstart_bad_flags_end_in_one_line(tmp_path, capsys, flags, says):
    assert says in warmstart_error(capsys, "--output-dir", str(tmp_path / "m"), *flags)
    assert not (tmp_path / "m").exists()


def test_warmstart_replaces_its_own_earlier_output_and_the_committed_assets(tmp_path):
    for _ in range(2):
        warmstart.main(["--output-dir", str(tmp_path / "m"), "--steps", "1", "--batch-size", "2"])
    assert disk.owner_of(tmp_path / "m") == disk.WARM_START
    for asset in (warmstart.DEFAULT_OUTPUT, warmstart.RETRY_OUTPUT, warmstart.TEACHER_OUTPUT, warmstart.COUNT_OUTPUT,
                  warmstart.COUNT_TEACHER_OUTPUT):
        disk.check_own_output(asset, "--output-dir", disk.WARM_START)
