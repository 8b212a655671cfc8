"""Multi-turn environments through the real CLI: GEM, a seed-003-shaped agent file, and the built-in task under the
other schedules, backends and generators, and across a resume."""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest
import torch
from test_cli import run_cli

from rlhf.models.tiny import build_char_tokenizer, build_tiny_llama

pytestmark = pytest.mark.slow

QUIET = ["logging.tensorboard=false", "checkpoint.save_final_model=false"]

AGENT = '''
async def step(state, action, label, turn=0, **kw):
    """Right answer: reward 1 and done; wrong: the question again, one retry."""
    right = action == label
    question = state[: state.index("=") + 1]
    return float(right), state + action + question, right or turn >= 1, {"success": right}
'''


def records(run_dir: Path) -> dict[int, dict]:
    by_step: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step.setdefault(record["step"], {}).update(record)
    return by_step


def generations(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "eval_generations.jsonl").read_text().splitlines()]


def test_gem_guess_the_number_runs_end_to_end(tmp_path):
    """A tiny random character model plays GEM's GuessTheNumber for two GRPO steps; transcripts are written."""
    alphabet = string.ascii_letters + string.digits + string.punctuation + " \n"
    model = tmp_path / "ascii_model"
    tokenizer = build_char_tokenizer(alphabet)
    torch.manual_seed(0)
    build_tiny_llama(len(tokenizer), max_positions=1024).save_pretrained(model)
    tokenizer.save_pretrained(model)
    out = tmp_path / "run"
    run_cli(
        "env=gem", "env.template=no", "env.max_tokens=600", "env.eval_size=4", f"model.name_or_path={model}",
        "train.num_steps=2", "train.prompts_per_step=4", "algorithm.num_samples_per_prompt=2", "generator.max_new_tokens=12",
        "eval.num_samples=0", *QUIET, f"hydra.run.dir={out}", cwd=tmp_path,
    )
    steps = records(out)
    assert all(steps[s]["env/num_episodes"] == 8 and -0.1 <= steps[s]["env/episode_return"] <= 1.0 for s in (1, 2))
    assert "eval/greedy_success_rate" in steps[2]
    evals = generations(out)
    assert len(evals) == 2 * 4 and all(r["response"].startswith("[assistant]") for r in evals)
    assert all("GuessTheNumber" in r["prompt"] or "guess" in r["prompt"].lower() for r in evals)


def test_agent_function_file_runs_end_to_end(tmp_path):
    """`env=agent_func` with a seed-003-shaped step function and a JSONL of tasks: two turns per wrong first answer."""
    agent = tmp_path / "my_agent.py"
    agent.write_text(AGENT)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "label": str(a + b)}) + "\n" for a in range(5) for b in range(5)))
    out = tmp_path / "run"
    run_cli(
        "env=agent_func", f"env.path={agent}", "dataset=jsonl", f"dataset.path={tasks}", "dataset.ground_truth_key=label",
        "dataset.chat_template='{{ messages[0].content }}'", "train.num_steps=3", "train.prompts_per_step=8",
        "eval.max_prompts=8", *QUIET, f"hydra.run.dir={out}", cwd=tmp_path,
    )
    steps = records(out)
    for s in (1, 2, 3):
        assert 1.0 <= steps[s]["env/num_turns_per_episode"] <= 2.0 and steps[s]["env/failed_episodes"] == 0
        assert steps[s]["env/success_rate"] == pytest.approx(steps[s]["env/episode_return"])  # reward 1 exactly on success
    assert any("[user]" in r["response"] for r in generations(out))  # a retry after a wrong first answer
