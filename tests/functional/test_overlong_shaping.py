"""DAPO's overlong reward shaping on hand-computed values, and where `RewardSet` applies it."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from rlhf.config.schema import RewardConfig, RewardFunctionConfig
from rlhf.functional import overlong_penalty
from rlhf.rewards.combine import RewardSet
from rlhf.trajectory import from_completions


def test_free_up_to_the_buffer_then_linear_down_to_minus_factor():
    """max_len 10, buffer 4: free up to 6 tokens, then -1/4 per token, -1 at 10."""
    lengths = torch.tensor([0, 5, 6, 7, 8, 9, 10])
    expected = torch.tensor([0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0])
    assert torch.allclose(overlong_penalty(lengths, max_len=10, buffer_len=4), expected)


def test_factor_scales_the_penalty_and_float_lengths_work():
    lengths = torch.tensor([6.0, 8.0, 10.0])  # a loss mask's row sums are floats
    assert torch.allclose(overlong_penalty(lengths, 10, 4, factor=2.0), torch.tensor([0.0, -1.0, -2.0]))
    assert torch.equal(overlong_penalty(lengths, 10, 4, factor=0.0).abs(), torch.zeros(3))


def test_buffer_of_one_penalises_only_the_full_budget():
    assert torch.allclose(overlong_penalty(torch.tensor([7, 8]), 8, 1, 0.5), torch.tensor([0.0, -0.5]))


def test_whole_budget_as_buffer_falls_from_zero_length():
    assert torch.allclose(overlong_penalty(torch.tensor([0, 2, 4]), 4, 4), torch.tensor([0.0, -0.5, -1.0]))


@pytest.mark.parametrize("buffer_len", [0, 11])
def test_buffer_outside_the_budget_is_an_error(buffer_len):
    with pytest.raises(ValueError, match=f"buffer_len={buffer_len}"):
        overlong_penalty(torch.tensor([3]), 10, buffer_len)


def rows(lengths: list[int], stopped: list[bool], width: int = 8):
    """Single-turn rows with responses of the given lengths (a 1-token prompt)."""
    n = len(lengths)
    response_mask = (torch.arange(width) < torch.tensor(lengths).unsqueeze(1)).long()
    return from_completions(
        torch.ones(n, 1, dtype=torch.long), torch.ones(n, 1, dtype=torch.long), torch.ones(n, width, dtype=torch.long),
        response_mask, torch.zeros(n, width), torch.tensor(stopped),
    )


def rewards(**options) -> RewardSet:
    cfg = OmegaConf.structured(RewardConfig(functions=[RewardFunctionConfig(name="overlong_test_rewards.one")], **options))
    return RewardSet(cfg, max_new_tokens=8)


@pytest.fixture
def overlong_test_rewards(tmp_path, monkeypatch):
    (tmp_path / "overlong_test_rewards.py").write_text("def one(prompts, responses, ground_truths, **_):\n    return [1.0] * len(responses)\n")
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize("training", [True, False])
def test_reward_set_adds_the_shaping_in_training_and_evaluation(overlong_test_rewards, training):
    """Budget 8, buffer 4: lengths 3, 4, 6, 8 (all stopped) get 0, 0, -0.5, -1 on top of the function's 1."""
    batch = rows([3, 4, 6, 8], [True] * 4)
    scores, metrics = rewards(overlong_buffer_len=4).score(["p"] * 4, ["r"] * 4, [None] * 4, batch, training=training)
    assert torch.allclose(scores, torch.tensor([1.0, 1.0, 0.5, 0.0]))
    assert metrics["reward/overlong_penalty"] == pytest.approx(-0.375)


def test_non_stop_penalty_still_replaces_the_whole_score(overlong_test_rewards):
    batch = rows([6, 8], [True, False])
    scores, _ = rewards(overlong_buffer_len=4, overlong_penalty_factor=2.0, penalty_reward_value=-3.0).score(
        ["p"] * 2, ["r"] * 2, [None] * 2, batch
    )
    assert torch.allclose(scores, torch.tensor([0.0, -3.0]))


def test_off_by_default_adds_nothing_and_logs_nothing(overlong_test_rewards):
    scores, metrics = rewards().score(["p"] * 2, ["r"] * 2, [None] * 2, rows([3, 8], [True, True]))
    assert torch.equal(scores, torch.ones(2)) and "reward/overlong_penalty" not in metrics
