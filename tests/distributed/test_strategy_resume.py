"""A resume whose training strategy cannot read the checkpoint is refused before any model loads (exit 2), naming the
key: DeepSpeed's sharded state only by DeepSpeed, at the world size and ZeRO-3-or-not it was saved under; full weights
and optimiser state (single, ddp, fsdp2) not by DeepSpeed. Before, the run placed its workers and loaded the models,
then a worker failed with DeepSpeed's error (exit 4)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml
from conftest import compose

from rlhf.config.spec import resolve
from rlhf.errors import ConfigError
from rlhf.run.preflight import check_strategy_resume

pytestmark = pytest.mark.slow

# algorithm.beta=0: no reference, so each saving run starts the policy's two ranks and the engine only (the checks
# read the policy's saved state; a reference's two more workers would only lengthen the start)
TINY = ["algorithm.beta=0", "eval.every=0", "eval.num_samples=1", "eval.greedy=false", "logging.tensorboard=false",
        "checkpoint.save_final_model=false", "cluster.object_store_memory=200000000"]
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}
ONE_RANK = ["cluster.roles.policy.devices_per_node=1", "cluster.roles.reference.devices_per_node=1"]


def recorded(checkpoint) -> dict:
    """The checkpoint's config.yaml, as `check_resume` reads it for the strategy check."""
    return yaml.safe_load((checkpoint / "config.yaml").read_text(encoding="utf-8"))


def train(run_dir, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlhf.train", "cluster=ray_local", *TINY, *overrides, f"hydra.run.dir={run_dir}"],
        cwd=run_dir.parent, env=ENV, capture_output=True, text=True, timeout=900,
    )


@pytest.fixture(scope="module")
def deepspeed_run(tmp_path_factory):
    """A run folder holding one checkpoint of ZeRO-2 on 2 policy ranks."""
    run_dir = tmp_path_factory.mktemp("deepspeed") / "run"
    proc = train(run_dir, "policy/strategy=deepspeed", "train.num_steps=1", "checkpoint.every=1")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert (run_dir / "checkpoints" / "step_00000001" / "policy" / "deepspeed").is_dir()
    return run_dir


@pytest.mark.parametrize("overrides, message", [
    (["policy/strategy=deepspeed", *ONE_RANK],
     r"DeepSpeed's sharded state of 2 ranks, this run places 1 \(cluster.roles.policy: num_nodes x devices_per_node\)"),
    (["policy/strategy=ddp"], r"policy is DeepSpeed's own sharded state .* which policy/strategy=ddp cannot read"),
    (["policy/strategy=deepspeed", "policy.strategy.zero_stage=3"],
     r"saved under ZeRO stage 1 or 2 and this run has policy.strategy.zero_stage=3.*set policy.strategy.zero_stage=2"),
], ids=["fewer-ranks", "ddp", "zero-3"])
def test_a_deepspeed_checkpoint_resumed_by_what_cannot_read_it_is_refused_before_ray_starts(deepspeed_run, overrides, message):
    proc = train(deepspeed_run, "train.num_steps=2", "resume=auto", *overrides)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 2, log[-3000:]
    assert re.search(message, log), log[-3000:]
    assert "placed on Ray" not in log  # refused before any worker started or model loaded


def test_the_strategy_it_was_saved_under_passes_the_check(deepspeed_run):
    checkpoint = deepspeed_run / "checkpoints" / "step_00000001"
    check_strategy_resume(resolve(compose("policy/strategy=deepspeed", "policy.strategy.zero_stage=1")), checkpoint, recorded(checkpoint))  # 1 and 2 share a format
    with pytest.raises(ConfigError, match="policy/strategy=fsdp2 cannot read"):
        check_strategy_resume(resolve(compose("policy/strategy=fsdp2")), checkpoint, recorded(checkpoint))


def test_a_ddp_checkpoint_resumed_under_deepspeed_is_refused_naming_the_strategy_it_was_saved_under(tmp_path):
    run_dir = tmp_path / "run"
    proc = train(run_dir, "policy/strategy=ddp", "train.num_steps=1", "checkpoint.every=1")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    proc = train(run_dir, "policy/strategy=deepspeed", "train.num_steps=2", "resume=auto")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 2, log[-3000:]
    assert "holds full weights and optimiser state (saved under policy/strategy=ddp), which policy/strategy=deepspeed cannot load" in log
    assert "placed on Ray" not in log
    check_strategy_resume(resolve(compose("policy/strategy=fsdp2", *ONE_RANK)), run_dir / "checkpoints" / "step_00000001", {})  # any world size


def test_a_saved_critic_the_run_has_none_for_is_not_checked(deepspeed_run, tmp_path):
    """A checkpoint with a critic (here the policy's DeepSpeed state copied as one) resumed by an algorithm without a
    critic: the critic is never loaded, so whatever strategy saved it cannot stop the resume; with a critic it is
    checked as the policy is."""
    checkpoint = tmp_path / "step_00000001"
    shutil.copytree(deepspeed_run / "checkpoints" / "step_00000001", checkpoint)
    shutil.copytree(checkpoint / "policy", checkpoint / "critic")
    check_strategy_resume(resolve(compose("policy/strategy=deepspeed")), checkpoint, recorded(checkpoint))  # grpo: no critic
    with pytest.raises(ConfigError, match="critic is DeepSpeed's own sharded state .* critic/strategy=auto cannot read"):
        check_strategy_resume(resolve(compose("algorithm=ppo", "policy/strategy=deepspeed")), checkpoint, recorded(checkpoint))
