"""PPO clipped surrogate and the micro-batch-exact loss reduction."""

import math

import pytest
import torch
from torch.testing import assert_close

from rlhf.functional import aggregate_loss, clipped_policy_loss, loss_denominator

BIG = 1e6


def _log(ratios):
    """logp giving these ratios against old_logp = 0."""
    return torch.tensor([[math.log(r) for r in ratios]])


def test_positive_advantage_clips_only_above_range():
    """A = +1, eps = 0.2 (range [0.8, 1.2]):
    r=1.1 inside -> -1.1;  r=1.5 above -> max(-1.5, -1.2) = -1.2 (clipped);
    r=0.5 below -> max(-0.5, -0.8) = -0.5 (not clipped: the unclipped branch is larger).
    """
    logp = _log([1.1, 1.5, 0.5])
    loss, clipped, log_ratio = clipped_policy_loss(logp, torch.zeros(1, 3), torch.ones(1, 3), 0.2, 0.2)
    assert_close(loss, torch.tensor([[-1.1, -1.2, -0.5]]))
    assert clipped.tolist() == [[False, True, False]]
    assert_close(log_ratio, logp)


def test_negative_advantage_clips_only_below_range():
    """A = -1, eps = 0.2:
    r=1.1 inside -> 1.1;  r=1.5 above -> max(1.5, 1.2) = 1.5 (not clipped);
    r=0.5 below -> max(0.5, 0.8) = 0.8 (clipped).
    """
    loss, clipped, _ = clipped_policy_loss(_log([1.1, 1.5, 0.5]), torch.zeros(1, 3), -torch.ones(1, 3), 0.2, 0.2)
    assert_close(loss, torch.tensor([[1.1, 1.5, 0.8]]))
    assert clipped.tolist() == [[False, False, True]]


def test_advantage_scales_the_loss_and_zero_advantage_gives_zero():
    """A = 2, r = 1.5: max(-3.0, -2.4) = -2.4 (clipped); A = 0: loss 0 and never 'clipped'."""
    loss, clipped, _ = clipped_policy_loss(_log([1.5, 1.5]), torch.zeros(1, 2), torch.tensor([[2.0, 0.0]]), 0.2, 0.2)
    assert_close(loss, torch.tensor([[-2.4, 0.0]]))
    assert clipped.tolist() == [[True, False]]


def test_ratio_uses_old_logp():
    """r = exp(logp - old_logp): logp = -1 + ln 1.5, old = -1 -> r = 1.5, A = 1 -> -1.2, log_ratio ln 1.5."""
    logp = torch.tensor([[-1.0 + math.log(1.5)]])
    loss, clipped, log_ratio = clipped_policy_loss(logp, torch.tensor([[-1.0]]), torch.ones(1, 1), 0.2, 0.2)
    assert_close(loss, torch.tensor([[-1.2]]))
    assert clipped.item()
    assert_close(log_ratio, torch.tensor([[0.4054651]]))


def test_asymmetric_clip_range():
    """eps_low = 0.1, eps_high = 0.3 (range [0.9, 1.3]):
    A=+1 r=1.25 inside (would be clipped at 1.2 with eps 0.2) -> -1.25;  A=+1 r=1.5 -> -1.3 (clipped);
    A=-1 r=0.85 below 0.9 (inside with eps 0.2) -> max(0.85, 0.9) = 0.9 (clipped);  A=-1 r=0.95 -> 0.95.
    """
    logp = _log([1.25, 1.5, 0.85, 0.95])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, clipped, _ = clipped_policy_loss(logp, torch.zeros(1, 4), adv, 0.1, 0.3)
    assert_close(loss, torch.tensor([[-1.25, -1.3, 0.9, 0.95]]))
    assert clipped.tolist() == [[False, True, True, False]]


def test_gradient_is_zero_exactly_where_clipped():
    """d loss / d logp = -A * r on unclipped tokens, 0 on clipped ones (eps 0.2):
    A=+1: r=1.1 -> -1.1, r=1.5 -> 0, r=0.5 -> -0.5;  A=-1: r=1.1 -> 1.1, r=1.5 -> 1.5, r=0.5 -> 0.
    """
    logp = _log([1.1, 1.5, 0.5, 1.1, 1.5, 0.5]).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, 1.0, -1.0, -1.0, -1.0]])
    loss, clipped, _ = clipped_policy_loss(logp, torch.zeros(1, 6), adv, 0.2, 0.2)
    loss.sum().backward()
    assert_close(logp.grad, torch.tensor([[-1.1, 0.0, -0.5, 1.1, 1.5, 0.0]]))
    assert torch.all(logp.grad[clipped] == 0)
    assert torch.all(logp.grad[~clipped] != 0)


