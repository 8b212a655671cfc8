"""A run never starts where it cannot save, and a full disk is named as such: before any model loads, the run
folder, `checkpoint.dir` and the export folder are tried for writing and for room for a checkpoint (estimated from
the model config); a save that hits ENOSPC raises NoSpaceError naming the folder, the room needed and the room free."""

from __future__ import annotations

import errno
import logging
import os
import resource
import shutil
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest

from rlhf.run import checkpoint, preflight
from rlhf.config import ConfigError, compose_config, validate
from rlhf import disk
from rlhf.disk import tree_bytes
from rlhf.errors import FileSizeLimitError, NoSpaceError
from rlhf.models.hf_folder import save_hf_folder
from rlhf.models.loading import load_causal_lm, load_tokenizer
from rlhf.train import train

SMALL = [
    "train.prompts_per_step=4", "algorithm.num_samples_per_prompt=2", "eval.num_samples=0", "eval.greedy=false",
    "logging.tensorboard=false",
]
Usage = namedtuple("Usage", "total used free")


class NoModelLoaded(Exception):
    """Raised in place of building the models: the checks under test passed."""


@pytest.fixture
def no_models(monkeypatch):
    def refuse(*_, **__):
        raise NoModelLoaded

    monkeypatch.setattr("rlhf.train.build_components", refuse)


def free_space(monkeypatch, free: int) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10 * free + 1, 0, free))


def test_the_estimate_covers_a_real_checkpoint(tmp_path):
    """Weights plus AdamW's two moments per parameter: within 20% of what a saved checkpoint takes."""
    cfg = compose_config([*SMALL, "train.num_steps=1", "checkpoint.every=1", "checkpoint.save_final_model=false"])
    train(cfg, tmp_path)
    saved = tree_bytes(checkpoint.complete_checkpoints(tmp_path / "checkpoints")[-1])
    assert 0.8 * saved <= preflight.checkpoint_bytes(validate(cfg)) <= 1.2 * saved


