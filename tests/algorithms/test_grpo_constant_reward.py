"""End to end: GRPO with a reward that is the same for every sample has no signal, so the weights must not move
(with beta=0 nothing else is in the loss). Before all-equal groups got exactly 0, a constant 0.7 moved them ~3e-3."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from rlhf.config import compose_config
from rlhf.models.loading import resolve_model_path
from rlhf.train import train


def test_a_constant_reward_leaves_the_weights_unchanged(tmp_path, monkeypatch):
    (tmp_path / "constant_reward.py").write_text("def seven_tenths(prompts, responses, ground_truths, **_):\n    return [0.7] * len(responses)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = compose_config([
        "algorithm.beta=0", "train.num_steps=3", "reward.functions=[{name: constant_reward.seven_tenths}]",
        "reward.non_stop_penalty=false", "eval.num_samples=0", "eval.greedy=false", "logging.tensorboard=false",
    ])
    train(cfg, tmp_path / "run")
    start = load_file(f"{resolve_model_path('builtin:tiny_arith')}/model.safetensors")
    end = load_file(str(tmp_path / "run" / "final_model" / "model.safetensors"))
    assert start.keys() == end.keys()
    assert all(torch.equal(start[k], end[k]) for k in start)
