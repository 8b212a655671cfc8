"""How a run is started and finds its cluster: `python -m rlhf.train` starts its own training ranks (Ray actors), so a
launch by torchrun, where every process would train the whole run alone in one run folder, is refused in each process
before Hydra composes; a `cluster.address` where nothing answers, or `auto` with no cluster running, is refused before
any model loads."""

from __future__ import annotations

import os
import socket
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


def test_a_ray_address_where_nothing_answers_is_refused_before_any_model_loads(tmp_path):
    """cluster.address names a head that is not there (a closed port): exit 2 naming the key and the fix, before the
    models load; before, Ray retried its connection for minutes without a word."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed once the block ends: nothing listens there
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf.train", "cluster=ray", f"cluster.address=127.0.0.1:{port}", "train.num_steps=1",
         f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 2, log[-3000:]
    assert f"cluster.address=127.0.0.1:{port}: nothing answers there" in log and "ray start --head" in log
    assert "policy trains" not in log  # no model was built


def test_cluster_ray_with_no_cluster_running_is_a_config_error_naming_the_fix(tmp_path):
    """cluster=ray (address auto) where no Ray cluster runs: exit 2 naming cluster.address, `ray start --head` and
    cluster=ray_local; before, exit 6 ('the run raised ConnectionError'), as if a bug. Ray looks for a running cluster
    under its temporary folder, here an empty one of this test's own."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env |= {"OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": str(tmp_path / "ray")}
    (tmp_path / "ray").mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf.train", "cluster=ray", "train.num_steps=1", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 2, log[-3000:]
    assert "config error: cluster.address=auto: Could not find any running Ray instance" in log
    assert "`ray start --head`" in log and "cluster=ray_local" in log
