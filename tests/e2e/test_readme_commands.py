"""The README's "Using it" commands run as written on the default model (each for one step here), or say what they
need: a GPU, a hub model, a server, a login (the comment after the command names it)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
NEEDS = ("GPU", "hub model", "needs your server", "W&B login")  # what a command's comment says it needs
SHORT = ["train.num_steps=1", "eval.every=0", "eval.max_prompts=2", "eval.num_samples=1", "logging.tensorboard=false"]


def block_commands(heading: str) -> list[tuple[str, str]]:
    """(command, comment) of each line running `python -m rlhf.*` in the README's first bash block after
    ``## <heading>``."""
    block = re.search(rf"## {re.escape(heading)}\n+```bash\n(.*?)```", README.read_text(), re.S).group(1)
    found = []
    for line in block.splitlines():
        command, _, comment = line.partition("  # ")
        if "python -m rlhf." in command:
            found.append((command.strip(), comment.strip()))
    return found


def using_it_commands() -> list[tuple[str, str]]:
    """(command, comment) of each `python -m rlhf.*` line of the README's "Using it" block."""
    return block_commands("Using it")


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


def your_model_commands() -> list[str]:
    """The `python -m rlhf.*` lines of the README's "Your model, your data, one GPU" block, comments dropped."""
    return [command for command, _ in block_commands("Your model, your data, one GPU")]


@pytest.mark.slow
def test_the_your_model_block_plans_and_trains_with_the_files_it_describes(tmp_path):
    """The block as written, with the files its comment describes (prompts.jsonl with prompt and answer, my_reward.py
    with `score`), on this machine: the hub model becomes the built-in one (CPU, float32, its plain-text template and
    64-token context), and the run is cut to two steps."""
    commands = your_model_commands()
    assert [c.split(" -m ")[1].split()[0] for c in commands] == ["rlhf.plan", "rlhf.train"]
    (tmp_path / "prompts.jsonl").write_text("".join(f'{{"prompt": "{a}+{b}=", "answer": "{a + b}"}}\n' for a in range(5) for b in range(5)))
    (tmp_path / "my_reward.py").write_text(
        "def score(prompts, responses, ground_truths, **_):\n"
        "    return [float(r.strip() == str(t)) for r, t in zip(responses, ground_truths)]\n"
    )
    here = {"model.name_or_path": "builtin:tiny_arith", "model.dtype": "float32", "cluster.device": "cpu"}
    local = ["dataset.chat_template=simple_concat_with_space", "dataset.max_prompt_length=16"]
    for command in commands:
        words = shlex.split(command)
        module = words[words.index("-m") + 1]
        args = [f"{a.split('=')[0]}={here[a.split('=')[0]]}" if a.split("=")[0] in here else a for a in words[words.index("-m") + 2:]]
        if module == "rlhf.train":
            args += ["train.num_steps=2", "eval.every=0", "eval.max_prompts=2", f"hydra.run.dir={tmp_path / 'run'}"]
        done = subprocess.run([sys.executable, "-m", module, *args, *local], cwd=tmp_path, capture_output=True, text=True,
                              timeout=900, env={**os.environ, "PYTHONPATH": str(tmp_path)})
        assert done.returncode == 0, f"{command}\n{(done.stdout + done.stderr)[-3000:]}"
    assert (tmp_path / "run" / "metrics.jsonl").exists()
