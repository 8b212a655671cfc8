"""The per-step parity figures between the generator's and the trainer's logprobs (`checks/logprob_gap_*`)."""

from __future__ import annotations

import pytest
import torch

from rlhf.step.learner import sample_train_gap


def test_gap_mean_and_max_over_action_tokens_only():
    gen = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]])
    train = torch.tensor([[-1.1, -2.0, -2.0], [-0.5, -0.2, -0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # the 9.0 gap is padding
    figures = sample_train_gap(gen, train, mask)
    assert figures["checks/logprob_gap_mean"] == pytest.approx((0.1 + 0.0 + 1.0 + 0.0 + 0.3) / 5)
    assert figures["checks/logprob_gap_max"] == pytest.approx(1.0)
