"""REINFORCE++ returns and batch whitening, and ReMax's greedy baseline, on hand-computed values."""

import math

import pytest
import torch
from torch.testing import assert_close

from rlhf.functional import discounted_returns, greedy_baseline_advantages, reinforce_pp_advantages

# Row 0: three tokens; row 1: a token, a hole (an observation), a token, then padding.
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 1.0, 0.0]])
REWARDS = torch.tensor([[-0.1, -0.2, 1.0, 9.0], [-0.5, 9.0, 2.0, 9.0]])


def test_returns_sum_the_rewards_ahead_and_skip_holes():
    """gamma 1: row 0 [0.7, 0.8, 1.0, 0]; row 1 skips the hole's 9: [1.5, 0, 2.0, 0]."""
    assert_close(discounted_returns(REWARDS, MASK, 1.0), torch.tensor([[0.7, 0.8, 1.0, 0.0], [1.5, 0.0, 2.0, 0.0]]))


def test_returns_discount_per_valid_token():
    """gamma 0.5: row 0 [-0.1 + 0.5 * (-0.2 + 0.5 * 1), ...] = [0.05, 0.3, 1.0]; row 1 [-0.5 + 0.5 * 2, 0, 2]."""
    assert_close(discounted_returns(REWARDS, MASK, 0.5), torch.tensor([[0.05, 0.3, 1.0, 0.0], [0.5, 0.0, 2.0, 0.0]]))


def test_reinforce_pp_whitens_returns_over_every_valid_token():
    """Valid returns [0.7, 0.8, 1.0, 1.5, 2.0]: mean 1.2, unbiased var 1.18 / 4 = 0.295; advantages (G - 1.2) / sqrt(0.295)."""
    adv = reinforce_pp_advantages(REWARDS, MASK, 1.0)
    scale = math.sqrt(0.295 + 1e-8)
    expected = torch.tensor([[-0.5, -0.4, -0.2, 0.0], [0.3, 0.0, 0.8, 0.0]]) / scale
    assert_close(adv, expected)
    assert adv[MASK.bool()].mean().item() == pytest.approx(0.0, abs=1e-6)


def test_remax_subtracts_the_greedy_score_of_the_prompt():
    """Two prompts x 2 samples: rewards [1, 0, 0.5, 0.5], greedy [1, 1, 0, 0] -> [0, -1, 0.5, 0.5]."""
    adv = greedy_baseline_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), torch.tensor([1.0, 1.0, 0.0, 0.0]))
    assert_close(adv, torch.tensor([0.0, -1.0, 0.5, 0.5]))


def test_remax_refuses_misaligned_baselines():
    with pytest.raises(ValueError, match="one entry per row"):
        greedy_baseline_advantages(torch.zeros(4), torch.zeros(2))
