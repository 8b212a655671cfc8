"""Rollout corrections on hand-computed values: sequence-level TIS, IcePop's masked IS, geometric-mean rejection."""

import math

import torch
from torch.testing import assert_close

from rlhf.functional import geometric_rejection_weights, masked_is_weights, sequence_truncated_is_weights

# Token ratios r = pi_trainer / pi_generator. Row 0: [2, 0.25, 3] (product 1.5, geometric mean 1.5^(1/3));
# row 1: [1.2, padding with a huge log-ratio that must not leak]; row 2: [4, 4] (product 16, geometric mean 4).
RATIOS = [[2.0, 0.25, 3.0], [1.2, math.exp(80.0), 1.0], [4.0, 4.0, 1.0]]
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
GENERATOR = torch.full((3, 3), -2.0)
TRAINER = GENERATOR + torch.log(torch.tensor(RATIOS))


def test_sequence_tis_weighs_every_token_by_the_capped_ratio_product():
    """Cap 2: row 0 product 1.5 (kept), row 1 1.2, row 2 16 -> 2 (flagged)."""
    weights, flagged = sequence_truncated_is_weights(TRAINER, GENERATOR, MASK, 2.0)
    assert_close(weights, torch.tensor([[1.5, 1.5, 1.5], [1.2, 0.0, 0.0], [2.0, 2.0, 0.0]]))
    assert flagged.tolist() == [[False] * 3, [False] * 3, [True, True, False]]


def test_sequence_tis_survives_a_product_too_large_for_float32():
    """1000 tokens of ratio e: the product e^1000 overflows, the capped weight is exactly the cap."""
    trainer, generator = torch.ones(1, 1000), torch.zeros(1, 1000)
    weights, _ = sequence_truncated_is_weights(trainer, generator, torch.ones(1, 1000), 5.0)
    assert torch.isfinite(weights).all() and torch.allclose(weights, torch.full((1, 1000), 5.0))


def test_icepop_keeps_ratios_inside_the_band_as_weights_and_zeroes_the_rest():
    """Band [0.5, 2]: row 0 keeps 2 (edge), drops 0.25 and 3; row 1 keeps 1.2; row 2 drops both 4s."""
    weights, flagged = masked_is_weights(TRAINER, GENERATOR, MASK, 0.5, 2.0)
    assert_close(weights, torch.tensor([[2.0, 0.0, 0.0], [1.2, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    assert flagged.tolist() == [[False, True, True], [False, False, False], [True, True, False]]


def test_geometric_rejection_drops_whole_rows_outside_the_band():
    """Band [0.5, 2]: geometric means 1.145, 1.2, 4 -> rows 0 and 1 weigh 1, row 2 is rejected."""
    weights, flagged = geometric_rejection_weights(TRAINER, GENERATOR, MASK, 0.5, 2.0)
    assert_close(weights, torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    assert flagged.tolist() == [[False] * 3, [False] * 3, [True, True, False]]


def test_corrections_carry_no_gradient():
    trainer = TRAINER.clone().requires_grad_(True)
    for fn, args in ((sequence_truncated_is_weights, (2.0,)), (masked_is_weights, (0.5, 2.0)), (geometric_rejection_weights, (0.5, 2.0))):
        assert not fn(trainer, GENERATOR, MASK, *args)[0].requires_grad
