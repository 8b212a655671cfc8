"""Reward-model training from the CLI, and PPO / online DPO against the trained reward model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForSequenceClassification

from test_cli import run_cli, scalars

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained_reward_model(tmp_path_factory) -> tuple[Path, Path]:
    """(run folder, reward model folder) of one `python -m rlhf.train_reward` run, shared by the tests here."""
    root = tmp_path_factory.mktemp("reward")
    run_dir = root / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf.train_reward", f"hydra.run.dir={run_dir}", "seed=2"],
        cwd=root, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir, run_dir / "reward_model"


def test_reward_model_reaches_clearly_above_chance_accuracy(trained_reward_model):
    run_dir, model_dir = trained_reward_model
    accuracy = dict(scalars(run_dir)["eval/accuracy"])
    last = accuracy[max(accuracy)]
    assert last >= 0.85, f"held-out preference accuracy {accuracy}"


def test_saved_reward_model_is_a_plain_hugging_face_folder(trained_reward_model):
    _, model_dir = trained_reward_model
    model = AutoModelForSequenceClassification.from_pretrained(model_dir)
    assert model.config.num_labels == 1
    assert (model_dir / "tokenizer.json").is_file() and (model_dir / "model.safetensors").is_file()


@pytest.mark.parametrize("algorithm", ["ppo", "online_dpo"])
def test_training_against_the_reward_model_raises_its_score(algorithm, trained_reward_model, tmp_path):
    """PPO (critic initialised from the reward model) and online DPO push up the reward model's own score."""
    _, model_dir = trained_reward_model
    out = tmp_path / "run"
    run_cli(
        f"algorithm={algorithm}", "reward=model", f"reward.path={model_dir}",
        "train.num_steps=80", "eval.every=0", "seed=3", f"hydra.run.dir={out}", cwd=tmp_path,
    )
    series = scalars(out)
    model_score = dict(series["eval/sampled_reward_model"])
    assert model_score[80] > model_score[0] + 1.0, f"reward model score {model_score}"
    train_score = [v for _, v in series["reward/model"]]
    assert sum(train_score[-10:]) / 10 > sum(train_score[:10]) / 10 + 0.5


def test_reward_model_with_another_vocabulary_is_rejected_before_loading(tmp_path):
    """A reward model whose tokenizer differs from the policy's fails fast, naming reward.path."""
    from rlhf.models.tiny import build_char_tokenizer, build_tiny_llama

    from transformers import LlamaForSequenceClassification

    folder = tmp_path / "other"
    tokenizer = build_char_tokenizer("abcdefghij")
    config = build_tiny_llama(len(tokenizer)).config
    config.num_labels = 1
    LlamaForSequenceClassification(config).save_pretrained(folder)  # a reward model's kind, another vocabulary
    tokenizer.save_pretrained(folder)
    proc = run_cli("reward=model", f"reward.path={folder}", "train.num_steps=1", cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert "reward.path: vocabulary mismatch" in proc.stdout + proc.stderr
