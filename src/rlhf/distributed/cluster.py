"""The Ray backend: connect (or start a private cluster), check the placement fits, reserve placement groups,
start one worker per rank of every role, and tear it all down at the end.

Roles in one `cluster.colocate` group share a placement group: bundle i hosts rank i of each of them, each
reserving an equal fraction of the bundle (e.g. 0.5 GPU for policy+reference), so they run on the same device.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import sys
import threading
from dataclasses import dataclass, field
from typing import Callable

from rlhf.errors import ConfigError
from rlhf.distributed.layout import PlacementSpec, bundle_resources, check_fits, placement_specs, used_roles
from rlhf.distributed.remote import HEARTBEAT_GROUP, ActorGroup, RemoteGenerator, RemoteReplicas, RemoteTrainer
from rlhf.distributed.workers import RoleWorker

log = logging.getLogger(__name__)


def import_ray():
    try:
        import ray
    except ImportError:  # pragma: no cover - the dev and distributed extras install it
        raise ConfigError("cluster.backend=ray needs Ray: pip install 'rlhf[distributed]' (or cluster=local)") from None
    return ray


def connect(cluster) -> bool:
    """Join `cluster.address`, or start a private local cluster when it is null. True when this call started Ray."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    if cluster.address is None:
        with own_process_group(ray):
            ray.init(
                num_cpus=cluster.num_cpus, object_store_memory=cluster.object_store_memory, include_dashboard=False,
                log_to_driver=True, configure_logging=False,
            )
    else:
        try:
            ray.init(address=cluster.address, log_to_driver=True, configure_logging=False)
        except ConnectionError as err:  # `auto` and no cluster found here
            raise ConfigError(
                f"cluster.address={cluster.address}: {err} Start a cluster with `ray start --head` (then `ray start "
                f"--address=<head>:6379` on the other nodes), or use cluster=ray_local for a private one on this machine"
            ) from None
    return True


CLUSTER_LOST = threading.Event()  # set by `RayRun.shutdown` when the private cluster had ended: see `end_if_cluster_lost`


def end_if_cluster_lost(code: int | str | None) -> None:
    """End the process at once with ``code`` (a `SystemExit` code: None is 0, text is 1, as Python exits) when
    `RayRun.shutdown` found its private cluster gone: the Ray client left in this process, torn down at exit with no
    cluster to answer it, crashes it (SIGSEGV) in place of the run's exit code. The log and the console are flushed
    first."""
    if not CLUSTER_LOST.is_set():
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a console already gone
            pass
    os._exit(0 if code is None else code if isinstance(code, int) else 1)


RELEASE_TIMEOUT_S = 15.0  # a live private cluster releases a run's actors and placement groups in under a second


def finishes(fn: Callable[[], None], timeout_s: float) -> bool:
    """Whether ``fn()`` returns within ``timeout_s``, run in a daemon thread that is left behind if it does not. An
    exception it raises is logged and counts as not finishing: this runs while the run ends, in a `finally` whose
    exception would hide the one that ended it."""
    done = threading.Event()

    def call() -> None:
        try:
            fn()
        except Exception:
            log.warning("releasing the Ray cluster failed", exc_info=True)
        else:
            done.set()

    threading.Thread(target=call, daemon=True, name="rlhf-ray-release").start()
    return done.wait(timeout_s)


def gcs_answers(ray, timeout_s: float = 5.0) -> bool:
    """Whether the connected cluster's GCS (its head process) still accepts connections."""
    host, _, port = ray.get_runtime_context().gcs_address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def own_process_group(ray):
    """Within the block, the processes `ray.init` starts for a private cluster (its GCS and raylet, and through them
    every worker) lead a process group of their own, as Ray starts them on Windows. A SIGTERM sent to the driver's
    group (`timeout`, `kill -TERM -<pgid>`) then reaches the driver alone, which finishes its step, saves, and shuts
    the cluster down (exit 5); before, the GCS died with the driver's group, and the driver hung 60 s in shutdown and
    exited 1. Ray still ties each of them to the driver's life (`PR_SET_PDEATHSIG`: killed when the driver dies, by
    -9 too), and only where it does is the group changed: that is the hook wrapped, run in each child before it
    starts. Where the hook is missing (another Ray), the processes stay in the driver's group."""
    utils = getattr(getattr(ray, "_private", None), "utils", None)
    tie = getattr(utils, "set_kill_on_parent_death_linux", None)
    if tie is None:
        yield
        return

    def tie_and_detach() -> None:
        tie()
        os.setpgid(0, 0)

    utils.set_kill_on_parent_death_linux = tie_and_detach
    try:
        yield
    finally:
        utils.set_kill_on_parent_death_linux = tie


