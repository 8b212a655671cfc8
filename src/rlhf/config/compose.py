"""Register the schema with Hydra and compose configs outside `@hydra.main` (tests, tools, notebooks)."""

from __future__ import annotations

import re

from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException, OverrideParseException
from omegaconf import DictConfig, OmegaConf

from rlhf.config.moved import check_overrides, moved_to
from rlhf.config.schema import RewardTrainConfig, RunConfig
from rlhf.config.unknown_keys import declared_keys, describe_unknown
from rlhf import registry
from rlhf.errors import ConfigError
from rlhf.parts import GROUPS, PATHS, choose, declared_by_every, store_nodes

CONFIG_MODULE = "rlhf.conf"
SCHEMA_NAME = "rlhf_schema"


def token_share(tokens: int, share: float) -> int:
    """`${rlhf.share:N,s}` in a config: the share ``s`` of ``N`` tokens, rounded down, at least 1 (a preset that
    scales with the generation budget, e.g. DAPO's overlong buffer, a fifth of it)."""
    return max(1, int(tokens * share))


# registered on import of rlhf.config, so every process that reads a config (Ray workers too) can resolve it
OmegaConf.register_new_resolver("rlhf.share", token_share, replace=True)


def register_schema() -> None:
    """Make the structured schemas available to the defaults lists of conf/config.yaml and conf/train_reward.yaml,
    and every registered part's node to its group (`algorithm/policy_loss/gspo`)."""
    store_nodes()
    store = ConfigStore.instance()
    store.store(name=SCHEMA_NAME, node=RunConfig)
    store.store(name="reward_train_schema", node=RewardTrainConfig)


def compose_config(overrides: list[str] | None = None, config_name: str = "config") -> DictConfig:
    """The config `python -m rlhf.train <overrides>` would get (or rlhf.train_reward's, with config_name="train_reward")."""
    check_overrides(list(overrides or []))
    register_schema()
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        try:
            return compose(config_name=config_name, overrides=list(overrides or []))
        except ConfigCompositionException as err:
            raise_if_moved(err)
            raise_if_not_the_parts(list(overrides or []), err, config_name)
            raise_if_no_such_part(list(overrides or []), err)
            raise_if_not_a_key(list(overrides or []), err, config_name)
            raise


HYDRA_VALUED_FLAGS = ("--cfg", "-c", "--package", "-p", "--experimental-rerun")  # Hydra's flags followed by a value
OTHER_CONFIG_FLAGS = ("--config-name", "-cn", "--config-path", "-cp", "--config-dir", "-cd")  # another primary config


def command_line_overrides(argv: list[str]) -> list[str]:
    """The overrides among ``argv`` (Hydra's own flags and their values left out: `--cfg job`, `-m`, `--info
    defaults`), which the checks before Hydra compose with; none when a flag chooses another primary config."""
    overrides, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
        elif arg.partition("=")[0] in OTHER_CONFIG_FLAGS:
            return []
        elif arg.startswith("-"):  # a flag; a value follows those that take one (--info's is optional)
            following = argv[i + 1] if i + 1 < len(argv) else ""
            skip = arg in HYDRA_VALUED_FLAGS or (arg in ("--info", "-i") and "=" not in following and following != "")
        else:
            overrides.append(arg)
    return overrides


def check_command_line(argv: list[str], config_name: str = "config") -> None:
    """For `python -m rlhf.train <argv>` (or `rlhf.train_reward`'s, with config_name="train_reward", which has no parts),
    before Hydra composes: the overrides among ``argv`` composed once, when one of
    them could fail in Hydra with a message that misleads, so the failure names the part instead (not for sweeps,
    which Hydra composes per job):

    - a key under a part's node that the chosen part does not declare (`generator.enable_sleep`): the message names the
      part and the parts that declare it, instead of Hydra's advice to add it with `+`;
    - an algorithm (or experiment) whose defaults list lacks a part group another choice overrides (`algorithm=online_dpo`
      under a preset choosing `algorithm/rollout_correction`): the message names the group and why, instead of Hydra's
      "No match in the defaults list";
    - a key the schema does not declare (`checkpoint.evry`): the message names the closest key, instead of Hydra's
      advice to add it with `+`.

    A malformed override or any other composition error is left to Hydra's own message."""
    overrides = command_line_overrides(argv)
    if any("," in o for o in overrides):
        return
    keys = [o.partition("=")[0] for o in overrides if "=" in o]
    plain = [o.partition("=")[0] for o in overrides if "=" in o and not o.startswith(("+", "~"))]
    parts = config_name == "config"
    lacking = parts and any(_may_lack(k) for k in plain)
    undeclared = any("/" not in k and _undeclared(k, RunConfig if parts else RewardTrainConfig) for k in plain)
    chooses = parts and any(k in ("algorithm", "experiment") or k.startswith("algorithm/") for k in keys)
    if not (lacking or undeclared or chooses):
        return
    try:
        compose_config(overrides, config_name)
    except (ConfigCompositionException, OverrideParseException):
        pass  # Hydra's own message, shown when Hydra composes


