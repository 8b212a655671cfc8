"""`python -m rlhf.train` starts its own training ranks (Ray actors): a launch by torchrun, where every process would
train the whole run alone in one run folder, is refused in each process before Hydra composes, naming the fix."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_torchrun_with_two_processes_is_refused_in_each_before_anything_runs(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "0", "-m", "rlhf.train",
         "policy/strategy=ddp", "train.num_steps=1", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-3000:]
    assert "exitcode  : 2" in log, log[-3000:]  # torchrun's report of the first failed rank: this project's config error
    assert "of 2 started by a launcher such as torchrun (WORLD_SIZE=2)" in log  # each rank says it; torchrun may stop one first
    assert "python -m rlhf.train cluster=ray_local policy/strategy=ddp (or fsdp2, deepspeed) cluster.roles.policy.devices_per_node=2" in log
    assert not run_dir.exists()  # refused before Hydra made the run folder: no model loaded, nothing trained


def test_a_launcher_of_one_process_changes_nothing(tmp_path):
    """`torchrun --nproc_per_node 1` (WORLD_SIZE=1) runs the one process it would run alone."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "1", "RANK": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf.train", "train.num_steps=1", "eval.every=0", "eval.num_samples=1", "eval.greedy=false",
         "logging.tensorboard=false", "checkpoint.save_final_model=false", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
