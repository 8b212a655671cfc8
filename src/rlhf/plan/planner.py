"""The plan: every role's memory summed per device as the run would place it, against the device's capacity.

Placement follows the config: the local backend puts every role on one device; the Ray backend places each
group of `cluster.colocate` (and each other role) on devices of its own, one rank of every member per device.
Capacity is `cluster.device_memory_gb` when set, else detected: the CUDA card's memory, or the machine's RAM
for CPU runs. A device fits when its peak phase stays within capacity less `plan.headroom`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from rlhf.generators.memory import ENGINE_SHARE
from rlhf.config.spec import RunSpec, resolve
from rlhf.config.validate import check_plan_keys
from rlhf.distributed.layout import placement_specs, role_ranks, used_roles
from rlhf.errors import ConfigError
from rlhf.models.loading import pick_device
from rlhf.plan import memory, roles
from rlhf.plan.memory import PHASES, Item

GIB = 2**30


@dataclass
class DeviceGroup:
    """Devices holding the same roles, and what one of them holds."""

    roles: tuple[str, ...]  # the roles on each of these devices
    count: int  # how many such devices
    items: list[Item] = field(default_factory=list)  # one device's share

    @property
    def peak(self) -> tuple[int, str]:
        return memory.peak(self.items)


@dataclass
class Capacity:
    """One device's memory and where the figure came from."""

    bytes: int | None  # None: unknown (no GPU here and no cluster.device_memory_gb)
    source: str  # e.g. "cluster.device_memory_gb=80", "detected: NVIDIA H100 80GB HBM3", "detected: this machine's RAM"
    shared: bool = False  # CPU devices: every device's processes share this one machine's RAM


@dataclass
class Plan:
    """The plan of one config: device groups, capacity and the verdict."""

    groups: list[DeviceGroup]
    capacity: Capacity
    headroom: float  # share of capacity kept free (plan.headroom)
    kind: str  # cuda or cpu
    workload: roles.Workload  # the sizes it was made for
    spec: RunSpec  # the run it was made for

    @property
    def usable(self) -> int | None:
        return None if self.capacity.bytes is None else int(self.capacity.bytes * (1 - self.headroom))

    def needed(self, group: DeviceGroup) -> int:
        """Bytes one device of ``group`` needs at its peak (CPU: every group's processes together)."""
        if self.capacity.shared:
            return sum(g.peak[0] * g.count for g in self.groups)
        return group.peak[0]

    @property
    def worst(self) -> DeviceGroup:
        return max(self.groups, key=self.needed)

    @property
    def fits(self) -> bool | None:
        """True/False, or None when the capacity is unknown."""
        if self.usable is None:
            return None
        return all(self.needed(g) <= self.usable for g in self.groups)


def make_plan(cfg) -> Plan:
    """The memory plan of a composed `rlhf.train` config: `plan_of` its spec, resolved without `validate`'s other
    checks (`rlhf.config.spec.resolve`). Reads config.json files only; loads no weights."""
    check_plan_keys(cfg)
    return plan_of(resolve(cfg))


def plan_of(spec: RunSpec) -> Plan:
    """The memory plan of the run ``spec`` (validated: `plan.*` and the cluster's sizes in range). Reads config.json
    files only; loads no weights. The `cluster` node is read as written: placement indexes it by role."""
    cluster = spec.config.cluster
    used = used_roles(spec, spec.algorithm)
    ray = cluster.backend == "ray"
    ranks = {role: role_ranks(cluster, role) if ray else 1 for role in used}
    kind = device_kind(cluster)
    capacity = detect_capacity(cluster, kind)
    work = roles.workload(spec, ranks, kind)
    items = role_memory(spec, used, ranks, work, capacity.bytes)
    if ray:
        check_device_count(cluster, used)
        groups = [DeviceGroup(placed.roles, placed.ranks) for placed in placement_specs(cluster, used)]
    else:
        groups = [DeviceGroup(tuple(used), 1)]
    if spec.schedule.trait("overlaps_generation", False):  # the generator is busy in every phase
        items["generator"] = [Item(i.role, i.what, i.bytes, PHASES, i.on_host) for i in items["generator"]]
    for group in groups:
        # each Ray role is a process with its own runtime; an engine's share of the GPU (vLLM's) already covers its own
        processes = len(group.roles) if ray else 1
        if kind == "cuda" and any(i.what == ENGINE_SHARE for i in items["generator"]) and "generator" in group.roles:
            processes -= 1 if ray else 0
        group.items = [i for role in group.roles for i in items[role]] + runtime_items(kind, processes)
    return Plan(groups, capacity, spec.plan.headroom, kind, work, spec)