def raise_if_no_such_part(overrides: list[str], err: Exception) -> None:
    """ConfigError for Hydra's "Could not override 'algorithm/<part>'": the chosen algorithm's preset lists no such
    part (a pairwise algorithm has no rollout correction)."""
    found = re.search(r"(?:In '([\w/]+)': )?Could not override '(algorithm/\w+)'\. No match in the defaults list", str(err))
    if found is None:
        return
    source, group = found.groups()
    algorithm = next((o.partition("=")[2] for o in overrides if o.partition("=")[0] == "algorithm"), None)
    which = f"algorithm={algorithm}" if algorithm else "the chosen algorithm"
    where = f"conf/algorithm/{algorithm}.yaml" if algorithm else "its preset under conf/algorithm/"
    fix = (f"{source}.yaml chooses one (`override /{group}`): keep that preset's algorithm, or set its other choices "
           f"without experiment={source.partition('/')[2]}" if source and source.startswith("experiment/")
           else f"remove the override {group}=..., or choose an algorithm that lists one")
    why = ": a pairwise algorithm such as online_dpo compares pairs and reads no rollout correction" if group == "algorithm/rollout_correction" else ""
    raise ConfigError(f"{group}: {which} has no {group.partition('/')[2]} part to choose ({where} lists none{why}); {fix}")


def raise_if_not_the_parts(overrides: list[str], err: Exception, config_name: str) -> None:
    """ConfigError for an override (without `+`) of a key the chosen part's node does not hold: composed without it,
    the node plus that key is read as `rlhf.parts.choose` reads it, whose message names the parts that declare it."""
    key = _failed_key(err)
    path = _part_node(key or "")
    values = [o.partition("=")[2] for o in overrides if o.partition("=")[0] == key]
    if path is None or not values:  # not a key of a part's node, or set by a YAML file rather than the command line
        return
    rest = [o for o in overrides if o.partition("=")[0] != key]
    node = OmegaConf.to_container(OmegaConf.select(compose_config(rest, config_name), path))
    part = choose(GROUPS[PATHS[path]], node | {key[len(path) + 1:]: values[0]}, path)
    group = PATHS[path]
    if not any(o.partition("=")[0] == f"{path}.name" for o in overrides):
        return  # the chosen part declares the key, but its node (a YAML file of yours) does not hold it: Hydra's `+` advice
    if part.name not in registry.node_names(GROUPS[group]):  # a part of your own, by import path: its node is the one renamed
        raise ConfigError(
            f"{key}: {path}.name={part.name} names a part of your own, whose node holds only the keys written; add this "
            f"one with +{key}={values[0]} (its config class types it, and fills the keys left out with their defaults)"
        )
    raise ConfigError(  # the part declares the key, but its node came from another part's choice: renamed, not chosen
        f"{key}: {path} holds the keys of the part its group chose, and {path}.name={part.name} renames that node "
        f"without bringing {part.name}'s keys; choose the part with {group}={part.name} (then {key}={values[0]})"
    )


def raise_if_not_a_key(overrides: list[str], err: Exception, config_name: str) -> None:
    """ConfigError for an override (without `+`) of a key the schema does not declare (`checkpoint.evry=5`): the
    closest key, instead of Hydra's advice to add it with `+`, which the unknown-key check would then refuse."""
    failed = _failed_key(err)
    schema = RewardTrainConfig if config_name == "train_reward" else RunConfig
    keys = [o.partition("=")[0] for o in overrides]
    key = next((k for k in keys if failed and (k == failed or k.startswith(failed + "."))), None)  # trainer.x fails at trainer
    if key is None or not _undeclared(key, schema):
        return  # a declared key whose value failed (a wrong type): Hydra's message names it
    raise ConfigError(describe_unknown(key, schema)) from None


def _undeclared(key: str, schema: type) -> bool:
    """Whether ``key`` is one ``schema`` does not declare, outside a part's node of the run's config (the part's own
    config says what it holds) and Hydra's own `hydra.*`."""
    in_part = schema is RunConfig and _part_node(key) is not None
    return not key.startswith("hydra.") and not in_part and key not in declared_keys(schema)


def _part_node(key: str) -> str | None:
    """The part node (dotted path) that ``key`` sits in, if any: `generator` for `generator.enable_sleep`."""
    path, _, leaf = key.rpartition(".")
    return path if path in PATHS and leaf else None


def _may_lack(key: str) -> bool:
    """Whether ``key`` sits in a part's node and some registered part of that node lacks it (so the chosen one may)."""
    path = _part_node(key)
    return path is not None and not declared_by_every(GROUPS[PATHS[path]], key.rpartition(".")[2])


def _failed_key(err: Exception) -> str | None:
    """The key a composition failed on: Hydra's "not in struct" names it as `full_key` on the exception it wraps."""
    return getattr(err.__cause__, "full_key", None) or getattr(err.__context__, "full_key", None)


def raise_if_moved(err: Exception) -> None:
    """ConfigError naming the new place of a moved key that a YAML file still sets."""
    key = _failed_key(err)
    moved = moved_to(key) if key else None
    if moved is not None:
        raise ConfigError(f"{key} moved to {moved[0]} ({moved[1]}); {err}".splitlines()[0]) from None