def test_far_too_little_space_refuses_before_any_model_loads(tmp_path, monkeypatch, no_models):
    cfg = compose_config([*SMALL, "train.num_steps=1"])
    needed = preflight.checkpoint_bytes(validate(cfg))
    free_space(monkeypatch, needed // 10)
    with pytest.raises(ConfigError, match=r"no space for a checkpoint: needs about [\d.]+ MB, [\d.]+ MB free") as err:
        train(cfg, tmp_path / "run")
    assert str(err.value).startswith(f"checkpoint.dir={tmp_path / 'run' / 'checkpoints'}: ")
    assert not (tmp_path / "run").exists(), "the checks left folders behind"


def test_a_little_too_little_space_warns_and_goes_on(tmp_path, monkeypatch, no_models, caplog):
    cfg = compose_config([*SMALL, "train.num_steps=1"])
    free_space(monkeypatch, preflight.checkpoint_bytes(validate(cfg)) // 2)
    with caplog.at_level(logging.WARNING, logger="rlhf"), pytest.raises(NoModelLoaded):
        train(cfg, tmp_path / "run")
    warnings = [r.getMessage() for r in caplog.records if "no space for a checkpoint" in r.getMessage()]
    assert len(warnings) == 1 and "the run may fail when it saves" in warnings[0]


@pytest.mark.parametrize("key", ["checkpoint.dir", "hydra.run.dir"])
def test_an_unwritable_folder_is_refused_naming_the_key(tmp_path, no_models, key):
    """A folder under a regular file cannot be made, even by root (for whom chmod would not block writes)."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    folder = blocker / "sub"
    run_dir, extra = (folder, []) if key == "hydra.run.dir" else (tmp_path / "run", [f"checkpoint.dir={folder}"])
    with pytest.raises(ConfigError, match=f"{key}={folder} is not writable: Not a directory"):
        train(compose_config([*SMALL, "train.num_steps=1", *extra]), run_dir)


def test_a_full_disk_during_a_checkpoint_names_it_and_keeps_the_previous_one(tmp_path, monkeypatch):
    write = checkpoint._write_state

    def fill_disk_at_step_2(collector, learner, tmp, step, *args):
        write(collector, learner, tmp, step, *args)
        if step == 2:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "_write_state", fill_disk_at_step_2)
    cfg = compose_config([*SMALL, "train.num_steps=3", "checkpoint.every=1", "checkpoint.keep_last=0"])
    root = tmp_path / "checkpoints"
    message = rf"^No space left on {root}: a checkpoint needs about [\d.]+ MB, [\d.]+ MB free$"
    with pytest.raises(NoSpaceError, match=message):
        train(cfg, tmp_path)
    assert [p.name for p in checkpoint.complete_checkpoints(root)] == ["step_00000001"]
    assert not list(root.glob(".tmp-*")), "the partial copy still holds on to its space"


def test_a_full_disk_during_an_hf_export_names_it(tmp_path):
    model, tokenizer = load_causal_lm("builtin:tiny_arith"), load_tokenizer("builtin:tiny_arith")

    class FullDisk:
        def save_pretrained(self, folder, **_):
            (Path(folder) / "model.safetensors").write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")

        def parameters(self):
            return model.parameters()

    with pytest.raises(NoSpaceError, match=rf"^No space left on {tmp_path / 'out'}: the export needs about 0.3 MB"):
        save_hf_folder(tmp_path / "out", FullDisk(), tokenizer, owner="test")
    assert list(tmp_path.iterdir()) == []


def test_a_file_past_the_file_size_limit_in_an_hf_export_names_the_limit(tmp_path, monkeypatch):
    """`ulimit -f` set: safetensors reports "File too large (os error 27)", not an OSError."""
    tokenizer = load_tokenizer("builtin:tiny_arith")

    class Limited:
        def save_pretrained(self, folder, **_):
            raise RuntimeError("Error while serializing: I/O error: File too large (os error 27)")

        def parameters(self):
            return []

    monkeypatch.setattr(disk, "file_size_limit", lambda: 200 * 1024)
    with pytest.raises(FileSizeLimitError, match=r"^A file of the export in .*out passes this process's file size limit \(ulimit -f: 0.2 MB\); raise it"):
        save_hf_folder(tmp_path / "out", Limited(), tokenizer, owner="test")


def test_a_full_disk_under_a_file_size_limit_is_named_as_a_full_disk(tmp_path, monkeypatch):
    """torch says "unexpected pos" for either; with too little room left for the save, the disk is what to fix."""
    monkeypatch.setattr(disk, "file_size_limit", lambda: 100 * 2**30)
    free_space(monkeypatch, 10)
    lacking = disk.lack_of_room(RuntimeError("PytorchStreamWriter failed writing file: unexpected pos 64 vs 0"), tmp_path, "a checkpoint", 2**20)
    assert type(lacking) is NoSpaceError and str(lacking).startswith(f"No space left on {tmp_path}: a checkpoint needs about 1.0 MB")


@pytest.mark.slow
def test_a_checkpoint_past_the_file_size_limit_names_the_limit(tmp_path):
    """The default run with `ulimit -f 200` and a checkpoint each step: before, "the run raised SafetensorError: Error
    while serializing: I/O error: File too large (os error 27)" (torch's "unexpected pos" for its own files)."""
    limit = 200 * 1024  # the logs fit, a checkpoint's weights (0.3 MB) do not

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    proc = subprocess.run(
        [sys.executable, "-m", "rlhf.train", "train.num_steps=2", "checkpoint.every=1", *SMALL, f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, preexec_fn=limited,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    console = proc.stdout + proc.stderr
    assert proc.returncode == 6, console[-3000:]
    assert f"FileSizeLimitError: A file of a checkpoint in {tmp_path / 'run' / 'checkpoints'} passes this process's file size limit (ulimit -f: 0.2 MB)" in console
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp-*")), "the partial copy is removed"


FAILING_REWARD = '''
def fails_at_step_2(prompts, responses, ground_truths, **_):
    global calls
    calls = globals().get("calls", 0) + 1
    if calls == 2:
        raise ValueError("the scoring service is down")
    return [0.5] * len(responses)
'''


def test_a_full_disk_in_the_save_on_failure_is_logged_once_and_the_first_error_goes_on(tmp_path, monkeypatch, caplog):
    (tmp_path / "full_disk_rewards.py").write_text(FAILING_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "full_disk_rewards", raising=False)

    def full_disk(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "_write_state", full_disk)
    cfg = compose_config([*SMALL, "train.num_steps=3", "reward.functions=[{name: full_disk_rewards.fails_at_step_2}]"])
    with caplog.at_level(logging.ERROR, logger="rlhf"), pytest.raises(ValueError, match="scoring service is down"):
        train(cfg, tmp_path / "run")
    named = [r.getMessage() for r in caplog.records if "No space left on" in r.getMessage()]
    assert len(named) == 1 and "could not be saved either: NoSpaceError: No space left on" in named[0]
    assert "a checkpoint needs about" in named[0]


def test_train_reward_refuses_an_unwritable_save_dir_with_exit_2_before_training(tmp_path, monkeypatch, capsys):
    import sys

    import rlhf.train_reward
    from rlhf import exits

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setattr(rlhf.train_reward, "train", lambda cfg, out: pytest.fail("trained into an unwritable save_dir"))
    argv = ["rlhf.train_reward", f"hydra.run.dir={tmp_path / 'run'}", f"save_dir={blocker / 'rm'}"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exited:
        rlhf.train_reward.main()
    assert exited.value.code == exits.CONFIG_ERROR
    assert f"save_dir={blocker / 'rm'} is not writable: {blocker} is a file, not a folder" in capsys.readouterr().out  # Hydra's log


def test_a_disk_filling_during_the_run_stops_it_with_the_last_step_saved(tmp_path, monkeypatch, caplog):
    """Logs and samples fill the disk while it trains, `checkpoint.every=0`: before, every step trained, the final
    export failed on the full disk and nothing was kept. Now the run stops once the room left drops under one more
    checkpoint and the final model (`checkpoint.RESERVE`), saving the step it just finished."""
    real = checkpoint.free_bytes
    steps_seen = []
    monkeypatch.setattr(checkpoint, "free_bytes", lambda path: 1024 if len(steps_seen) >= 3 else real(path))
    original = checkpoint.check_room
    monkeypatch.setattr(checkpoint, "check_room", lambda root, step: (steps_seen.append(step), original(root, step)))
    cfg = compose_config([*SMALL, "train.num_steps=6", "checkpoint.every=0"])
    with caplog.at_level(logging.ERROR, logger="rlhf"), pytest.raises(NoSpaceError, match=r"is nearly full: 0.0 MB free"):
        train(cfg, tmp_path / "run")
    assert [p.name for p in checkpoint.complete_checkpoints(tmp_path / "run" / "checkpoints")] == ["step_00000003"]
    assert "saved the last complete step 3" in caplog.text


@pytest.mark.parametrize("raised", [RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 476736 vs 476628"),
                                    Exception("Error while serializing: IoError(Os { code: 28 })")])
def test_a_serializer_reporting_a_full_disk_in_its_own_words_is_named_as_a_full_disk(tmp_path, monkeypatch, raised):
    """torch's "unexpected pos" and safetensors' own error, raised with less room free than a checkpoint: "No space
    left on <folder>: a checkpoint needs about N MB", not the serializer's words."""
    write = checkpoint._write_state

    def fill_disk_at_step_2(collector, learner, tmp, step, *args):
        write(collector, learner, tmp, step, *args)
        if step == 2:
            monkeypatch.setattr(checkpoint, "free_bytes", lambda path: 512)  # the disk is full now
            monkeypatch.setattr(disk, "free_bytes", lambda path: 512)
            raise raised

    monkeypatch.setattr(checkpoint, "_write_state", fill_disk_at_step_2)
    monkeypatch.setattr(checkpoint, "check_room", lambda root, step, saved=False: None)  # the run's own early stop aside
    cfg = compose_config([*SMALL, "train.num_steps=3", "checkpoint.every=1", "checkpoint.keep_last=0"])
    root = tmp_path / "checkpoints"
    with pytest.raises(NoSpaceError, match=rf"^No space left on {root}: a checkpoint needs about [\d.]+ MB, 0.0 MB free$"):
        train(cfg, tmp_path)
    assert [p.name for p in checkpoint.complete_checkpoints(root)] == ["step_00000001"]


def test_the_log_estimate_covers_what_a_run_folder_takes(tmp_path):
    """Metrics, TensorBoard events, sample tables and evaluation completions of a real run: under the estimate (an
    upper bound), and not absurdly far under it."""
    cfg = compose_config([
        "train.prompts_per_step=4", "algorithm.num_samples_per_prompt=2", "train.num_steps=10", "eval.every=5",
        "eval.max_prompts=10", "eval.num_samples=2", "logging.sample_every=2", "checkpoint.save_final_model=false",
    ])
    train(cfg, tmp_path)
    written = tree_bytes(tmp_path) - tree_bytes(tmp_path / "checkpoints")
    estimate = preflight.log_bytes(cfg, validate(cfg).sizes.longest_row)
    assert written <= estimate <= 40 * written, (written, estimate)


def test_no_room_for_a_long_runs_logs_refuses_before_any_model_loads(tmp_path, monkeypatch, no_models):
    """Room for a checkpoint but not for 100,000 steps of logs and evaluations: refused, naming the run folder."""
    cfg = compose_config([*SMALL, "train.num_steps=100000", "eval.every=100", "eval.max_prompts=100", "eval.num_samples=4"])
    free_space(monkeypatch, 2 * preflight.checkpoint_bytes(validate(cfg)))
    assert preflight.log_bytes(cfg, validate(cfg).sizes.longest_row) > 8 * preflight.checkpoint_bytes(validate(cfg))
    with pytest.raises(ConfigError, match=r"hydra.run.dir=.*no space for the run's logs and evaluation completions: "
                                          r"needs about [\d.]+ MB, [\d.]+ MB free; free some space there or point hydra.run.dir"):
        train(cfg, tmp_path / "run")


def test_a_scheduled_save_that_takes_the_last_room_stops_the_run_keeping_it(tmp_path, monkeypatch, caplog):
    """Before, the check ran only before the save: the save at step 2 took the room, step 3 trained, its check failed
    and its emergency save failed too ("could not be saved either"), so step 3 was lost and the run said it would save
    it. Now the run stops right after the save that left too little room, that checkpoint kept."""
    save = checkpoint.save
    full = []

    def save_then_full(*args, **kwargs):
        path = save(*args, **kwargs)
        full.append(True)  # this save took the room
        return path

    monkeypatch.setattr(checkpoint, "save", save_then_full)
    real = checkpoint.free_bytes
    monkeypatch.setattr(checkpoint, "free_bytes", lambda path: 1024 if full else real(path))
    cfg = compose_config([*SMALL, "train.num_steps=6", "checkpoint.every=2"])
    with caplog.at_level(logging.ERROR, logger="rlhf"), pytest.raises(NoSpaceError, match=r"stops after step 2 and keeps its checkpoint"):
        train(cfg, tmp_path / "run")
    assert [p.name for p in checkpoint.complete_checkpoints(tmp_path / "run" / "checkpoints")] == ["step_00000002"]
    assert "could not be saved either" not in caplog.text
