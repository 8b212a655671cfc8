"""The README's "Using it" commands run as written on the default model (each for one step here), or say what they
need: a GPU, a hub model, a server, a login (the comment after the command names it)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
# what a command's comment says it needs; "the model's wheel": the real model's presets, whose runs
# tests/e2e/test_real_model.py and test_code_reward_run.py make (shortened) instead
NEEDS = ("GPU", "hub model", "needs your server", "W&B login", "the model's wheel")
SHORT = ["train.num_steps=1", "eval.every=0", "eval.max_prompts=2", "eval.num_samples=1", "logging.tensorboard=false"]


def block_commands(heading: str) -> list[tuple[str, str]]:
    """(command, comment) of each line running `python -m rlhf.*` in the README's first bash block after
    ``## <heading>``."""
    block = re.search(rf"## {re.escape(heading)}\n[^#]*?```bash\n(.*?)```", README.read_text(), re.S).group(1)
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
    """The `python -m rlhf.*` lines of the README's "Your model, your data" block, comments dropped."""
    return [command for command, _ in block_commands("Your model, your data")]


@pytest.mark.slow
def test_the_your_model_block_plans_and_trains_the_real_model_with_the_files_it_describes(tmp_path):
    """The block exactly as written, with the files its comment describes (prompts.jsonl with prompt and answer,
    my_reward.py with `score`), on this CPU with the real chat model it names. The plan runs exactly as written; the
    training run is cut to two steps of 2 prompts x 8 samples (the block's 4 prompts are the plan's to check) and
    a greedy eval only (the sampled one is a second generate call of the same length)."""
    commands = your_model_commands()
    assert [c.split(" -m ")[1].split()[0] for c in commands] == ["rlhf.plan", "rlhf.train"]
    assert all("model=smollm2_135m_instruct" in c for c in commands)
    (tmp_path / "prompts.jsonl").write_text("".join(
        f'{{"prompt": "What is {a} + {b}? Reply with just the number.", "answer": "{a + b}"}}\n'
        for a in range(10, 15) for b in range(20, 25)))
    (tmp_path / "my_reward.py").write_text(
        "def score(prompts, responses, ground_truths, **_):\n"
        "    return [float(str(t) in r) for r, t in zip(responses, ground_truths)]\n"
    )
    for command in commands:
        words = shlex.split(command)
        module, args = words[words.index("-m") + 1], words[words.index("-m") + 2:]
        if module == "rlhf.train":
            args += ["train.num_steps=2", "train.prompts_per_step=2", "eval.every=0", "eval.max_prompts=2",
                     "eval.num_samples=0", f"hydra.run.dir={tmp_path / 'run'}"]
        done = subprocess.run([sys.executable, "-m", module, *args], cwd=tmp_path, capture_output=True, text=True,
                              timeout=1500, env={**os.environ, "PYTHONPATH": str(tmp_path)})
        assert done.returncode == 0, f"{command}\n{(done.stdout + done.stderr)[-3000:]}"
        assert "tiny-task settings" not in done.stdout + done.stderr
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "time/step" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["val/sequence_lengths"] > 1 and r["val/generator_logprob_diff"] < 1e-4 for r in steps)
    assert all(r["policy/grad_norm"] > 0 for r in steps)  # real updates
    assert 0 < records[0]["eval/greedy_sequence_lengths"] <= 32
    config = (tmp_path / "run" / "final_model" / "config.json").read_text()  # a plain Hugging Face model, not GGUF's
    assert "quantization_config" not in config and '"vocab_size": 49152' in config


def test_a_tiny_preset_with_another_model_warns_naming_the_values_it_keeps():
    from rlhf.config.compose import compose_config
    from rlhf.config.tiny import tiny_settings_warning

    cfg = compose_config(["model.name_or_path=Qwen/Qwen2.5-0.5B-Instruct"])
    warning = tiny_settings_warning(cfg, "tiny_arith")
    assert "generator.max_new_tokens=4" in warning and "train.lr=0.001" in warning and "model=custom" in warning
    assert tiny_settings_warning(compose_config([]), "tiny_arith") is None
    real = compose_config(["model=custom", "model.name_or_path=Qwen/Qwen2.5-0.5B-Instruct"])
    assert tiny_settings_warning(real, "custom") is None
    assert (real.generator.max_new_tokens, real.train.lr, real.eval.max_prompts) == (256, 1e-6, 256)
