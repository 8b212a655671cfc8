"""`algorithm` nodes as composition makes them, for tests that build an algorithm without composing a whole run: the
algorithm's own keys plus one node per part (`rlhf.parts`), each the part's default node with the given keys set."""

from __future__ import annotations

from dataclasses import fields

from omegaconf import DictConfig, OmegaConf

from rlhf import registry
from rlhf.config.schema import AlgorithmConfig
from rlhf.parts import GROUPS, PartConfig, config_class

PART_KINDS = {group.rpartition("/")[2]: kind for group, kind in GROUPS.items()}  # node -> registry kind
# algorithm presets that need a value outside `algorithm` to run on the built-in task
PRESET_NEEDS = {"opd": ["teacher.name_or_path=builtin:tiny_arith_teacher"]}  # its teacher: the default run's final policy


def part_node(node: str, name: str | dict | None) -> dict | None:
    """The default node of the part ``name`` at `algorithm.<node>` (as Hydra's ConfigStore holds it); a dict names the
    part (`name`) and sets keys of its node; None for null."""
    if name is None:
        return None
    keys = dict(name) if isinstance(name, dict) else {"name": name}
    if keys["name"] not in registry.node_names(PART_KINDS[node]):
        return keys  # a name the build should refuse, or an import path: the node as written
    cls = config_class(registry.resolve(PART_KINDS[node], keys["name"]), f"algorithm.{node}", keys["name"]) or PartConfig
    return OmegaConf.to_container(OmegaConf.structured(cls(name=keys["name"]))) | keys


def algorithm_cfg(
    advantage: str | dict = "grpo", policy_loss: str | dict = "ppo_clip", rollout_correction: str | dict | None = None,
    kl_ctl: str | dict | None = "fixed", **keys,
) -> DictConfig:
    """The `algorithm` node composition gives: schema defaults, the named parts' default nodes (a dict: a name and
    keys of its node), then ``keys``: an algorithm-level key sets the algorithm, any other the chosen part whose config
    declares it (KeyError if none)."""
    top = {f.name: f.default for f in fields(AlgorithmConfig) if f.name not in PART_KINDS}
    top["name"] = "test"
    parts = {
        "advantage": part_node("advantage", advantage), "policy_loss": part_node("policy_loss", policy_loss),
        "rollout_correction": part_node("rollout_correction", rollout_correction), "kl_ctl": part_node("kl_ctl", kl_ctl),
    }
    for key, value in keys.items():
        owners = [node for node in parts.values() if node is not None and key in node and key != "name"]
        if key in top:
            top[key] = value
        elif owners:
            owners[0][key] = value
        else:
            raise KeyError(f"{key} is neither an algorithm key nor a key of the chosen parts {parts}")
    return OmegaConf.create(top | parts)
