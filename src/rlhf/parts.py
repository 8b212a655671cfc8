"""Part nodes: a registered part brings its own config, a dataclass beside its code.

A part chosen by config (an advantage estimator, a policy loss, a rollout correction, a KL controller) has a node
of its own, e.g. `algorithm.policy_loss`: ``name`` (the registered name or an import path) plus the keys the part's
config class declares, each with its default and a one-line comment. Hydra's ConfigStore holds one node per
registered part under its group (`algorithm/policy_loss/gspo`), so ``algorithm/policy_loss=gspo`` swaps the whole
node and ``algorithm.policy_loss.clip_eps_high=0.28`` sets one of its keys. A part of your own, named by import path,
declares its class the same way (``fn.config = MyConfig``) and gets its node from a YAML file of yours
(`<your conf dir>/algorithm/policy_loss/mine.yaml` holding ``name: mypkg.losses.mine`` and its keys, found through
``hydra.searchpath``), or from the node it renames (``env.name=mypkg.MyEnv`` under `env=none`, which holds only
``name``): its keys are then added with ``+`` (``+env.my_key=3``), and those left out read as its class's defaults.

`choose` reads a node before any model loads: it resolves the part, types the node by the part's class (an unknown
key, a wrong type or a missing value is a ConfigError naming `<node>.<key>` and the part) and runs the class's
`check`. The part is then called with its typed config as the last argument. A part of your own that declares no
class gets its node as written, unchecked.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlhf import registry
from rlhf.errors import ConfigError

GROUPS = {  # config group (and node path, with dots) -> registry kind (with the kinds sharing its node: `registry.node_kinds`)
    "algorithm/advantage": "advantage",
    "algorithm/policy_loss": "policy_loss",
    "algorithm/rollout_correction": "rollout_correction",
    "algorithm/kl_ctl": "kl_controller",
    "generator": "generator",
    "schedule": "schedule",
    "env": "env",
    "dataset": "dataset",
    "policy/strategy": "strategy",
    "critic/strategy": "strategy",
}
PATHS = {group.replace("/", "."): group for group in GROUPS}  # node path -> its group: algorithm.policy_loss -> algorithm/policy_loss


@dataclass
class PartConfig:
    """The key every part node has; a part's own config class extends it with its keys, one comment each."""

    name: str = MISSING  # registered name, or an import path `pkg.module.attribute` to a part of your own

    def check(self, at: str) -> None:
        """ConfigError for a value out of range, naming `<at>.<key>` (``at``: where the node sits, e.g.
        `algorithm.policy_loss`). Nothing to check here; a part's class overrides it."""


@dataclass(frozen=True)
class Part:
    """A chosen part: the registered object and its typed config. Calling it passes the config last."""

    obj: Any  # the registered function or class
    config: Any  # the node, typed by the part's config class and checked (as written when the part declares none)
    at: str  # where the node sits, e.g. algorithm.policy_loss

    @property
    def name(self) -> str:
        return self.config.name

    def __call__(self, *args: Any) -> Any:
        return self.obj(*args, self.config)

    def trait(self, name: str, default: Any = None) -> Any:
        """A trait the part declares (``pairwise``, ``needs_critic``, ...), else ``default``."""
        return registry.trait(self.obj, name, default)


def config_class(obj: Any, at: str, name: str) -> type | None:
    """The part's config class (its ``config`` attribute; None when it declares none); a ConfigError in one paragraph
    when the attribute is not a dataclass extending `PartConfig`."""
    cls = registry.trait(obj, "config", None)
    if cls is not None and not (isinstance(cls, type) and dataclasses.is_dataclass(cls) and issubclass(cls, PartConfig)):
        raise ConfigError(
            f"{at}.name={name}: its `config` attribute is {cls!r}, not a config class. Declare a dataclass that "
            f"extends rlhf.parts.PartConfig, one field per key with a default and a comment, and set it as the "
            f"part's `config` attribute (e.g. `my_loss.config = MyLossConfig`)"
        )
    return cls


