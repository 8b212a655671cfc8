"""Config keys belong to the component that reads them: a key set for a role the run does not fill (a critic without
an advantage that trains one, a reference with beta 0, reward-model keys without a reward model, Ray keys on the
local backend, policy-gradient keys with a pairwise algorithm) is an error before anything loads, naming the key and
the choice that reads it. A key counts as set when its value differs from the schema's default.

Parts (the algorithm's parts, the generator, the schedule, the environment, the dataset) need no such check: each
owns a node holding only the keys its config class declares (`rlhf.parts`).
"""

from __future__ import annotations

from dataclasses import MISSING, fields

from omegaconf import DictConfig, ListConfig, OmegaConf

from rlhf.config.schema import (
    TeacherConfig,
    AlgorithmConfig, ClusterConfig, CriticConfig, LoraConfig, ReferenceConfig, RewardConfig,
)
from rlhf.errors import ConfigError

LOCAL_ONLY = ("device",)


def _plain(value):
    return OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value


def set_keys(node, schema) -> list[str]:
    """Keys of ``node`` whose value differs from the schema dataclass's default."""
    changed = []
    for f in fields(schema):
        if f.default is not MISSING:
            default = f.default
        elif f.default_factory is not MISSING:
            default = f.default_factory()
            default = OmegaConf.to_container(OmegaConf.structured(default)) if hasattr(default, "__dataclass_fields__") else default
        else:
            continue
        if _plain(node[f.name]) != default:
            changed.append(f.name)
    return changed


def _refuse(section: str, node, schema, read: set[str], chosen: str, readers) -> None:
    """ConfigError for the first set key of ``section`` that is not in ``read``; ``readers(key)`` says who reads it."""
    for key in set_keys(node, schema):
        if key not in read:
            who = readers(key)
            hint = f"it is read by {who}" if who else "no component reads it"
            raise ConfigError(
                f"{section}.{key}={_plain(node[key])!r} is not read by this run's choice ({chosen}); {hint}. "
                f"Remove the override or choose that component"
            )


def check_ownership(cfg, algorithm) -> None:
    """ConfigError naming the first key that is set but read by no chosen component (see the module docstring)."""
    algo = cfg.algorithm
    reads = getattr(algorithm, "reads", None)  # the algorithm shape's own keys, when it reads only some (pairwise)
    if reads is not None:
        chosen = f"algorithm.advantage={algo.advantage.name}, a pairwise algorithm"
        _refuse("algorithm", algo, AlgorithmConfig, set(reads), chosen, lambda key: "a per-token (policy-gradient) algorithm")
    critic = "algorithm/advantage=gae (an advantage with a critic)"
    if not algorithm.needs_critic:
        _refuse("critic", cfg.critic, CriticConfig, {"name"}, f"algorithm.advantage={algo.advantage.name} trains no critic", lambda k: critic)
    if not algorithm.needs_reference:
        _refuse("reference", cfg.reference, ReferenceConfig, {"name"}, "algorithm.beta=0 loads no reference", lambda k: "algorithm.beta > 0")
    if not algorithm.needs_teacher:
        chosen = f"algorithm.advantage={algo.advantage.name} with algorithm.distill_coef=0 loads no teacher"
        _refuse("teacher", cfg.teacher, TeacherConfig, set(), chosen, lambda k: "algorithm/advantage=opd or algorithm.distill_coef != 0")
    if not cfg.reward.path:
        model_keys = ("model_weight", "normalize", "clip")
        other = {f.name for f in fields(RewardConfig)} - set(model_keys)
        _refuse("reward", cfg.reward, RewardConfig, other, "reward.path=null: no reward model", lambda k: "a reward model (reward.path)")
    for role in ("policy", "critic"):
        lora = cfg[role].lora
        if lora.rank is None:
            _refuse(f"{role}.lora", lora, LoraConfig, {"rank"}, f"{role}.lora.rank=null trains every weight",
                    lambda k, role=role: f"LoRA adapters ({role}.lora.rank set, 8 or 16 are usual)")
    if cfg.cluster.backend == "local":
        local = {"name", "backend", "device", "device_memory_gb"}
        _refuse("cluster", cfg.cluster, ClusterConfig, local, "cluster.backend=local", lambda k: "cluster.backend=ray")
    else:
        ray_keys = {f.name for f in fields(ClusterConfig)} - set(LOCAL_ONLY)
        _refuse("cluster", cfg.cluster, ClusterConfig, ray_keys, "cluster.backend=ray", lambda k: "cluster.backend=local")
