"""Multi-turn environments through the real CLI: GEM's GuessTheNumber, and the built-in task's preset learning.

(In-process runs under every schedule, resume and an agent file: tests/envs/test_env_schedules.py.)"""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest
import torch
from run_records import records
from test_cli import run_cli

from rlhf.models.tiny import build_char_tokenizer, build_tiny_llama

pytestmark = pytest.mark.slow

QUIET = ["logging.tensorboard=false", "checkpoint.save_final_model=false"]


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


def test_the_multiturn_preset_learns(tmp_path):
    """`experiment=multiturn_tiny`, shortened to 25 steps: success rises clearly, retries included."""
    out = tmp_path / "run"
    run_cli("experiment=multiturn_tiny", "train.num_steps=25", "eval.every=0", f"hydra.run.dir={out}", cwd=tmp_path)
    steps = records(out)
    start, end = steps[0], steps[25]
    assert start["eval/greedy_num_turns_per_episode"] > 1.5, "the warm start is mostly wrong: most episodes retry"
    assert end["eval/greedy_success_rate"] - start["eval/greedy_success_rate"] >= 0.3, (start, end)
    assert end["eval/sampled_success_rate"] - start["eval/sampled_success_rate"] >= 0.25, (start, end)
    assert end["eval/sampled_later_turn_success_rate"] > start["eval/sampled_later_turn_success_rate"] + 0.1, (start, end)
    assert any("[user] " in g["response"] and "(reward 0.55)" in g["response"] for g in generations(out)), \
        "some retry was right and earned the retry reward"
