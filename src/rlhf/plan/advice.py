"""When a plan does not fit: the cheapest config changes that make it fit, each with its figure.

Every candidate is a list of overrides, tried by planning a copy of the config with them (the run's config is
never changed). Candidates are ordered by what they cost: the cheapest memory first (a compiled policy's activation
memory budget recomputes only elementwise work, gradient checkpointing costs a third more compute, a hybrid schedule
little), then smaller batches, then sharding and offloading.
"""

from __future__ import annotations

import copy
import dataclasses

from omegaconf import OmegaConf

from rlhf.errors import ConfigError
from rlhf.generators.base import sleep_overrides
from rlhf.micro_batches import halvings
from rlhf.parts import GROUPS, choose, default_node
from rlhf.plan.memory import gib
from rlhf.plan.roles import sharding
from rlhf.plan.planner import Plan, make_plan


def with_overrides(cfg, overrides: list[str]):
    """A new config: ``cfg`` with ``overrides`` applied, as the command line would (`policy/strategy=fsdp2` selects the
    part's node, then "key=value" sets keys in it); ``cfg`` itself is untouched."""
    new = copy.deepcopy(cfg)
    OmegaConf.set_struct(new, False)  # a newly chosen part's node brings keys the old one lacked
    chosen = [o.partition("=") for o in overrides if o.partition("=")[0] in GROUPS]
    for group, _, name in chosen:
        OmegaConf.update(new, group.replace("/", "."), default_node(group, name), merge=False)
    return OmegaConf.merge(new, OmegaConf.from_dotlist([o for o in overrides if o.partition("=")[0] not in GROUPS]))


def candidates(plan: Plan) -> list[list[list[str]]]:
    """Changes worth trying for the run ``plan`` was made for, cheapest first, in families of alternatives (a
    family's changes set the same keys, preferred first): e.g. [[micro_batch_size=16], [micro_batch_size=8]]."""
    found: list[list[list[str]]] = []
    spec = plan.spec
    roles = {role for group in plan.groups for role in group.roles}
    budget = spec.policy.activation_memory_budget
    if spec.policy.compile:  # compiled blocks recompute elementwise work only: cheaper than checkpointing whole blocks
        found.append([[f"policy.activation_memory_budget={b}"] for b in (0.5, 0.3) if budget is None or b < budget])
    if not spec.policy.gradient_checkpointing:
        found.append([["policy.gradient_checkpointing=true"]])
    if "critic" in roles and not spec.critic.gradient_checkpointing:
        found.append([["critic.gradient_checkpointing=true"]])
    generator_shares = any("generator" in g.roles and len(g.roles) > 1 for g in plan.groups)
    in_turn = not (spec.schedule.trait("sleeps_generator", False) or spec.schedule.trait("overlaps_generation", False))
    backend = spec.generator
    sleep = sleep_overrides(backend.obj, backend.config)
    if generator_shares and in_turn and sleep is not None:  # the generator holds its memory through training: suggest it sleeps
        found.append([["schedule=hybrid", *sleep]])
    shrink = backend.trait("memory_advice")
    if shrink is not None:
        found.append(shrink(backend.config, generator_shares, plan_rows(plan)))
    # from the micro batch the plan used (a train.micro_batch_size above the mini batch is the mini batch)
    found.append([[f"train.micro_batch_size={size}"] for size in halvings(plan.workload.micro_rows)])
    if spec.model.dtype == "float32" and plan.kind == "cuda":
        found.append([["model.dtype=bfloat16"]])
    if spec.config.cluster.backend == "ray":
        found += strategy_candidates(spec.policy.strategy, "policy")
        if "critic" in roles:
            found += strategy_candidates(spec.critic.strategy, "critic")
    return [family for family in found if family]


def plan_rows(plan: Plan) -> int:
    """Rows the generator holds at once in ``plan`` (hf: what generator.batch_size can cap)."""
    return plan.workload.generate_rows


def strategy_candidates(node, trained: str) -> list[list[list[str]]]:
    """Sharding and offloading of a trained role's state (``trained``: policy or critic, ``node`` its `strategy` node;
    Ray backend)."""
    found = []
    key = f"{trained}.strategy"
    part = choose("strategy", node, key)
    shard, group = sharding(part, ranks=1), key.replace(".", "/")  # auto reads as single: unsharded either way
    unsharded = shard.strategy in ("single", "ddp")
    if unsharded:  # its node holds only `name`, so choosing another strategy leaves no key behind
        found.append([[f"{group}=deepspeed", f"{key}.zero_stage=3"], [f"{group}=fsdp2"]])
    elif shard.strategy == "deepspeed" and declares(part.config, "zero_stage") and shard.zero_stage < 3:
        found.append([[f"{key}.zero_stage=3"]])
    if (unsharded or declares(part.config, "offload_optimizer")) and not shard.offload_optimizer:
        offload = f"{key}.offload_optimizer=true"
        found.append([[f"{group}=fsdp2", offload]] if unsharded else [[offload]])
    return found


def advise(plan: Plan) -> list[str]:
    """Lines naming each change that makes ``plan`` fit alone, with the fullest device before -> after; when none
    does alone, the cheapest combination that does (greedy: one change per family, in family order). Each change is
    tried on a copy of the run's config (`Plan.spec`)."""
    cfg = plan.spec.config
    before = plan.needed(plan.worst)
    families = candidates(plan)
    lines = []
    for family in families:
        for overrides in family:
            after = plan_with(cfg, overrides)
            if after is not None and after.fits:
                lines.append(f"{' '.join(overrides)}: {describe(plan, before, after)}")
    if lines:
        return lines
    chosen: dict[str, str] = {}
    best = plan
    for family in families:
        trials = [(plan_with(cfg, as_list(combine(chosen, o))), o) for o in family]
        trials = [(after, o) for after, o in trials if after is not None]
        if not trials:
            continue
        after, overrides = min(trials, key=lambda trial: trial[0].needed(trial[0].worst))
        if after.needed(after.worst) < best.needed(best.worst):
            chosen, best = combine(chosen, overrides), after
        if best.fits:
            return [f"together, {' '.join(as_list(chosen))}: {describe(plan, before, best)}"]
    return []


def plan_with(cfg, overrides: list[str]) -> Plan | None:
    """The plan of ``cfg`` with ``overrides``; None when the run's checks refuse that config (a micro batch that does
    not divide the mini batch): a change the run would refuse is no advice."""
    try:
        return make_plan(with_overrides(cfg, overrides))
    except ConfigError:
        return None


def declares(config, key: str) -> bool:
    """Whether a part's typed config has ``key`` (a user's part that declares no config class has none to suggest)."""
    return dataclasses.is_dataclass(config) and key in {f.name for f in dataclasses.fields(config)}


def combine(chosen: dict[str, str], overrides: list[str]) -> dict[str, str]:
    """``chosen`` with ``overrides`` on top; a newly chosen strategy drops the old strategy's settings."""
    new = dict(item.split("=", 1) for item in overrides)
    for trained in ("policy", "critic"):
        if f"{trained}/strategy" in new:
            chosen = {key: value for key, value in chosen.items() if not key.startswith((f"{trained}.strategy.", f"{trained}/strategy"))}
    return {**chosen, **new}


def as_list(overrides: dict[str, str]) -> list[str]:
    return [f"{key}={value}" for key, value in overrides.items()]


def describe(plan: Plan, before: int, after: Plan) -> str:
    """'policy + reference 61.2 -> 38.0 GiB/device' for the fullest device group."""
    return f"{' + '.join(plan.worst.roles)} {gib(before)} -> {gib(after.needed(after.worst))} GiB/device"
