"""One private Ray cluster for the whole distributed test session, and helpers to start role groups on it."""

from __future__ import annotations

import os

import pytest
import torch

from rlhf.config.compose import compose_config
from rlhf.config.spec import resolve
from rlhf.distributed.cluster import RayRun, reserve, spawn
from rlhf.distributed.layout import PlacementSpec
from rlhf.distributed.remote import RemoteTrainer
from rlhf.run.build import build_model


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster with 8 logical CPUs and a small object store, shut down after the session."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    ray.init(num_cpus=8, object_store_memory=200_000_000, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def compose(*overrides: str):
    """The CLI's composed config on ray_local with small batches (32 samples: 8 prompts x 4)."""
    return compose_config(
        ["cluster=ray_local", "train.prompts_per_step=8", "algorithm.num_samples_per_prompt=4", "train.micro_batch_size=8", *overrides]
    )


class Started:
    """Role groups started on the session cluster for one test; `run.shutdown` kills them and frees their placement."""

    def __init__(self) -> None:
        self.run = RayRun(started_ray=False)

    def group(self, cfg, role: str, ranks: int):
        placement, spec = PlacementSpec((role,), 1, ranks), resolve(cfg)  # the workers receive the resolved run
        (pg,) = reserve([placement], spec.cluster)
        self.run.placement_groups.append(pg)
        group, pending = spawn(role, placement, pg, spec, build_model)
        self.run.groups[f"{role}-{len(self.run.groups)}"] = group
        group.wait(pending, "setup", spec.cluster.setup_timeout_s)  # as `start` does: the model-load budget
        return group

    def trainer(self, cfg, ranks: int, role: str = "policy") -> RemoteTrainer:
        return RemoteTrainer(self.group(cfg, role, ranks))


@pytest.fixture
def started(ray_cluster):
    """Start role groups inside a test (`started.group(cfg, role, ranks)`); all are killed afterwards."""
    s = Started()
    yield s
    s.run.shutdown()


def max_weight_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between two state dicts with the same keys (asserted equal)."""
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)
