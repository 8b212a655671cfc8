"""Masked reductions: only entries with mask == 1 may influence the result."""

import pytest
import torch
from torch.testing import assert_close

from rlhf.functional import masked_mean, masked_sum, masked_var, masked_whiten

BIG = 1e6  # planted in masked positions: if it leaks into a result, the result is off by ~1e6

# Row 0: padding at the end; row 1: short sequence; row 2: fully masked.
VALUES = torch.tensor(
    [
        [1.0, 2.0, 3.0, BIG],
        [4.0, 5.0, BIG, BIG],
        [BIG, BIG, BIG, BIG],
    ]
)
MASK = torch.tensor(
    [
        [1.0, 1.0, 1.0, 0.0],
        [1.0, 1.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, 0.0],
    ]
)


def test_masked_sum_total_and_per_row():
    """Sums only valid entries; a fully masked row sums to 0."""
    assert_close(masked_sum(VALUES, MASK), torch.tensor(15.0))  # 1+2+3+4+5
    assert_close(masked_sum(VALUES, MASK, dim=1), torch.tensor([6.0, 9.0, 0.0]))  # 1+2+3, 4+5, nothing


def test_masked_mean_total_and_per_row():
    """Mean over valid entries; a fully masked row gives 0 instead of NaN."""
    assert_close(masked_mean(VALUES, MASK), torch.tensor(3.0))  # 15 / 5 valid
    assert_close(masked_mean(VALUES, MASK, dim=1), torch.tensor([2.0, 4.5, 0.0]))  # 6/3, 9/2, 0/max(0,1)


def test_masked_mean_short_row_between_long_rows():
    """A short sequence in the middle of the batch counts only its valid tokens."""
    values = torch.tensor([[1.0, 2.0, 3.0], [10.0, BIG, BIG], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    assert_close(masked_sum(values, mask), torch.tensor(31.0))  # 6 + 10 + 15
    assert_close(masked_mean(values, mask), torch.tensor(31.0 / 7.0))  # 7 valid tokens
    assert_close(masked_mean(values, mask, dim=1), torch.tensor([2.0, 10.0, 5.0]))


def test_masked_mean_of_fully_masked_tensor_is_zero():
    """Nothing valid at all: mean is 0, not NaN."""
    assert_close(masked_mean(VALUES, torch.zeros_like(MASK)), torch.tensor(0.0))


def test_bool_mask_gives_same_results_as_float_mask():
    """A boolean mask behaves like its 0/1 float version."""
    assert_close(masked_mean(VALUES, MASK.bool()), torch.tensor(3.0))
    assert_close(masked_sum(VALUES, MASK.bool(), dim=1), torch.tensor([6.0, 9.0, 0.0]))


def test_masked_var_biased_and_unbiased():
    """Valid entries 1..5: mean 3, squared deviations 4+1+0+1+4 = 10 -> 10/5 biased, 10/4 unbiased."""
    assert_close(masked_var(VALUES, MASK, unbiased=False), torch.tensor(2.0))
    assert_close(masked_var(VALUES, MASK), torch.tensor(2.5))


def test_masked_var_unbiased_needs_two_entries():
    """One valid entry has no unbiased variance (error); its biased variance is 0."""
    values = torch.tensor([[7.0, BIG]])
    mask = torch.tensor([[1.0, 0.0]])
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(values, mask)
    assert_close(masked_var(values, mask, unbiased=False), torch.tensor(0.0))


def test_masked_whiten_values():
    """Valid 1..5: (x - 3) / sqrt(2.5) = [-2, -1, 0, 1, 2] / 1.5811388; masked entries are exactly 0."""
    out = masked_whiten(VALUES, MASK)
    expected = torch.tensor(
        [
            [-1.2649111, -0.6324555, 0.0, 0.0],
            [0.6324555, 1.2649111, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0],
        ]
    )
    assert_close(out, expected, atol=1e-5, rtol=0)
    assert torch.all(out[MASK == 0] == 0)


def test_masked_whiten_without_shift_keeps_the_mean():
    """shift_mean=False: scaled deviations plus the mean 3 -> 3 + [-1.2649111, ..., 1.2649111]."""
    out = masked_whiten(VALUES, MASK, shift_mean=False)
    expected = torch.tensor(
        [
            [1.7350889, 2.3675445, 3.0, 0.0],
            [3.6324555, 4.2649111, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0],
        ]
    )
    assert_close(out, expected, atol=1e-5, rtol=0)


def test_masked_whiten_constant_values_give_zeros():
    """All valid entries equal: variance 0, the eps keeps it finite and the result is 0."""
    values = torch.tensor([[2.0, 2.0, BIG], [2.0, BIG, BIG]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    out = masked_whiten(values, mask)
    assert torch.isfinite(out).all()
    assert_close(out, torch.zeros(2, 3))


def test_masked_values_never_affect_results():
    """Replacing every masked entry (+1e6 -> -1e6) leaves all reductions unchanged."""
    other = torch.where(MASK.bool(), VALUES, torch.full_like(VALUES, -BIG))
    assert_close(masked_sum(VALUES, MASK), masked_sum(other, MASK))
    assert_close(masked_mean(VALUES, MASK, dim=1), masked_mean(other, MASK, dim=1))
    assert_close(masked_var(VALUES, MASK), masked_var(other, MASK))
    assert_close(masked_whiten(VALUES, MASK), masked_whiten(other, MASK))
