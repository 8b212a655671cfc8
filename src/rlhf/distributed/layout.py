"""Which roles a run places, how they group onto devices, and whether that fits a cluster. Pure: no Ray here.

A role (policy, reference, teacher, critic, reward, generator) has ``num_nodes * devices_per_node`` ranks. Roles named together
in `cluster.colocate` share one placement group: bundle i hosts rank i of each of them, each taking an equal
fraction of the bundle's GPU (or CPU slot). Every other role gets a placement group of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from rlhf.errors import ConfigError
from rlhf.parts import choose

ROLES = ("policy", "reference", "teacher", "critic", "reward", "generator")
RENAMED_ROLES = {"actor": "policy", "ref": "reference"}  # earlier names of two roles, which `cluster.colocate` may still list


@dataclass(frozen=True)
class PlacementSpec:
    """One placement group: the roles sharing it and its shape."""

    roles: tuple[str, ...]
    num_nodes: int
    devices_per_node: int

    @property
    def ranks(self) -> int:
        return self.num_nodes * self.devices_per_node

    def describe(self) -> str:
        return f"{'+'.join(self.roles)}: {self.num_nodes} node(s) x {self.devices_per_node} = {self.ranks}"


def reference_is_base(run) -> bool:
    """Whether the KL reference is the LoRA policy's own base model, adapters switched off (no `ref` role): a
    `policy.lora.rank` is set and `reference.name_or_path` names no other model. ``run``: the `RunSpec` (or a config),
    read for its `policy` and `reference` sections."""
    return run.policy.lora.rank is not None and not run.reference.name_or_path


def used_roles(run, algorithm) -> list[str]:
    """The roles this run needs: actor and generator always; ref, critic, reward and teacher when the run uses them (a LoRA
    policy is its own reference: see `reference_is_base`). ``run``: the `RunSpec` (or a config), read for its
    `policy`, `reference`, `reward` and `teacher` sections."""
    roles = ["policy"]
    if algorithm.needs_reference and not reference_is_base(run):
        roles.append("reference")
    if algorithm.needs_critic:
        roles.append("critic")
    teacher = run.teacher
    if run.reward.path:
        roles.append("reward")
    if teacher.name_or_path and not teacher.url:  # a remote teacher (teacher.url) takes no devices here
        roles.append("teacher")
    return roles + ["generator"]


def role_ranks(cluster, role: str) -> int:
    """Ranks of ``role``: its nodes x devices per node (``cluster``: the `cluster` node, or `RunSpec.cluster`)."""
    spec = getattr(cluster.roles, role)
    return spec.num_nodes * spec.devices_per_node


def placement_specs(cluster, roles: list[str]) -> list[PlacementSpec]:
    """The placement groups of ``roles`` under `cluster.colocate`; ConfigError for a bad grouping."""
    seen: dict[str, int] = {}
    for i, group in enumerate(cluster.colocate):
        for role in group:
            if role not in ROLES:
                renamed = f" ({role!r} is now {RENAMED_ROLES[role]!r})" if role in RENAMED_ROLES else ""
                raise ConfigError(f"cluster.colocate[{i}] names {role!r}{renamed}; roles are {', '.join(ROLES)}")
            if role in seen:
                raise ConfigError(f"cluster.colocate lists {role!r} in groups {seen[role]} and {i}; a role shares devices with one group")
            seen[role] = i
    specs = []
    for group in [list(g) for g in cluster.colocate] + [[r] for r in roles if r not in seen]:
        members = tuple(r for r in group if r in roles)
        if not members:
            continue
        shape = {r: getattr(cluster.roles, r) for r in members}  # the `cluster` node, or `RunSpec.cluster`
        shapes = {(shape[r].num_nodes, shape[r].devices_per_node) for r in members}
        if len(shapes) > 1:
            listing = ", ".join(f"{r} {shape[r].num_nodes}x{shape[r].devices_per_node}" for r in members)
            raise ConfigError(
                f"cluster.colocate groups {'+'.join(members)}, which must have the same num_nodes x devices_per_node "
                f"(got {listing}); make cluster.roles.<role> agree or colocate fewer roles"
            )
        (nodes, per_node), = shapes
        specs.append(PlacementSpec(members, nodes, per_node))
    return specs


def bundle_resources(cluster) -> dict[str, float]:
    """What one device of a placement group reserves."""
    if cluster.device_type == "gpu":
        return {"GPU": 1.0, "CPU": float(cluster.cpus_per_gpu)}
    return {"CPU": 1.0}


def check_fits(specs: list[PlacementSpec], cluster, total: dict[str, float], per_node: list[dict[str, float]]) -> None:
    """ConfigError, with the arithmetic, when the placement groups cannot fit the cluster's resources.

    ``total`` is the cluster's resources (`ray.cluster_resources()`), ``per_node`` each node's.
    """
    bundle = bundle_resources(cluster)
    unit = "GPU" if cluster.device_type == "gpu" else "CPU"
    need = {key: sum(s.ranks for s in specs) * amount for key, amount in bundle.items()}
    breakdown = "; ".join(s.describe() for s in specs)
    for key, amount in need.items():
        have = total.get(key, 0.0)
        if amount > have:
            raise ConfigError(
                f"the placement needs {amount:g} {key} ({breakdown}; x{bundle[key]:g} {key} each) but the Ray cluster "
                f"offers {have:g}; lower cluster.roles.<role>.devices_per_node, colocate roles (cluster.colocate) "
                f"or add nodes" + (" (or raise cluster.num_cpus)" if key == "CPU" and cluster.address is None else "")
            )
    largest = max((node.get(unit, 0.0) for node in per_node), default=0.0)
    for spec in specs:
        if spec.devices_per_node * bundle[unit] > largest:
            raise ConfigError(
                f"{spec.describe()}: {spec.devices_per_node} devices per node x {bundle[unit]:g} {unit} exceed the "
                f"largest node's {largest:g} {unit}; lower cluster.roles.<role>.devices_per_node and raise num_nodes"
            )
    nodes_with_room = sum(node.get(unit, 0.0) >= bundle[unit] for node in per_node)
    for spec in specs:
        if spec.num_nodes > nodes_with_room:
            raise ConfigError(
                f"{spec.describe()}: spans {spec.num_nodes} nodes but only {nodes_with_room} node(s) have a free {unit}; "
                f"lower cluster.roles.<role>.num_nodes or add nodes"
            )


def check_launcher(environ, has_gpu: Callable[[], bool] = lambda: False) -> None:
    """ConfigError when a multi-process launcher (torchrun, `accelerate launch`, the `deepspeed` launcher: each sets
    ``WORLD_SIZE`` and ``LOCAL_RANK``) started this process as one of several: `rlhf.train` places its own ranks, as
    Ray actors, so each copy would train the whole run alone, all in one run folder. A scheduler that sets only
    ``WORLD_SIZE`` (a Kubeflow job's containers) starts no launcher: not refused. ``has_gpu``: whether this machine
    has one, asked only when refusing, so the advice places the ranks on GPUs."""
    world_size = environ.get("WORLD_SIZE", "1")
    if not world_size.isdigit() or int(world_size) <= 1 or "LOCAL_RANK" not in environ:
        return
    local = environ.get("LOCAL_WORLD_SIZE", world_size)
    per_node = int(local) if local.isdigit() and int(local) >= 1 else int(world_size)
    nodes = max(1, int(world_size) // per_node)
    where = ("cluster=ray_local" + (" cluster.device_type=gpu" if has_gpu() else "") if nodes == 1
             else f"cluster=ray (after `ray start` on each of the {nodes} nodes) cluster.roles.policy.num_nodes={nodes}")
    raise ConfigError(
        f"this process is rank {environ.get('RANK', '?')} of {world_size} started by a launcher such as torchrun "
        f"(WORLD_SIZE={world_size}), but python -m rlhf.train starts its own training ranks: each of the {world_size} "
        f"processes would train the whole run alone. Start it once, without the launcher, and give the ranks in the "
        f"config: python -m rlhf.train {where} policy/strategy=ddp (or fsdp2, deepspeed) "
        f"cluster.roles.policy.devices_per_node={per_node} cluster.roles.reference.devices_per_node={per_node} "
        f"(docs/scaling.md). If no launcher started it, unset WORLD_SIZE and LOCAL_RANK"
    )


def _check_strategy(key: str, node, ranks: int, backend: str, role: str) -> None:
    """The strategy's own checks (its node typed by its config class), then how it fits the role's ranks and backend."""
    strategy = choose("strategy", node, key)
    group = key.replace(".", "/")
    if backend == "local" and strategy.trait("needs_process_group", False):
        raise ConfigError(
            f"{group}={strategy.name} runs one process per device, which the run starts as Ray actors (not torchrun): "
            f"it needs cluster.backend=ray, e.g. cluster=ray_local (2 ranks per trained model; "
            f"cluster.roles.{role}.devices_per_node sets the number)"
        )
    if strategy.trait("single_device", False) and ranks > 1:
        raise ConfigError(
            f"{group}={strategy.name} trains on one device but cluster.roles.{role} has {ranks} ranks; choose auto, ddp, "
            f"fsdp2 or deepspeed, or set cluster.roles.{role}.num_nodes=1 and devices_per_node=1"
        )


def validate_cluster(run, algorithm, samples_per_step: int, mini_batch_units: int) -> dict[str, int]:
    """Every check of `cluster.*` and the training strategies that needs no running cluster; returns ranks per role.
    ``run``: the `RunSpec` (or a config), read for its `cluster`, `policy`, `critic` and the sections `used_roles` reads."""
    cluster = run.cluster
    if cluster.backend not in ("local", "ray"):
        raise ConfigError(f"cluster.backend={cluster.backend!r}; choose local or ray")
    if cluster.device_type not in ("cpu", "gpu"):
        raise ConfigError(f"cluster.device_type={cluster.device_type!r}; choose gpu or cpu")
    if cluster.timeout_s <= 0 or cluster.placement_timeout_s <= 0:
        raise ConfigError(f"cluster.timeout_s={cluster.timeout_s} and cluster.placement_timeout_s={cluster.placement_timeout_s} must be > 0")
    if cluster.setup_timeout_s <= 0:
        raise ConfigError(f"cluster.setup_timeout_s={cluster.setup_timeout_s} must be > 0")
    roles = used_roles(run, algorithm)
    for role in ROLES:
        spec = getattr(cluster.roles, role)
        if spec.num_nodes < 1 or spec.devices_per_node < 1:
            raise ConfigError(f"cluster.roles.{role}: num_nodes={spec.num_nodes} and devices_per_node={spec.devices_per_node} must be >= 1")
    ranks = {role: role_ranks(cluster, role) if cluster.backend == "ray" else 1 for role in roles}
    trained = [("policy", "policy.strategy", run.policy.strategy)] + (
        [("critic", "critic.strategy", run.critic.strategy)] if "critic" in roles else []
    )
    for role, key, strategy in trained:
        _check_strategy(key, strategy, ranks[role], cluster.backend, role)
        n = ranks[role]
        if samples_per_step % n or mini_batch_units % n:
            raise ConfigError(
                f"cluster.roles.{role} has {n} training ranks, which must divide the {samples_per_step} samples per step "
                f"and the {mini_batch_units} units of a mini batch (train.prompts_per_step, train.num_mini_batches); "
                f"every rank takes an equal share: give cluster.roles.{role} a number of ranks (num_nodes x "
                f"devices_per_node) that divides both, or make both multiples of {n}"
            )
    if cluster.backend == "ray":
        placement_specs(cluster, roles)  # a bad colocation fails here, before anything starts
    return ranks