# Row 0: padding at the end; row 1: a short sequence between longer ones; row 3: fully masked.
LOSS = torch.tensor(
    [
        [1.0, 2.0, 3.0, BIG],
        [4.0, BIG, BIG, BIG],
        [5.0, 7.0, BIG, BIG],
        [BIG, BIG, BIG, BIG],
    ]
)
MASK = torch.tensor(
    [
        [1.0, 1.0, 1.0, 0.0],
        [1.0, 0.0, 0.0, 0.0],
        [1.0, 1.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, 0.0],
    ]
)


def test_loss_denominator_values():
    """token_mean: 3 + 1 + 2 + 0 = 6 valid tokens; seq_mean_token_mean: 4 sequences (rows)."""
    assert_close(loss_denominator(MASK, "token_mean").float(), torch.tensor(6.0))
    assert_close(loss_denominator(MASK, "seq_mean_token_mean"), torch.tensor(4.0))


def test_loss_denominator_of_empty_mask_is_one():
    """No valid token: the token count is clamped to 1 so the loss is 0, not NaN."""
    mask = torch.zeros(2, 3)
    denom = loss_denominator(mask, "token_mean")
    assert denom.item() == 1
    assert aggregate_loss(torch.full((2, 3), BIG), mask, "token_mean", denom).item() == 0.0


def test_aggregate_token_mean():
    """(1 + 2 + 3 + 4 + 5 + 7) / 6 = 22 / 6; the 1e6 padding is ignored."""
    out = aggregate_loss(LOSS, MASK, "token_mean", loss_denominator(MASK, "token_mean"))
    assert_close(out, torch.tensor(22.0 / 6.0))


def test_aggregate_seq_mean_token_mean():
    """Per-sequence means 6/3 = 2, 4/1 = 4, 12/2 = 6, empty row 0 -> (2 + 4 + 6 + 0) / 4 = 3.

    The fully masked row counts as a sequence with loss 0.
    """
    out = aggregate_loss(LOSS, MASK, "seq_mean_token_mean", loss_denominator(MASK, "seq_mean_token_mean"))
    assert_close(out, torch.tensor(3.0))


def test_seq_mean_token_mean_weighs_sequences_equally():
    """Without the empty row: (2 + 4 + 6) / 3 = 4, whereas token_mean gives 22 / 6 = 3.667."""
    loss, mask = LOSS[:3], MASK[:3]
    out = aggregate_loss(loss, mask, "seq_mean_token_mean", loss_denominator(mask, "seq_mean_token_mean"))
    assert_close(out, torch.tensor(4.0))


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token_mean", 22.0 / 6.0),  # micro 1: (6 + 4) / 6, micro 2: (12 + 0) / 6
        ("seq_mean_token_mean", 3.0),  # micro 1: (2 + 4) / 4, micro 2: (6 + 0) / 4
    ],
)
def test_micro_batches_sum_to_the_mini_batch_loss(mode, expected):
    """Each micro batch uses the mini batch's denominator; their sum equals the whole-batch loss."""
    denom = loss_denominator(MASK, mode)
    whole = aggregate_loss(LOSS, MASK, mode, denom)
    for splits in ([2, 2], [1, 2, 1], [1, 1, 1, 1]):
        parts = [aggregate_loss(l, m, mode, denom) for l, m in zip(LOSS.split(splits), MASK.split(splits))]
        assert_close(sum(parts), whole)
    assert_close(whole, torch.tensor(expected))


def test_micro_batch_gradients_accumulate_to_the_mini_batch_gradient():
    """Backward on each micro batch's share accumulates exactly the whole mini batch's gradient.

    token_mean: each valid token gets d/dloss = 1/6, padding 0.
    """
    denom = loss_denominator(MASK, "token_mean")
    values = LOSS.clone().requires_grad_(True)
    for l, m in zip(values.split([1, 2, 1]), MASK.split([1, 2, 1])):
        aggregate_loss(l, m, "token_mean", denom).backward()
    assert_close(values.grad, MASK / 6.0)


def test_per_micro_batch_denominators_would_be_wrong():
    """Why the denominator comes from the mini batch: micro means 10/4 and 12/2 average to 4.25, not 22/6."""
    parts = [
        aggregate_loss(l, m, "token_mean", loss_denominator(m, "token_mean"))
        for l, m in zip(LOSS.split(2), MASK.split(2))
    ]
    assert_close(sum(parts) / 2, torch.tensor(4.25))


def test_unknown_aggregation_mode_is_an_error():
    """Both functions reject a mode they do not know, naming it."""
    with pytest.raises(ValueError, match="token_max"):
        loss_denominator(MASK, "token_max")
    with pytest.raises(ValueError, match="token_max"):
        aggregate_loss(LOSS, MASK, "token_max", torch.tensor(1.0))
