"""Refuse config keys the schema does not declare.

Hydra's `+key=value` adds a key even to a structured config, so `+train.num_stepz=5` would compose, be read by
nothing, and train 100 steps. Free-form fields (`dict[str, Any]`, e.g. `reward.functions[i].args`) take any key.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from typing import Any, Iterator

from omegaconf import DictConfig, OmegaConf

from rlhf.config.moved import moved_to
from rlhf.config.schema import RunConfig
from rlhf.parts import PATHS
from rlhf.errors import ConfigError


PEER_NAMES = {  # a key's name in TRL, OpenRLHF or verl (its last part) -> this project's key
    "output_dir": "hydra.run.dir",
    "save_path": "hydra.run.dir",
    "learning_rate": "train.lr",
    "actor_learning_rate": "train.lr",
    "critic_learning_rate": "critic.lr",
    "max_steps": "train.num_steps",
    "total_training_steps": "train.num_steps",
    "num_episodes": "train.num_steps",
    "num_generations": "algorithm.num_samples_per_prompt",
    "n_samples_per_prompt": "algorithm.num_samples_per_prompt",
    "rollout_n": "algorithm.num_samples_per_prompt",
    "kl_coef": "algorithm.beta",
    "init_kl_coef": "algorithm.beta",
    "max_completion_length": "generator.max_new_tokens",
    "generate_max_len": "generator.max_new_tokens",
    "response_length": "generator.max_new_tokens",
    "prompt_max_len": "dataset.max_prompt_length",
    "prompt_length": "dataset.max_prompt_length",
    "model_name_or_path": "model.name_or_path",
    "pretrain": "model.name_or_path",
    "per_device_train_batch_size": "train.micro_batch_size",
    "micro_train_batch_size": "train.micro_batch_size",
    "save_steps": "checkpoint.every",
    "eval_steps": "eval.every",
    "logging_steps": "logging.log_every",
}


def check_unknown_keys(cfg: DictConfig, schema: type = RunConfig) -> None:
    """Raise ConfigError naming every key of ``cfg`` that ``schema`` (a dataclass) does not declare."""
    tree = OmegaConf.to_container(cfg, resolve=False)  # plain containers: no interpolation or `???` is evaluated
    unknown = list(_unknown_paths(tree, schema, ""))
    if unknown:
        known = list(declared_keys(schema))
        raise ConfigError("; ".join(_describe(path, known) for path in unknown))


def describe_unknown(path: str, schema: type = RunConfig) -> str:
    """What to say of ``path``, a key ``schema`` does not declare, set on the command line without `+`: where it
    moved, or the closest key."""
    return _describe(path, list(declared_keys(schema)), added=False)


@functools.lru_cache(maxsize=4)
def declared_keys(schema: type = RunConfig) -> tuple[str, ...]:
    """Every dotted key ``schema`` declares, in declaration order (list items as `[0]`)."""
    return tuple(_schema_paths(schema, ""))


def _unknown_paths(node: Any, schema: Any, prefix: str) -> Iterator[str]:
    """Dotted paths under ``node`` that ``schema`` (a type annotation) does not declare."""
    schema = _without_optional(schema)
    if dataclasses.is_dataclass(schema) and isinstance(node, dict):
        fields = typing.get_type_hints(schema)
        for key, value in node.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            if key not in fields:
                yield from _leaves(value, path)
            else:
                yield from _unknown_paths(value, fields[key], path)
    elif typing.get_origin(schema) is list and isinstance(node, list):
        (item_type,) = typing.get_args(schema) or (Any,)
        for i, item in enumerate(node):
            yield from _unknown_paths(item, item_type, f"{prefix}[{i}]")
    # anything else (dict[str, Any], scalars) is free-form or a leaf: nothing below it to check


def _schema_paths(schema: Any, prefix: str) -> Iterator[str]:
    """Every dotted key ``schema`` declares (list items as `[0]`), for suggestions."""
    schema = _without_optional(schema)
    if dataclasses.is_dataclass(schema):
        for key, hint in typing.get_type_hints(schema).items():
            path = f"{prefix}.{key}" if prefix else key
            yield path
            yield from _schema_paths(hint, path)
    elif typing.get_origin(schema) is list:
        (item_type,) = typing.get_args(schema) or (Any,)
        yield from _schema_paths(item_type, f"{prefix}[0]")


def _leaves(node: Any, path: str) -> Iterator[str]:
    """``path``, or the dotted paths of the values under it when ``node`` is a mapping (`+trainer.lr=1` names
    `trainer.lr`, the key a user typed, not `trainer`)."""
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from _leaves(value, f"{path}.{key}")
    else:
        yield path


def _without_optional(hint: Any) -> Any:
    """``X`` for ``Optional[X]``; other hints unchanged."""
    if typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else hint
    return hint


def _describe(path: str, known: list[str], added: bool = True) -> str:
    """"<path> is not a config key (added with +?); did you mean <closest>?" (or where its siblings are listed);
    ``added``: the key reached the config (with `+`), rather than failing to override it."""
    moved = moved_to(path)
    if moved is not None:
        return f"{path} moved to {moved[0]} ({moved[1]})"
    text = f"{path} is not a config key" + (" (added with +?)" if added else "")
    peer = _peer_key(path, known)
    if peer is not None:
        return f"{text}; this project calls it {peer}" + (" (the run's folder: checkpoints, logs, TensorBoard)" if peer == "hydra.run.dir" else "")
    suggestion = _closest(path, known)
    return f"{text}; did you mean {suggestion}?" if suggestion else f"{text}; remove it (see `--cfg job` for the keys)"


def _peer_key(path: str, known: list[str]) -> str | None:
    """Our key for ``path`` when its last name is a peer library's (`PEER_NAMES`): the same name in ``path``'s own
    section first (`critic.learning_rate` -> `critic.lr`), else the table's key, if the schema or a part's node (which
    the schema leaves to the part) holds it."""
    parent, _, leaf = path.rpartition(".")
    peer = PEER_NAMES.get(leaf)
    if peer is None:
        return None
    own = f"{parent}.{peer.rpartition('.')[2]}"
    if parent and own in known:
        return own
    return peer if peer in known or peer.startswith("hydra.") or peer.rpartition(".")[0] in PATHS else None


def _closest(path: str, known: list[str]) -> str | None:
    """The schema key most like ``path`` (`trian.num_steps` -> `train.num_steps`), else the section above it most like
    its own (`reward.functions[0].argz.x` -> `reward.functions[0].args`)."""
    head, rest, section = path, "", None
    while head and head not in known:  # a known section holds no key like it: nothing to put right above it
        match = _closest_key(head, known, anywhere=not rest)  # a section above the key: only a sibling of its name
        if match is not None and (not rest or match + rest in known):
            return match + rest
        section = section or match
        head, _, leaf = head.rpartition(".")
        rest = f".{leaf}{rest}"
    return section


def _closest_key(path: str, known: list[str], anywhere: bool = True) -> str | None:
    """The schema key most like ``path``: a sibling with a similar name, else (``anywhere``) any key with a similar
    last name."""
    parent, _, leaf = path.rpartition(".")
    template = _as_template(parent)
    siblings = {k.rpartition(".")[2]: k for k in known if k.rpartition(".")[0] == template}
    match = difflib.get_close_matches(leaf, list(siblings), n=1)
    if match:
        return f"{parent}.{match[0]}" if parent else match[0]
    if not anywhere:
        return None
    by_leaf = {k.rpartition(".")[2]: k for k in known if "[" not in k}
    match = difflib.get_close_matches(leaf, list(by_leaf), n=1)
    return by_leaf[match[0]] if match else None


def _as_template(parent: str) -> str:
    """``parent`` with every list index written `[0]`, as `_schema_paths` lists them."""
    parts = parent.split("[")
    return "[".join([parts[0]] + ["0" + p[p.index("]"):] for p in parts[1:]])
