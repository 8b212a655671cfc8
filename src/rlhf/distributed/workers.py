"""What runs inside each Ray actor: one rank of one role (policy, critic, reference, reward or generator).

A worker builds the same component the local backend would (through the registry), on its own device, and
answers `run(method, ...)` calls from the driver. Training roles first join a torch.distributed group of their
own (gloo on CPU, NCCL on GPU), so their strategy can shard and all-reduce.
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta

import torch

from rlhf.seeding import seed_everything


def free_port() -> int:
    """A TCP port free on this node right now (for the process group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


TRAINED_ROLES = ("policy", "critic")


class RoleWorker:
    """One rank of one role. The driver wraps this class with `ray.remote` and calls it through `ActorGroup`."""

    def __init__(self, role: str, rank: int, world_size: int, spec, build) -> None:
        logging.basicConfig(level=logging.INFO, format=f"[{role} {rank}] %(levelname)s %(name)s: %(message)s")
        self.role, self.rank, self.world_size = role, rank, world_size
        self.spec = spec  # the run's `RunSpec` (rlhf.config.spec), shipped pickled: its typed sections and sizes
        self.build = build  # build(role, spec, device): the component of a role (`rlhf.run.build.build_model`)
        self.obj = None

    def ping(self) -> dict:
        """Where this rank runs: pid, node address, a free port (rank 0's become the rendezvous), its placement
        group and the resources Ray assigned it."""
        import ray

        context = ray.get_runtime_context()
        return {
            "pid": os.getpid(), "ip": ray.util.get_node_ip_address(), "port": free_port(),
            "placement_group": context.get_placement_group_id(), "resources": context.get_assigned_resources(),
        }

    def heartbeat(self) -> int:
        """Answer the driver's ping (it runs in the `heartbeat` concurrency group, a thread of its own, so a long call
        does not hold it up; a frozen process does). Returns the pid."""
        return os.getpid()

    def setup(self, master_addr: str, master_port: int) -> None:
        """Join the role's process group (training roles) and build the component."""
        spec = self.spec
        gpu = spec.cluster.device_type == "gpu"
        device = torch.device("cuda", 0) if gpu else torch.device("cpu")  # Ray sets CUDA_VISIBLE_DEVICES per actor
        if gpu:
            torch.cuda.set_device(device)
        if self.role in TRAINED_ROLES:
            os.environ.update(
                MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(self.rank),
                WORLD_SIZE=str(self.world_size), LOCAL_RANK="0",
            )
            # the rendezvous and the collectives of a model build belong to setup; a collective that hangs later is
            # caught by the driver after cluster.timeout_s, which then kills every worker
            torch.distributed.init_process_group(
                "nccl" if gpu else "gloo", rank=self.rank, world_size=self.world_size,
                timeout=timedelta(seconds=max(spec.cluster.timeout_s, spec.cluster.setup_timeout_s)),
            )
        # training ranks build identical weights (a new critic head included); generation engines sample apart
        seed_everything(spec.seed + (self.rank if self.role == "generator" else 0))
        self.obj = self.build(self.role, spec, device)
        strategy = getattr(self.obj, "strategy", None)
        if strategy is not None:
            logging.getLogger("rlhf").info("%s rank %d/%d: strategy %s on %s", self.role, self.rank, self.world_size, strategy.name, device)

    def run(self, method, *args, **kwargs):
        """``component.method(*args, **kwargs)``, or the attribute's value when it is not callable; ``method`` may also
        be a function of the driver's (the Learner's `accumulate`), run as ``method(component, *args, **kwargs)``."""
        if callable(method):
            return method(self.obj, *args, **kwargs)
        attr = getattr(self.obj, method)
        return attr(*args, **kwargs) if callable(attr) else attr

    def run_and_put(self, method: str, *args, **kwargs):
        """`run`, with a non-None result placed in the Ray object store; returns [ref] or [None].

        Wrapped in a list so the driver receives the reference itself and can hand it on (to the generators)
        without fetching the object.
        """
        import ray

        result = self.run(method, *args, **kwargs)
        return [ray.put(result) if result is not None else None]

    def shutdown(self) -> None:
        """Leave the process group (best effort; the driver kills the actor afterwards)."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
