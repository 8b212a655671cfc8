"""One run per run folder: a second run on a folder held by a live process refuses at once, naming that process;
a lock left by a process that is gone is taken over with a warning."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time

import pytest

import rlhf.train_reward
from rlhf import exits
from rlhf.config import compose_config
from rlhf.run.lock import LOCK_FILE, FolderInUseError, folder_lock, lock_path
from rlhf.train import train


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_second_lock_on_a_held_folder_is_refused_naming_the_holder(tmp_path):
    with folder_lock(tmp_path, "run folder"):  # flock conflicts between two opens even within one process
        with pytest.raises(FolderInUseError, match=rf"in use by another run \(pid {os.getpid()} on host "):
            with folder_lock(tmp_path, "run folder"):
                pass
        holder = json.loads((tmp_path / LOCK_FILE).read_text())
        assert (holder["pid"], holder["host"]) == (os.getpid(), socket.gethostname())
        assert abs(holder["started"] - time.time()) < 60
    assert not (tmp_path / LOCK_FILE).exists(), "a released lock leaves no file behind"
    with folder_lock(tmp_path, "run folder"):  # and the folder can be taken again
        pass


def test_a_lock_left_by_a_dead_process_is_taken_over_with_a_warning(tmp_path, caplog):
    pid = dead_pid()
    holder = {"pid": pid, "host": socket.gethostname(), "started": time.time() - 60}
    (tmp_path / LOCK_FILE).write_text(json.dumps(holder))
    with caplog.at_level(logging.WARNING, logger="rlhf"), folder_lock(tmp_path, "run folder"):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert f"taking over a stale lock left by pid {pid}" in caplog.text


def test_a_folder_replaced_whole_keeps_its_lock_beside_it(tmp_path):
    with folder_lock(tmp_path / "reward_model", "save_dir", beside=True):
        assert lock_path(tmp_path / "reward_model", beside=True).exists()
        assert not (tmp_path / "reward_model").exists(), "the export folder itself is left to its atomic writer"
        with pytest.raises(FolderInUseError, match="save_dir .*reward_model is in use"):
            with folder_lock(tmp_path / "reward_model", "save_dir", beside=True):
                pass


def test_train_refuses_a_run_folder_held_by_another_run(tmp_path):
    cfg = compose_config(["train.num_steps=1", "logging.tensorboard=false"])
    with folder_lock(tmp_path / "run", "run folder"):
        with pytest.raises(FolderInUseError, match=f"pid {os.getpid()}"):
            train(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_the_cli_refuses_a_held_run_folder_at_once_with_exit_2(tmp_path):
    run_dir = tmp_path / "run"
    with folder_lock(run_dir, "run folder"):  # this test process is the "other run"
        start = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "rlhf.train", "train.num_steps=2", f"hydra.run.dir={run_dir}"],
            cwd=tmp_path, capture_output=True, text=True, timeout=120,
        )
        took = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert f"is in use by another run (pid {os.getpid()} on host {socket.gethostname()}" in out
    assert "Traceback" not in out
    assert took < 60, f"refusing took {took:.0f} s"  # no model is loaded before the lock is taken


def test_a_refused_run_leaves_the_live_runs_folder_as_it_was(tmp_path):
    """Refused before Hydra writes: the live run's `.hydra/config.yaml` and `train.log` are untouched (before, the
    refused run had rewritten the one and written into the other)."""
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text("the live run's config\n")
    (run_dir / "train.log").write_text("the live run's log\n")
    with folder_lock(run_dir, "run folder"):
        proc = subprocess.run([sys.executable, "-m", "rlhf.train", "train.lr=3e-4", f"hydra.run.dir={run_dir}"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "is in use by another run" in proc.stderr, (proc.stdout + proc.stderr)[-2000:]
    assert (run_dir / ".hydra" / "config.yaml").read_text() == "the live run's config\n"
    assert (run_dir / "train.log").read_text() == "the live run's log\n"


def test_train_reward_refuses_a_save_dir_held_by_another_run_with_exit_2(tmp_path, monkeypatch, capsys):
    save_dir = tmp_path / "rm"
    monkeypatch.setattr(rlhf.train_reward, "train", lambda cfg, out: pytest.fail("trained on a folder in use"))
    monkeypatch.setattr(sys, "argv", ["rlhf.train_reward", f"hydra.run.dir={tmp_path / 'run'}", f"save_dir={save_dir}"])
    with folder_lock(save_dir, "save_dir", beside=True), pytest.raises(SystemExit) as exited:
        rlhf.train_reward.main()
    assert exited.value.code == exits.CONFIG_ERROR
    assert f"save_dir {save_dir} is in use by another run (pid {os.getpid()}" in capsys.readouterr().out  # Hydra's log