def role_memory(spec: RunSpec, used: list[str], ranks: dict[str, int], work: roles.Workload, capacity: int | None) -> dict:
    """{role: [Item, ...]} for one device of each used role."""
    found = roles.sources(spec)
    policy, critic = spec.policy, spec.critic
    items = {
        "policy": roles.trained_items("policy", found["policy"], "lm", policy.strategy,
                                     policy.gradient_checkpointing, ranks["policy"], work, policy.lora,
                                     compiled=policy.compile, budget=policy.activation_memory_budget),
        "generator": roles.generator_items(spec.generator, found["generator"], work, capacity),
    }
    if "reference" in used:
        items["reference"] = roles.frozen_items("reference", found["reference"], "lm", work)
    if "critic" in used:
        items["critic"] = roles.trained_items("critic", found["critic"], "value", critic.strategy,
                                              critic.gradient_checkpointing, ranks["critic"], work, critic.lora)
    if "reward" in used:
        items["reward"] = roles.frozen_items("reward", found["reward"], "value", work)
    if "teacher" in used:
        items["teacher"] = roles.frozen_items("teacher", found["teacher"], "lm", work)
    return items


def runtime_items(kind: str, processes: int) -> list[Item]:
    """What a device holds besides the models: CUDA contexts (GPU), or the process's own libraries (CPU: its
    resident memory now, before any model loads, stands for each process)."""
    if processes == 0:
        return []
    if kind == "cuda":
        return [Item("runtime", "CUDA context", processes * memory.CUDA_CONTEXT_BYTES)]
    return [Item("runtime", "process (python, torch, libraries)", processes * resident_bytes())]


def resident_bytes() -> int:
    """This process's resident memory (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def device_kind(cluster) -> str:
    """cuda or cpu: what the trained roles run on (``cluster``: the `cluster` node)."""
    if cluster.backend == "ray":
        return "cuda" if cluster.device_type == "gpu" else "cpu"
    if cluster.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(cluster.device).type  # a cuda run can be planned on a machine without one


def detect_capacity(cluster, kind: str) -> Capacity:
    """`cluster.device_memory_gb`, else this machine's: its CUDA card, or its RAM (CPU runs share it)."""
    shared = kind == "cpu"
    if cluster.device_memory_gb is not None:
        return Capacity(int(cluster.device_memory_gb * GIB), f"cluster.device_memory_gb={cluster.device_memory_gb:g}", shared)
    if kind == "cuda":
        if not torch.cuda.is_available():
            return Capacity(None, "unknown: no GPU on this machine; set cluster.device_memory_gb")
        index = (pick_device(cluster.device).index or 0) if cluster.backend == "local" else 0
        props = torch.cuda.get_device_properties(index)
        return Capacity(props.total_memory, f"detected: {props.name}")
    return Capacity(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "detected: this machine's RAM", shared)


def check_device_count(cluster, used: list[str]) -> None:
    """The placement fits the machines the cluster preset declares (`cluster.num_nodes` x `devices_per_node`)."""
    if cluster.num_nodes is None or cluster.devices_per_node is None:
        return
    specs = placement_specs(cluster, used)
    needed = sum(spec.ranks for spec in specs)
    have = cluster.num_nodes * cluster.devices_per_node
    listing = "; ".join(spec.describe() for spec in specs)
    if needed > have:
        raise ConfigError(
            f"the roles need {needed} devices ({listing}) but cluster.num_nodes={cluster.num_nodes} x "
            f"cluster.devices_per_node={cluster.devices_per_node} gives {have}; lower cluster.roles.<role>.devices_per_node "
            f"or num_nodes, colocate roles (cluster.colocate), or use a larger cluster preset"
        )
    for spec in specs:
        if spec.devices_per_node > cluster.devices_per_node or spec.num_nodes > cluster.num_nodes:
            raise ConfigError(
                f"{spec.describe()} does not fit nodes of cluster.devices_per_node={cluster.devices_per_node} "
                f"(cluster.num_nodes={cluster.num_nodes}); change cluster.roles.{spec.roles[0]}"
            )
