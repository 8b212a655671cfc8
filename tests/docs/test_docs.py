"""The documentation cannot rot: every `python -m rlhf.train | train_reward | plan` command in the Markdown files
composes (a renamed or moved key fails here), every relative link resolves, every Python block compiles."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from run_records import records

from rlhf.config import compose_config
from rlhf.rewards.rules import arith_correct
from rlhf.run.sweep import check_sweep_values, first_job

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted({ROOT / "README.md", *ROOT.glob("*.md"), *(ROOT / "docs").rglob("*.md"), ROOT / "bench" / "README.md"})
CONFIGS = {"rlhf.train": "config", "rlhf.plan": "config", "rlhf.train_reward": "train_reward"}
FLAGS = {"--multirun", "-m", "--cfg", "job", "--info"}  # Hydra's own arguments, not overrides


def blocks(page: Path, language: str) -> list[tuple[int, str]]:
    """(line number, text) of each fenced block of ``language`` in ``page``."""
    text = page.read_text()
    return [(text[: m.start()].count("\n") + 2, m.group(1)) for m in re.finditer(rf"```{language}\n(.*?)```", text, re.S)]


def commands() -> list[tuple[str, str]]:
    """(where, command) of every `python -m rlhf.<train|train_reward|plan>` in a bash block: continuation lines
    joined, the comment after it dropped, what runs before it (`&&`) dropped, placeholders such as `<a path>`
    replaced by a word."""
    found = []
    for page in PAGES:
        for start, block in blocks(page, "bash"):
            for offset, line in enumerate(block.replace("\\\n", " ").splitlines()):
                line = line.partition("  # ")[0]
                match = re.search(r"python -m (rlhf\.(?:train_reward|train|plan))\b(.*)", line)
                if match:
                    command = f"{match.group(1)}{re.sub(r'<[^>]*>', 'PLACEHOLDER', match.group(2))}"
                    found.append((f"{page.relative_to(ROOT)}:{start + offset}", command))
    return found


COMMANDS = commands()


def test_the_pages_hold_the_commands_a_reader_copies():
    assert len(COMMANDS) >= 40, COMMANDS
    assert {c.split()[0] for _, c in COMMANDS} == set(CONFIGS)


def own_files(page: Path, line: int, folder: Path) -> None:
    """Write the files the blocks just above ``line`` of ``page`` hold (a block whose first line is a comment naming
    a path: ``# my_losses.py, ...`` or ``# myconf/algorithm/...yaml``) into ``folder``, as a reader would."""
    for start, block in [*blocks(page, "python"), *blocks(page, "yaml")]:
        name = re.match(r"# ([\w./]+\.(?:py|yaml))", block)
        if name and 0 < line - start < 40:
            (folder / name.group(1)).parent.mkdir(parents=True, exist_ok=True)
            (folder / name.group(1)).write_text(block)


def words(command: str) -> list[str]:
    """The shell words of ``command`` up to the first `;`, `&&`, `||` or `|` (what runs after it is another command)."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    out = []
    for word in lexer:
        if word in (";", "&&", "||", "|", "&"):
            break
        out.append(word)
    return out


@pytest.mark.parametrize("where, command", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_every_documented_command_composes(where, command, tmp_path, monkeypatch):
    module, *args = words(command)
    overrides = [a for a in args if a not in FLAGS and not a.startswith("hydra.")]
    if any(a.startswith("hydra.searchpath=") for a in args):  # the reader's own files: the blocks above it
        page, line = where.split(":")
        own_files(ROOT / page, int(line), tmp_path)
        monkeypatch.syspath_prepend(str(tmp_path))
        overrides.append(f"hydra.searchpath=[file://{tmp_path / 'myconf'}]")
    if "--multirun" in args or "-m" in args:
        check_sweep_values(["--multirun", *overrides])  # every swept value composes
        overrides = first_job(overrides)  # then the first job's values
    compose_config(overrides, config_name=CONFIGS[module])


def run_as_written(marker: str, tmp_path: Path, *cut: str, evaluate: bool = False) -> tuple[str, dict]:
    """docs/extending.md's command holding ``marker`` run as written on the tiny model: the blocks above it written
    where the reader would put them, run from that folder with PYTHONPATH=. (a `hydra.searchpath` pointed at the
    reader's `myconf` there), cut by ``cut`` (e.g. fewer steps), with no evaluation unless ``evaluate`` (then at the
    start and the end only). Fails the test unless it exits 0; (its output, its records by step)."""
    ((where, command),) = [(w, c) for w, c in COMMANDS if w.startswith("docs/extending.md") and marker in c]
    page, line = where.split(":")
    own_files(ROOT / page, int(line), tmp_path)
    module, *args = words(command)
    args = [f"hydra.searchpath=[file://{tmp_path / 'myconf'}]" if a.startswith("hydra.searchpath=") else a for a in args]
    no_eval = () if evaluate else ("eval.num_samples=0", "eval.greedy=false")
    cut = (*cut, "eval.every=0", *no_eval, "logging.tensorboard=false", f"hydra.run.dir={tmp_path / 'run'}")
    done = subprocess.run([sys.executable, "-m", module, *args, *cut], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": "."})
    assert done.returncode == 0, f"{command}\n{(done.stdout + done.stderr)[-3000:]}"
    return done.stdout + done.stderr, records(tmp_path / "run")


@pytest.mark.slow
def test_the_reward_function_of_your_own_trains_as_written(tmp_path):
    """docs/extending.md's reward function named by import path, with args, cut to two steps: the function's mean
    score is logged under its name."""
    _, steps = run_as_written("prefers_short", tmp_path, "train.num_steps=2")
    assert all(0 <= steps[s]["reward/my_rewards.prefers_short"] <= 1 for s in (1, 2))


@pytest.mark.slow
def test_the_environment_of_your_own_trains_as_written(tmp_path):
    """docs/extending.md's environment named by import path, cut to two steps: its episodes played and scored, and
    the memory plan covering it."""
    output, steps = run_as_written("env.name=", tmp_path, "train.num_steps=2")
    assert "memory plan skipped" not in output
    assert all(steps[s]["env/num_episodes"] > 0 and 0 <= steps[s]["env/episode_return"] <= 1 for s in (1, 2))


@pytest.mark.slow
def test_the_schedule_of_your_own_trains_as_written(tmp_path):
    """docs/extending.md's schedule named by import path, with a key of its own: the generator gets new weights only
    every `push_every` steps (a push logs its size)."""
    _, steps = run_as_written("schedule.name=", tmp_path)
    assert [s for s in (1, 2, 3, 4) if "perf/weight_sync_mb" in steps[s]] == [2, 4]


@pytest.mark.slow
def test_the_pairwise_loss_of_your_own_trains_as_written(tmp_path):
    """docs/extending.md's pairwise loss named by import path (its config node in the reader's `myconf`), cut to two
    steps. At the first step the policy is its reference, so each pair's hinge loss is the margin, 1 (DPO's would be
    log 2)."""
    output, steps = run_as_written("hinge", tmp_path, "train.num_steps=2")
    assert "pre-update logprobs: a forward of their own before training" in output
    assert steps[1]["val/valid_pairs"] > 0, "the test needs a pair whose two responses scored differently"
    assert steps[1]["objective/loss"] == pytest.approx(1.0, abs=1e-4)
    assert all(math.isfinite(steps[s]["objective/loss"]) for s in (1, 2))


@pytest.mark.slow
def test_the_generator_of_your_own_trains_as_written(tmp_path):
    """docs/extending.md's generator named by import path, with a key of its own: the memory plan covers it, and the
    rows it wrote for each training step (a call of 32 prompts x 4 samples) are the ones scored, their share of right
    answers the step's `reward/arith_correct`."""
    output, steps = run_as_written("generator.name=", tmp_path, "eval.max_prompts=4", evaluate=True)
    assert "memory plan skipped" not in output
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert {row["greedy"] for row in rows} == {False, True}, "evaluation samples through it too"
    trained = [row for row in rows if row["rows"] == 128 and not row["greedy"]]
    assert len(trained) == 2 * 128
    for step in (1, 2):
        batch = trained[(step - 1) * 128 : step * 128]
        truths = [str(sum(int(n) for n in re.findall(r"\d+", row["prompt"]))) for row in batch]
        right = arith_correct([row["prompt"] for row in batch], [row["response"] for row in batch], truths)
        assert sum(right) / len(right) == pytest.approx(steps[step]["reward/arith_correct"], abs=1e-6)


