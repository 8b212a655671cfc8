"""Every metric name the code spells is on the metrics page (`rlhf/tracking/metric_docs.py`), and the page lists
nothing the code never logs. (The golden-curve runs check the names the algorithm presets log at run time; this
scan also covers the schedules', environments' and evaluation's.)"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from rlhf.parts import GROUPS
from rlhf.tracking.metric_docs import METRICS, STAGES, documented

SRC = Path(__file__).resolve().parents[2] / "src" / "rlhf"
NAMESPACES = ("objective", "loss", "policy", "critic", "val", "logps", "reward", "dynamic_sampling", "rollout_corr",
              "checks", "env", "eval", "async", "memory", "perf", "time", "train", "distill")
NAME = re.compile(rf"({'|'.join(NAMESPACES)})/[A-Za-z0-9_]+")
NOT_METRICS = {"train/loss", "train/accuracy", "eval/loss", "eval/accuracy", "eval/margin"}  # train_reward's own log
CONFIG_GROUPS = set(GROUPS) | {f"<x>/{group.rpartition('/')[2]}" for group in GROUPS}  # `policy/strategy=...`: not metrics


def spelled_names() -> tuple[set[str], set[str]]:
    """(metric names in string literals, metric names built by f-strings with each field as ``<x>``) in the source."""
    names, built = set(), set()
    for path in SRC.rglob("*.py"):
        if path.name == "metric_docs.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value):
                names.add(node.value)
            elif isinstance(node, ast.JoinedStr):
                text = "".join(v.value if isinstance(v, ast.Constant) else "<x>" for v in node.values)
                if re.fullmatch(r"(<x>|[a-z_]+)/[A-Za-z0-9_<>]+", text) and text.split("/")[0] in (*NAMESPACES, "<x>"):
                    built.add(text)
    return names - NOT_METRICS - CONFIG_GROUPS, built - CONFIG_GROUPS


def fits(built: str) -> bool:
    """Whether some listed name has the shape of the f-string ``built`` (each field one word, a placeholder too)."""
    word = "[A-Za-z0-9_<>]+"
    shape = re.compile("".join(word if part == "<x>" else re.escape(part) for part in re.split("(<x>)", built)))
    return any(shape.fullmatch(name) for name in METRICS)


def test_every_metric_name_in_the_source_is_documented():
    names, built = spelled_names()
    assert len(names) >= 60 and len(built) >= 5, (sorted(names), sorted(built))
    missing = sorted(n for n in names if not documented(n)) + sorted(b for b in built if not fits(b))
    assert not missing, f"add these to rlhf/tracking/metric_docs.py and regenerate docs/metrics.md: {missing}"


def test_the_page_lists_only_what_the_code_logs():
    """Each exact name on the page is spelled somewhere in the source; each `time/<stage>` stage is timed somewhere."""
    source = "\n".join(p.read_text() for p in SRC.rglob("*.py") if p.name != "metric_docs.py")
    for name in METRICS:
        if "<" not in name:
            assert f'"{name}"' in source or f'/{name.split("/")[-1]}"' in source, name  # spelled, or built as f"{role}/..."
    for stage in STAGES:
        assert f'"{stage}"' in source or f'"time/{stage}"' in source, stage


def test_a_placeholder_matches_one_part_of_a_name():
    assert documented("reward/arith_correct") and documented("eval/greedy_success_rate")
    assert documented("time/generation") and not documented("time/anything_else")
    assert not documented("objective/made_up") and not documented("reward/a/b")
