"""The config reference, written from the code: every key of the run's schema (`rlhf.config.schema.RunConfig`) and of
every registered part's config class, with its default and the one-line comment beside its declaration.

    python -m rlhf.config.reference > docs/config.md     # tests/docs checks that the page is up to date
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import tokenize
from functools import cache
from pathlib import Path

from omegaconf import MISSING

from rlhf import registry
from rlhf.config.schema import RewardTrainConfig, RunConfig
from rlhf.parts import GROUPS, PartConfig, config_class

INTRO = """# Config reference

Every key `python -m rlhf.train` reads, with its default and its meaning, written from the config classes by
`python -m rlhf.config.reference > docs/config.md` (a test checks that this page is up to date). Override any key on
the command line (`train.lr=3e-4`); choose a part with its group (`generator=vllm`, `algorithm/policy_loss=gspo`):
a part's node holds only the keys of the part chosen. `python -m rlhf.train --cfg job <overrides>` prints the
composed config of a run.
"""


@cache
def comments(path: str) -> dict[tuple[str, str], str]:
    """(class name, field name) -> the comment on the field's line, for every class in the source file ``path``."""
    source = Path(path).read_text()
    by_line = {t.start[0]: t.string.lstrip("# ").strip()
               for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT}
    found = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    found[(node.name, item.target.id)] = by_line.get(item.lineno, "")
    return found


def comment(cls: type, name: str) -> str:
    """The comment of field ``name`` where it is declared (the first class of ``cls``'s MRO that declares it)."""
    for base in cls.__mro__:
        if name in getattr(base, "__annotations__", {}):
            return comments(inspect.getsourcefile(base)).get((base.__name__, name), "")
    return ""


def default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return ""
    if value is MISSING or value == "???":
        return "(set by conf/)"
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


HEADER = ["| key | default | meaning |", "|---|---|---|"]


def nested(field: dataclasses.Field) -> type | None:
    """The dataclass a field holds as a node of its own (`policy.lora`), or None for a plain key."""
    if field.default_factory is dataclasses.MISSING:
        return None
    value = field.default_factory()
    return type(value) if dataclasses.is_dataclass(value) else None


def rows(cls: type, prefix: str, keys: list[dataclasses.Field] | None = None) -> list[str]:
    """A table row per key of the dataclass ``cls`` (or of its fields ``keys``) under ``prefix``; nested dataclasses
    as dotted keys."""
    out = []
    for field in dataclasses.fields(cls) if keys is None else keys:
        key = f"{prefix}{field.name}"
        inner = nested(field)
        if inner is not None:
            out += rows(inner, f"{key}.")
            continue
        out.append(f"| `{key}` | `{default(field)}` | {comment(cls, field.name).replace('|', '/')} |")
    return out


def table(cls: type, prefix: str) -> list[str]:
    return [*HEADER, *rows(cls, prefix), ""]


def reference() -> str:
    """The whole page."""
    lines = [INTRO, "## The run's keys", ""]
    for field in dataclasses.fields(RunConfig):
        if (inner := nested(field)) is not None:
            lines += [f"### `{field.name}`", "", comment(RunConfig, field.name), "", *table(inner, f"{field.name}.")]
    top = [f for f in dataclasses.fields(RunConfig) if f.default_factory is dataclasses.MISSING and f.default is not MISSING]
    lines += ["### Top-level keys", "", *HEADER, *rows(RunConfig, "", top), ""]
    lines += ["## The parts' keys", "", "Each group's choices; the node holds the keys of the one chosen (`name` selects it).", ""]
    for group, kind in GROUPS.items():
        node = group.replace("/", ".")
        for name in registry.node_names(kind):
            cls = config_class(registry.resolve(kind, name), node, name) or PartConfig
            lines += [f"### `{group}={name}`", "", *table(cls, f"{node}.")]
    lines += ["## `python -m rlhf.train_reward`", "", "Training a reward model on preference pairs (conf/train_reward.yaml).", "",
              *table(RewardTrainConfig, "")]
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    from rlhf.config.compose import register_schema

    register_schema()  # imports every registered part
    print(reference(), end="")