@dataclass
class RayRun:
    """What the Ray backend started for one run; `shutdown` releases all of it."""

    started_ray: bool
    groups: dict[str, ActorGroup] = field(default_factory=dict)
    placement_groups: list = field(default_factory=list)

    def release(self) -> None:
        """Kill the run's actors and remove its placement groups."""
        ray = import_ray()
        for group in self.groups.values():
            for actor in group.actors:
                ray.kill(actor, no_restart=True)
        for pg in self.placement_groups:
            ray.util.remove_placement_group(pg)
        self.groups.clear()
        self.placement_groups.clear()

    def shutdown(self) -> None:
        ray = import_ray()
        private = self.started_ray and ray.is_initialized()
        if private and not (gcs_answers(ray) and finishes(self.release, RELEASE_TIMEOUT_S)):
            # the GCS is gone, or going, or frozen (a release it does not answer): Ray's shutdown, here or at exit,
            # would wait 60 s for it and then end the process with exit 1 in place of the run's own code
            log.warning(
                "the private Ray cluster does not answer: its processes were killed, frozen, or stopped by a signal "
                "sent to every process of the job (as SLURM sends at preemption); this process exits without waiting "
                "for them. A step they were running is lost: the newest checkpoint is the last one logged as saved. "
                "For a checkpoint at a stop, signal this process alone (SLURM, before the time limit: "
                "--signal=B:TERM@<seconds> and a trap in the batch script that forwards it here)"
            )
            atexit.unregister(ray.shutdown)
            CLUSTER_LOST.set()
            return
        if not private:
            self.release()
            return
        try:
            ray.shutdown()
        except BrokenPipeError:
            # the console is gone (a `| tee` ended by the same Ctrl-C): Ray's last worker lines cannot be printed, and
            # the shutdown stopped before its own processes; the run's log file holds the rest
            sys.stdout = sys.stderr = open(os.devnull, "w")  # left open: the process is ending
            ray.shutdown()


def reserve(specs: list[PlacementSpec], cluster) -> list:
    """Check the specs fit the cluster (ConfigError with the arithmetic otherwise), then create and await the
    placement groups, failing after `cluster.placement_timeout_s` instead of waiting forever."""
    ray = import_ray()
    from ray.util.placement_group import placement_group

    nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    check_fits(specs, cluster, ray.cluster_resources(), nodes)
    bundle = bundle_resources(cluster)
    groups = [placement_group([dict(bundle) for _ in range(spec.ranks)], strategy="PACK") for spec in specs]
    ready, _ = ray.wait([pg.ready() for pg in groups], num_returns=len(groups), timeout=cluster.placement_timeout_s)
    if len(ready) < len(groups):
        for pg in groups:
            ray.util.remove_placement_group(pg)
        raise ConfigError(
            f"Ray could not place {', '.join(s.describe() for s in specs)} within {cluster.placement_timeout_s:g} s "
            f"(cluster.placement_timeout_s); the cluster's free resources: {ray.available_resources()}"
        )
    return groups


def spawn(role: str, placement: PlacementSpec, pg, spec, build) -> tuple[ActorGroup, dict]:
    """One `RoleWorker` per rank of ``role`` in ``pg`` (bundle i = rank i), set up; returns the group and its pending
    set-up calls ({rank: ObjectRef})."""
    group = create(role, placement, pg, spec, build)
    return group, set_up(group, spec.cluster)


def create(role: str, placement: PlacementSpec, pg, spec, build) -> ActorGroup:
    """Start one `RoleWorker` process per rank of ``role`` in ``pg`` (bundle i = rank i), without waiting for them:
    every role's processes start (import, connect) at the same time. Each receives the run's ``spec`` (a `RunSpec`,
    pickled) and ``build``."""
    ray = import_ray()
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    cluster = spec.cluster
    share = 1.0 / len(placement.roles)
    bundle = bundle_resources(cluster)
    worker = ray.remote(concurrency_groups={HEARTBEAT_GROUP: 1})(RoleWorker)  # heartbeats: a thread of their own
    actors = [
        worker.options(
            num_cpus=bundle["CPU"] * share, num_gpus=bundle.get("GPU", 0.0) * share,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
        ).remote(role, rank, placement.ranks, spec, build)
        for rank in range(placement.ranks)
    ]
    return ActorGroup(role, actors, cluster.timeout_s, cluster.heartbeat_timeout_s)


def set_up(group: ActorGroup, cluster) -> dict:
    """Wait for rank 0 of ``group`` to start (its address is the group's rendezvous), then ask every rank to join the
    process group and load its model; returns the pending set-up calls ({rank: ObjectRef})."""
    first = group.wait({0: group.actors[0].ping.remote()}, "start-up", cluster.setup_timeout_s)[0]
    return {rank: actor.setup.remote(first["ip"], first["port"]) for rank, actor in enumerate(group.actors)}


def start(spec, algorithm, pad_id: int, build):
    """Place and start every role the run ``spec`` (its `RunSpec`) uses, each rank's component made by ``build(role,
    spec, device)``. Returns (RayRun, {role: driver-side handle})."""
    cluster = spec.cluster
    roles = used_roles(spec, algorithm)
    placements = placement_specs(cluster, roles)
    run = RayRun(started_ray=connect(cluster))
    try:
        run.placement_groups = reserve(placements, cluster)
        for placement, pg in zip(placements, run.placement_groups):
            log.info("placement group %s", placement.describe())
            for role in placement.roles:
                run.groups[role] = create(role, placement, pg, spec, build)
        pending = {role: set_up(group, cluster) for role, group in run.groups.items()}
        for role, refs in pending.items():
            run.groups[role].wait(refs, "setup (process group and model load)", cluster.setup_timeout_s)
    except BaseException:
        run.shutdown()
        raise
    handles = {
        "policy": RemoteTrainer(run.groups["policy"]),
        "generator": RemoteGenerator(run.groups["generator"], pad_id),
        "reference": RemoteReplicas(run.groups["reference"]) if "reference" in run.groups else None,
        "critic": RemoteTrainer(run.groups["critic"]) if "critic" in run.groups else None,
        "reward": RemoteReplicas(run.groups["reward"]) if "reward" in run.groups else None,
        "teacher": RemoteReplicas(run.groups["teacher"]) if "teacher" in run.groups else None,
    }
    return run, handles
