"""Truncated importance weights for the generator/trainer gap, on hand-computed values."""

import math

import torch
from torch.testing import assert_close

from rlhf.functional import truncated_is_weights

# Row 0: ratios e^0.5, e^-1 and a masked token whose huge log-ratio must not leak; row 1: e^2 (clipped at 2), e^0.
TRAINER = torch.tensor([[-1.0, -2.0, 50.0], [0.0, -0.5, 0.0]])
GENERATOR = torch.tensor([[-1.5, -1.0, -50.0], [-2.0, -0.5, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])


def test_weights_are_truncated_token_ratios_and_zero_where_masked():
    weights, clipped = truncated_is_weights(TRAINER, GENERATOR, MASK, clip=2.0)
    assert_close(weights, torch.tensor([[math.exp(0.5), math.exp(-1.0), 0.0], [2.0, 1.0, 0.0]]))
    assert clipped.tolist() == [[False, False, False], [True, False, False]]


def test_equal_distributions_give_weight_one_on_every_real_token():
    logp = torch.tensor([[-0.3, -2.0], [-1.0, -4.0]])
    weights, clipped = truncated_is_weights(logp, logp.clone(), torch.tensor([[1.0, 1.0], [1.0, 0.0]]), clip=1.5)
    assert_close(weights, torch.tensor([[1.0, 1.0], [1.0, 0.0]]))
    assert not clipped.any()


def test_weights_carry_no_gradient():
    trainer = TRAINER.clone().requires_grad_(True)
    weights, _ = truncated_is_weights(trainer, GENERATOR, MASK, clip=2.0)
    assert not weights.requires_grad