def choose(kind: str, node: Any, at: str, base: type | None = None) -> Part:
    """The part the node at ``at`` names, with its node typed by the part's config class and checked. ``base``: the
    class every part of the kind extends (an environment's `EnvConfig`), typing a part that declares none."""
    group = at.replace(".", "/")
    if not isinstance(node, (DictConfig, dict)):
        raise ConfigError(
            f"{at}={node!r}: a part is chosen as a node now; write {group}={node} (its registered name), or for a "
            f"part of your own select a YAML node of yours holding `name: <import path>` ({group}=<file name>)"
        )
    name = node.get("name")
    if name is None or name == MISSING:
        raise ConfigError(f"{at} has no `name`; choose one with {group}=<name> ({', '.join(registry.node_names(kind))})")
    obj = registry.resolve(kind, name, key=f"{at}.name")
    cls = config_class(obj, at, name) or base
    if cls is None:  # the node as written, read by attribute as a node is (a typed copy's part nodes are dicts)
        return Part(obj, OmegaConf.create(node) if isinstance(node, dict) else node, at)
    if base is not None and not issubclass(cls, base):
        raise ConfigError(f"{at}.name={name}: its config class {cls.__name__} does not extend {base.__module__}."
                          f"{base.__name__}, whose keys every {kind} is read with; declare it as "
                          f"`class {cls.__name__}({base.__name__})`")
    values = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    known = [f.name for f in dataclasses.fields(cls)]
    for key in values:
        if key not in known:
            raise ConfigError(f"{at}.{key} is not a key of {at.rpartition('.')[2]} {name} (its config {cls.__name__} has "
                              f"{', '.join(known)}); {_where_else(kind, at, str(key), known)}")
    try:
        config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), values))
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "?"
        reason = str(getattr(err, "msg", err)).splitlines()[0]
        raise ConfigError(f"{at}.{key}: {reason} ({at.rpartition('.')[2]} {name}, config {cls.__name__})") from None
    try:
        config.check(at)
    except ConfigError:
        raise
    except Exception as err:  # a user's check that fails itself: one paragraph, not a traceback
        raise ConfigError(f"{at}.name={name}: {cls.__name__}.check raised {type(err).__name__}: {err}") from None
    return Part(obj, config, at)


def _where_else(kind: str, at: str, key: str, known: list[str]) -> str:
    """The fix for a key the chosen part does not declare: the registered parts that do, or the closest key."""
    readers = [n for n in registry.node_names(kind) if key in _declared(registry.resolve(kind, n))]
    if readers:
        return f"it is a key of {at.replace('.', '/')}={' or '.join(readers)}; choose that part, or remove the key (from the command line; ~{at}.{key} removes one a YAML file sets)"
    close = difflib.get_close_matches(key, known, n=1)
    return f"did you mean {at}.{close[0]}?" if close else "remove it"


def _declared(obj: Any) -> list[str]:
    cls = registry.trait(obj, "config", None)
    return [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else []


def declared_by_every(kind: str, key: str) -> bool:
    """Whether every registered part of ``kind`` declares ``key`` (a shared key, e.g. `max_new_tokens`)."""
    return all(key in _declared(registry.resolve(kind, name)) for name in registry.node_names(kind))


def typed_node(kind: str, node: Any, at: str) -> DictConfig:
    """The node as an OmegaConf config typed by its part's class, defaults filled (what a part that reads its config
    the OmegaConf way, e.g. a dataset builder, is given)."""
    return OmegaConf.structured(choose(kind, node, at).config)


def choose_optional(kind: str, node: Any, at: str) -> Part | None:
    """`choose`, or None for a null node (the part is off)."""
    return None if node is None else choose(kind, node, at)


def store_nodes() -> None:
    """Put every registered part's default node in Hydra's ConfigStore under its group (`algorithm/policy_loss/gspo`),
    so a defaults list or the command line can select it by name."""
    store = ConfigStore.instance()
    for group, kind in GROUPS.items():
        for name in registry.node_names(kind):
            store.store(group=group, name=name, node=default_node(group, name))


def default_node(group: str, name: str) -> dict:
    """The node ``group=name`` selects (`policy/strategy=deepspeed`): ``name`` and the part's keys at their defaults."""
    kind = GROUPS[group]
    cls = config_class(registry.resolve(kind, name), group.replace("/", "."), name) or PartConfig
    return OmegaConf.to_container(OmegaConf.structured(cls(name=name)))
