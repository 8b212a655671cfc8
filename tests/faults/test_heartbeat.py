"""A frozen Ray worker (SIGSTOP: alive, but silent) fails the run within `cluster.heartbeat_timeout_s`, long before the
`cluster.timeout_s` that slow calls may take; a worker that is merely busy keeps answering its pings."""

from __future__ import annotations

import os
import signal
import time

import pytest

from rlhf.config.compose import compose_config
from rlhf.config.spec import resolve
from rlhf.distributed.cluster import RayRun, reserve, spawn
from rlhf.distributed.layout import PlacementSpec
from rlhf.distributed.remote import HEARTBEAT_GROUP, ActorGroup, WorkerError
from rlhf.distributed.workers import RoleWorker
from rlhf.run.build import build_model

pytestmark = pytest.mark.slow

HEARTBEAT_S = 3.0
CALL_TIMEOUT_S = 600.0  # what a slow model load or a long generation may need; the heartbeat must not wait for it


@pytest.fixture(scope="module")
def ray_session():
    """The Ray cluster of tests/distributed/conftest.py's session fixture when it is up, else one like it."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(
            num_cpus=8, object_store_memory=200_000_000, include_dashboard=False, configure_logging=False,
            log_to_driver=False,
        )
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture
def cfg():
    return compose_config([
        "cluster=ray_local", "train.prompts_per_step=8", "algorithm.num_samples_per_prompt=4", "train.micro_batch_size=8",
        f"cluster.heartbeat_timeout_s={HEARTBEAT_S}", f"cluster.timeout_s={CALL_TIMEOUT_S}",
    ])


@pytest.fixture
def run(ray_session):
    """Holds what a test starts; kills it afterwards."""
    started = RayRun(started_ray=False)
    yield started
    started.shutdown()


def test_a_frozen_worker_fails_the_call_naming_role_rank_and_heartbeat(cfg, run, ray_session):
    placement = PlacementSpec(("policy",), 1, 2)
    run.placement_groups = reserve([placement], cfg.cluster)
    group, pending = spawn("policy", placement, run.placement_groups[0], resolve(cfg), build_model)
    run.groups["policy"] = group
    group.wait(pending, "setup", cfg.cluster.setup_timeout_s)
    pid = ray_session.get(group.actors[1].ping.remote())["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        began = time.monotonic()
        with pytest.raises(WorkerError, match=r"policy rank 1: no heartbeat for 3 s during lr \(cluster.heartbeat_timeout_s\)"):
            group.call("lr", {0: (), 1: ()})
        waited = time.monotonic() - began
    finally:
        os.kill(pid, signal.SIGKILL)  # a stopped process cannot exit on its own
    assert HEARTBEAT_S <= waited < CALL_TIMEOUT_S / 4, waited


def spinning_worker() -> type:
    """A `RoleWorker` with a call that keeps its CPU busy in Python (holding the GIL but for the interpreter's
    switches). Defined in a function so Ray ships the class by value (workers cannot import this test module)."""

    class SpinningWorker(RoleWorker):
        def spin(self, seconds: float) -> int:
            end, count = time.monotonic() + seconds, 0
            while time.monotonic() < end:
                count += 1
            return count

    return SpinningWorker


def test_a_busy_worker_answers_its_pings_through_a_long_call(cfg, run, ray_session):
    worker = ray_session.remote(concurrency_groups={HEARTBEAT_GROUP: 1})(spinning_worker())  # as `spawn`
    actor = worker.options(num_cpus=1).remote("policy", 0, 1, resolve(cfg), build_model)
    group = ActorGroup("policy", [actor], CALL_TIMEOUT_S, HEARTBEAT_S)
    run.groups["policy"] = group
    group.wait({0: actor.ping.remote()}, "start-up", CALL_TIMEOUT_S)
    result = group.wait({0: actor.spin.remote(3 * HEARTBEAT_S)}, "spin")
    assert result[0] > 0