@pytest.mark.slow
def test_the_agent_of_your_own_trains_as_written(tmp_path):
    """docs/extending.md's agent file under env=openai_agent, cut to two steps of 4 problems (x 8 episodes): each
    episode asks once and returns +1 or -1, so the mean return is 2 x the success rate - 1."""
    _, steps = run_as_written("env.path=my_agent.py", tmp_path, "train.prompts_per_step=4")
    for step in (1, 2):
        assert steps[step]["env/num_episodes"] == 4 * 8 and steps[step]["env/failed_episodes"] == 0
        assert steps[step]["env/num_turns_per_episode"] == 1
        assert steps[step]["env/episode_return"] == pytest.approx(2 * steps[step]["env/success_rate"] - 1, abs=1e-6)


def links() -> list[tuple[str, str, Path]]:
    """(where, target, resolved path) of every relative Markdown link (no scheme, no pure anchor)."""
    found = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            found.append((str(page.relative_to(ROOT)), target, (page.parent / target.split("#")[0]).resolve()))
    return found


def test_every_relative_link_resolves():
    broken = [f"{where}: ({target})" for where, target, path in links() if not path.exists()]
    assert not broken, broken


def test_every_python_block_compiles():
    for page in PAGES:
        for start, block in blocks(page, "python"):
            compile(block, f"{page.relative_to(ROOT)}:{start}", "exec")


def test_the_config_reference_is_up_to_date():
    """docs/config.md is what `python -m rlhf.config.reference` writes from the config classes today: a key added,
    renamed or re-commented without regenerating it fails here."""
    from rlhf.config.compose import register_schema
    from rlhf.config.reference import reference

    register_schema()
    page = (ROOT / "docs" / "config.md").read_text()
    assert page == reference(), "docs/config.md is stale: run python -m rlhf.config.reference > docs/config.md"
    assert "| `generator.decode` | `auto` |" in page and "| `train.lr` |" in page and "### `algorithm/policy_loss=gspo`" in page


def test_the_metrics_reference_is_up_to_date():
    from rlhf.tracking.metric_docs import page

    assert (ROOT / "docs" / "metrics.md").read_text() == page(), "docs/metrics.md is stale: run python -m rlhf.tracking.metric_docs > docs/metrics.md"
