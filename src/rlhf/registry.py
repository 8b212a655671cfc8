"""Named registries for every component kind, so a user's own class plugs in by config alone.

A config names a component either by its registered name (``grpo``, ``hf``, ``arith_correct``) or by
an import path (``mypkg.rewards.length_bonus``); the latter is imported on demand. The factory's
keyword arguments are fixed per kind and documented on that kind's base module.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from rlhf.errors import ConfigError

KINDS = (
    "dataset", "preference_dataset", "generator", "policy", "reference", "critic", "reward", "advantage", "policy_loss",
    "pair_selector", "pairwise_loss", "schedule", "env", "rollout_correction", "kl_controller", "strategy",
)
# kinds chosen at another kind's config node: `algorithm.advantage` names an advantage estimator or, for a pairwise
# algorithm (online DPO), a pair selector; `algorithm.policy_loss` a policy loss or a pairwise loss
SHARES_NODE = {"advantage": ("pair_selector",), "policy_loss": ("pairwise_loss",)}

_REGISTRY: dict[str, dict[str, Callable[..., Any]]] = {kind: {} for kind in KINDS}
_BUILTINS_LOADED = False


class RegistryError(ConfigError):
    """A component name that is neither registered nor importable."""


def register(kind: str, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: make ``obj`` buildable as ``name`` for component ``kind``."""
    if kind not in _REGISTRY:
        raise RegistryError(f"unknown component kind {kind!r}; kinds are {', '.join(KINDS)}")

    def add(obj: Callable[..., Any]) -> Callable[..., Any]:
        existing = _REGISTRY[kind].get(name)
        if existing is not None and existing is not obj:
            raise RegistryError(f"{kind} {name!r} is registered twice: {existing} and {obj}")
        _REGISTRY[kind][name] = obj
        return obj

    return add


def _load_builtins() -> None:
    """Import the modules whose decorators fill the registry (once, lazily: keeps `import rlhf` light)."""
    global _BUILTINS_LOADED
    if _BUILTINS_LOADED:
        return
    _BUILTINS_LOADED = True
    for module in (
        "rlhf.data.arith",
        "rlhf.data.count",
        "rlhf.data.mix",
        "rlhf.data.preferences",
        "rlhf.data.reasoning_gym",
        "rlhf.data.code_tasks",
        "rlhf.algorithms",
        "rlhf.training.critic",
        "rlhf.generators.hf",
        "rlhf.generators.vllm",
        "rlhf.training.policy",
        "rlhf.training.strategies",
        "rlhf.models.reference",
        "rlhf.rewards.rules",
        "rlhf.rewards.reasoning_gym",
        "rlhf.rewards.math",
        "rlhf.rewards.remote",
        "rlhf.rewards.code",
        "rlhf.rewards.judge",
        "rlhf.schedules.sync",
        "rlhf.schedules.asynchronous",
        "rlhf.schedules.hybrid",
        "rlhf.schedules.streaming",
        "rlhf.envs.builtin",
        "rlhf.envs.gem",
        "rlhf.envs.agent_func",
        "rlhf.envs.single_turn",
        "rlhf.agents.endpoint",
    ):
        importlib.import_module(module)


def names(kind: str) -> list[str]:
    """Registered names of one kind, sorted."""
    _load_builtins()
    return sorted(_REGISTRY[kind])


def node_kinds(kind: str) -> tuple[str, ...]:
    """The kinds the config node of ``kind`` may choose: ``kind`` and those that share its node (`SHARES_NODE`)."""
    return (kind, *SHARES_NODE.get(kind, ()))


def node_names(kind: str) -> list[str]:
    """Registered names the config node of ``kind`` may choose, sorted (`node_kinds`)."""
    return sorted(name for each in node_kinds(kind) for name in names(each))


def kind_of(kind: str, name: str) -> str:
    """Which of `node_kinds(kind)` ``name`` is: the kind it is registered under, else (an import path) the kind its
    object declares (``kind = "pairwise_loss"``), else ``kind``."""
    _load_builtins()
    for each in node_kinds(kind):
        if name in _REGISTRY[each]:
            return each
    declared = trait(resolve(kind, name), "kind", kind)
    if declared not in node_kinds(kind):
        raise RegistryError(
            f"{kind} {name!r} declares kind={declared!r}, which the node of a {kind} cannot choose; declare one of "
            f"{', '.join(node_kinds(kind))}"
        )
    return declared


def resolve(kind: str, name: str, key: str | None = None) -> Callable[..., Any]:
    """The factory for ``name``: a registered name (of ``kind``, or of a kind sharing its node: `node_kinds`), else
    ``package.module.attribute`` imported.

    ``key`` is the config key that named it, quoted in the error so the user knows what to fix.
    """
    _load_builtins()
    where = f" (config key `{key}`)" if key else ""
    for each in node_kinds(kind):
        if name in _REGISTRY[each]:
            return _REGISTRY[each][name]
    module_name, _, attr = name.rpartition(".")
    if not module_name:
        registered = "; ".join(f"{each}: {', '.join(names(each))}" for each in node_kinds(kind)[1:])
        raise RegistryError(
            f"unknown {' or '.join(node_kinds(kind))} {name!r}{where}. Registered: {', '.join(names(kind))}"
            f"{'; ' + registered if registered else ''}; or give an import path such as `mypkg.module.MyClass`."
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise RegistryError(f"cannot import module {module_name!r} for {kind} {name!r}{where}: {err}") from err
    try:
        found = getattr(module, attr)
    except AttributeError:
        raise RegistryError(f"module {module_name!r} has no attribute {attr!r} for {kind} {name!r}{where}") from None
    if not callable(found):
        raise RegistryError(
            f"{kind} {name!r}{where} is {type(found).__name__} {found!r:.60}, not a function or class; name the "
            f"function (or class) itself"
        )
    return found


def trait(component: Any, name: str, default: Any = None) -> Any:
    """A registered component's declared trait (``config_keys``, ``pairwise``, ...); a user's own may declare none."""
    return getattr(component, name, default)


def schedule_trait(schedule_cfg, name: str) -> bool:
    """A trait the schedule `schedule.name` declares (False when it declares none): ``sleeps_generator`` (the
    generator sleeps while the policy trains, on the same devices), ``overlaps_generation`` (generation runs while
    the policy trains). Checks and the memory plan ask these instead of testing the schedule's name."""
    return bool(trait(resolve("schedule", schedule_cfg.name, key="schedule.name"), name, False))


def build(kind: str, name: str, key: str | None = None, **kwargs: Any) -> Any:
    """Resolve ``name`` and call its factory with ``kwargs``."""
    return resolve(kind, name, key)(**kwargs)
