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

from rlhf.config import compose_config
from rlhf.distributed import cluster as cluster_module
from rlhf.distributed.layout import check_launcher
from rlhf.errors import ConfigError


@pytest.mark.slow
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


@pytest.mark.parametrize(("environ", "has_gpu", "advice"), [
    ({"WORLD_SIZE": "8", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "8"}, True,
     "python -m rlhf.train cluster=ray_local cluster.device_type=gpu policy/strategy=ddp (or fsdp2, deepspeed) "
     "cluster.roles.policy.devices_per_node=8"),
    ({"WORLD_SIZE": "16", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8"}, True,
     "cluster=ray (after `ray start` on each of the 2 nodes) cluster.roles.policy.num_nodes=2 policy/strategy=ddp"),
])
def test_the_launcher_refusal_places_the_ranks_as_the_launcher_did(environ, has_gpu, advice):
    """Eight GPU ranks are advised on GPUs (ray_local's slots are CPUs), and two nodes of eight as two nodes, not
    sixteen devices on one."""
    with pytest.raises(ConfigError, match="started by a launcher such as torchrun") as err:
        check_launcher(environ, lambda: has_gpu)
    assert advice in str(err.value) and "unset WORLD_SIZE and LOCAL_RANK" in str(err.value)


@pytest.mark.parametrize("environ", [{}, {"WORLD_SIZE": "1", "LOCAL_RANK": "0"}, {"WORLD_SIZE": "4", "RANK": "2"}])
def test_one_process_or_a_scheduler_without_a_launcher_is_not_refused(environ):
    """A launcher of one process changes nothing; a scheduler that sets WORLD_SIZE in each container (no LOCAL_RANK:
    no launcher started the process) is not a torchrun launch."""
    check_launcher(environ)


@pytest.mark.slow
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


def test_cluster_ray_with_no_cluster_running_is_a_config_error_naming_the_fix(monkeypatch):
    """cluster=ray (address auto) where no Ray cluster runs: Ray's ConnectionError becomes a config error naming
    cluster.address, `ray start --head` and cluster=ray_local (before: exit 6, 'the run raised ConnectionError', as if a
    bug). Ray's own search (`auto` joins any cluster it finds on this machine, another test's too) is replaced by its
    answer when it finds none."""
    ray = cluster_module.import_ray()
    monkeypatch.setattr(ray, "is_initialized", lambda: False)

    def no_cluster(**kwargs):
        raise ConnectionError("Could not find any running Ray instance. Please specify the one to connect to.")

    monkeypatch.setattr(ray, "init", no_cluster)
    with pytest.raises(ConfigError, match=r"^cluster.address=auto: Could not find any running Ray instance.*") as err:
        cluster_module.connect(compose_config(["cluster=ray"]).cluster)  # address: auto
    assert "`ray start --head`" in str(err.value) and "cluster=ray_local" in str(err.value)
