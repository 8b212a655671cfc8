"""The README's "Using it" commands run as written on the default model (each for one step here), or say what they
need: a GPU, a hub model, a server, a login (the comment after the command names it)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
NEEDS = ("GPU", "hub model", "needs your server", "W&B login")  # what a command's comment says it needs
SHORT = ["train.num_steps=1", "eval.every=0", "eval.max_prompts=2", "eval.num_samples=1", "logging.tensorboard=false"]


def using_it_commands() -> list[tuple[str, str]]:
    """(command, comment) of each `python -m rlhf.*` line of the README's first block after "## Using it"."""
    text = README.read_text()
    block = re.search(r"## Using it\n+```bash\n(.*?)```", text, re.S).group(1)
    found = []
    for line in block.splitlines():
        command, _, comment = line.partition("  # ")
        if command.startswith("python -m rlhf."):
            found.append((command.strip(), comment.strip()))
    return found


COMMANDS = using_it_commands()


def test_the_block_is_found_and_says_what_each_command_it_cannot_run_needs():
    assert len(COMMANDS) >= 10
    for command, comment in COMMANDS:
        if "experiment=" in command and "_tiny" not in command and "rlhf.plan" not in command:
            assert any(need in comment for need in NEEDS), f"{command!r} says nothing of what it needs: {comment!r}"


@pytest.mark.slow
@pytest.mark.parametrize("command", [c for c, note in COMMANDS if not any(need in note for need in NEEDS)])
def test_each_readme_command_runs_as_written_on_the_default_model(command, tmp_path):
    args = shlex.split(command)[3:]  # after `python -m rlhf.<module>`
    module = shlex.split(command)[2]
    if module == "rlhf.train" and "--cfg" not in args:
        where = f"hydra.sweep.dir={tmp_path / 'multirun'}" if "--multirun" in args else f"hydra.run.dir={tmp_path / 'run'}"
        args = [*args, *SHORT, where]
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{command}\n{(done.stdout + done.stderr)[-3000:]}"
