"""Loss variants: value loss, dual-clip, clip-higher, loss aggregations, KL estimators and controllers, DPO."""

import math

import pytest
import torch
from torch.testing import assert_close

from rlhf.functional import (
    LOSS_AGGREGATIONS,
    AdaptiveKLController,
    FixedKLController,
    aggregate_loss,
    clipped_policy_loss,
    clipped_value_loss,
    dpo_loss,
    kl_per_token,
    loss_denominator,
)

NAN = float("nan")
INF = float("inf")


def _log(ratios):
    """logp giving these ratios against old_logp = 0, one row."""
    return torch.tensor([[math.log(r) for r in ratios]])


# --- clipped_value_loss -------------------------------------------------------------------------------

# eps = 0.2; five tokens (V, V_old, R):
#   (1.0, 0.5, 2.0): V_c = 0.5 + 0.2 = 0.7; (1 - 2)^2 = 1 < (0.7 - 2)^2 = 1.69 -> 0.845, clipped
#   (1.0, 0.5, 0.0): V_c = 0.7;             (1 - 0)^2 = 1 > (0.7 - 0)^2 = 0.49 -> 0.5
#   (0.6, 0.5, 2.0): inside the range, V_c = V; (0.6 - 2)^2 = 1.96 -> 0.98
#   (0.0, 0.5, 1.0): V_c = 0.5 - 0.2 = 0.3; (0 - 1)^2 = 1 > (0.3 - 1)^2 = 0.49 -> 0.5
#   (0.0, 0.5, -1.0): V_c = 0.3;            (0 + 1)^2 = 1 < (0.3 + 1)^2 = 1.69 -> 0.845, clipped
V = torch.tensor([[1.0, 1.0, 0.6, 0.0, 0.0]])
V_OLD = torch.tensor([[0.5, 0.5, 0.5, 0.5, 0.5]])
RETURNS = torch.tensor([[2.0, 0.0, 2.0, 1.0, -1.0]])


def test_clipped_value_loss_values_and_flags():
    """0.5 * max((V - R)^2, (V_clipped - R)^2), flagged where the clipped branch was larger."""
    loss, clipped = clipped_value_loss(V, V_OLD, RETURNS, 0.2)
    assert_close(loss, torch.tensor([[0.845, 0.5, 0.98, 0.5, 0.845]]))
    assert clipped.tolist() == [[True, False, False, False, True]]


def test_value_loss_without_clipping_is_half_squared_error():
    """clip_eps None: 0.5 * (V - R)^2 = 0.5 * [1, 1, 1.96, 1, 1]; nothing flagged."""
    loss, clipped = clipped_value_loss(V, V_OLD, RETURNS, None)
    assert_close(loss, torch.tensor([[0.5, 0.5, 0.98, 0.5, 0.5]]))
    assert clipped.dtype == torch.bool and not clipped.any()


def test_value_loss_gradient_is_zero_where_clipped():
    """d/dV = V - R on unclipped tokens: [0, 1, -1.4, -1, 0] (the clipped tokens get none)."""
    values = V.clone().requires_grad_(True)
    loss, clipped = clipped_value_loss(values, V_OLD, RETURNS, 0.2)
    loss.sum().backward()
    assert_close(values.grad, torch.tensor([[0.0, 1.0, -1.4, -1.0, 0.0]]))
    assert torch.all(values.grad[clipped] == 0)


def test_wide_value_clip_range_equals_unclipped():
    """A clip range wider than every |V - V_old| gives the plain squared error."""
    assert_close(clipped_value_loss(V, V_OLD, RETURNS, 10.0)[0], clipped_value_loss(V, V_OLD, RETURNS, None)[0])


# --- dual-clip and clip-higher ------------------------------------------------------------------------


def test_dual_clip_caps_negative_advantages_with_large_ratio():
    """Dual-clip (c = 3) caps the loss of negative-advantage tokens at -c * A, flagging them clipped."""
    # c = 3, eps 0.2. A=-1: r=5 -> max(5, 1.2) = 5 capped at 3 (flagged); r=2 -> 2 < 3 unchanged;
    # r=0.5 -> max(0.5, 0.8) = 0.8 (ordinary clip). A=-2, r=4: max(8, 2.4) = 8 capped at 6.
    logp = _log([5.0, 2.0, 0.5, 4.0])
    adv = torch.tensor([[-1.0, -1.0, -1.0, -2.0]])
    loss, clipped, _ = clipped_policy_loss(logp, torch.zeros(1, 4), adv, 0.2, 0.2, dual_clip_c=3.0)
    assert_close(loss, torch.tensor([[3.0, 2.0, 0.8, 6.0]]))
    assert clipped.tolist() == [[True, False, True, True]]
    plain, plain_clipped, _ = clipped_policy_loss(logp, torch.zeros(1, 4), adv, 0.2, 0.2)
    assert_close(plain, torch.tensor([[5.0, 2.0, 0.8, 8.0]]))
    assert plain_clipped.tolist() == [[False, False, True, False]]


def test_dual_clip_has_no_effect_on_positive_advantages():
    """A = +1 with r = 5, 0.1, 1.1: [max(-5, -1.2), max(-0.1, -0.8), -1.1] = [-1.2, -0.1, -1.1], c or not."""
    logp = _log([5.0, 0.1, 1.1])
    adv = torch.ones(1, 3)
    with_dual = clipped_policy_loss(logp, torch.zeros(1, 3), adv, 0.2, 0.2, dual_clip_c=3.0)
    without = clipped_policy_loss(logp, torch.zeros(1, 3), adv, 0.2, 0.2)
    assert_close(with_dual[0], torch.tensor([[-1.2, -0.1, -1.1]]))
    assert_close(with_dual[0], without[0])
    assert with_dual[1].tolist() == without[1].tolist() == [[True, False, False]]


def test_dual_clip_zeroes_the_gradient_of_capped_tokens():
    """The capped token (A=-1, r=5) gets no gradient; the uncapped one (A=-1, r=2) gets -A * r = 2."""
    logp = _log([5.0, 2.0]).requires_grad_(True)
    loss, _, _ = clipped_policy_loss(logp, torch.zeros(1, 2), -torch.ones(1, 2), 0.2, 0.2, dual_clip_c=3.0)
    loss.sum().backward()
    assert_close(logp.grad, torch.tensor([[0.0, 2.0]]))


@pytest.mark.parametrize("c", [1.0, 0.5])
def test_dual_clip_constant_must_exceed_one(c):
    """c <= 1 would cap below the ordinary clipped loss: a ValueError."""
    with pytest.raises(ValueError, match="dual-clip"):
        clipped_policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), -torch.ones(1, 1), 0.2, 0.2, dual_clip_c=c)


def test_clip_higher_raises_only_the_upper_bound():
    """Clip-higher (eps_low 0.2, eps_high 0.28) widens the range above 1 only."""
    # eps_low 0.2, eps_high 0.28 (range [0.8, 1.28]): A=+1 r=1.25 -> -1.25 (symmetric 0.2 gives -1.2);
    # A=+1 r=1.4 -> -1.28 (clipped); A=-1 r=0.7 -> max(0.7, 0.8) = 0.8 (clipped, lower bound unchanged).
    logp = _log([1.25, 1.4, 0.7])
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    loss, clipped, _ = clipped_policy_loss(logp, torch.zeros(1, 3), adv, 0.2, 0.28)
    assert_close(loss, torch.tensor([[-1.25, -1.28, 0.8]]))
    assert clipped.tolist() == [[False, True, True]]
    symmetric, _, _ = clipped_policy_loss(logp, torch.zeros(1, 3), adv, 0.2, 0.2)
    assert_close(symmetric, torch.tensor([[-1.2, -1.2, 0.8]]))


# --- loss aggregation ---------------------------------------------------------------------------------

# Row 0: 3 tokens (sum 6, mean 2); row 1: 1 token between longer rows (sum 4, mean 4);
# row 2: 4 tokens (sum 16, mean 4). 8 valid tokens, token sum 26. Padding holds NaN, inf and 1e6.
LOSS = torch.tensor(
    [
        [1.0, 2.0, 3.0, NAN],
        [4.0, INF, 1e6, -INF],
        [5.0, 7.0, 0.0, 4.0],
    ]
)
MASK = torch.tensor(
    [
        [1.0, 1.0, 1.0, 0.0],
        [1.0, 0.0, 0.0, 0.0],
        [1.0, 1.0, 1.0, 1.0],
    ]
)
NORM = 8.0  # seq_mean_token_sum_norm's constant (e.g. max_new_tokens)

AGGREGATIONS = [
    # mode, denominator, loss
    ("token_mean", 8.0, 26.0 / 8.0),  # 26 / 8 tokens = 3.25
    ("seq_mean_token_mean", 3.0, 10.0 / 3.0),  # (2 + 4 + 4) / 3 sequences
    ("seq_mean_token_sum", 3.0, 26.0 / 3.0),  # (6 + 4 + 16) / 3 sequences
    ("seq_mean_token_sum_norm", 24.0, 26.0 / 24.0),  # (6 + 4 + 16) / (3 sequences * 8)
    ("token_sum", 1.0, 26.0),  # the plain sum, as Tinker's loss functions return it
]


def test_every_aggregation_mode_is_covered():
    """The table below lists every mode the library offers."""
    assert sorted(mode for mode, _, _ in AGGREGATIONS) == sorted(LOSS_AGGREGATIONS)


@pytest.mark.parametrize("mode, denominator, expected", AGGREGATIONS)
def test_aggregation_modes_on_padded_batch(mode, denominator, expected):
    """Each mode's denominator and loss on the same padded batch; the non-finite padding is ignored."""
    denom = loss_denominator(MASK, mode, NORM)
    assert_close(denom.float(), torch.tensor(denominator))
    assert_close(aggregate_loss(LOSS, MASK, mode, denom), torch.tensor(expected))


@pytest.mark.parametrize("mode, denominator, expected", AGGREGATIONS)
def test_micro_batches_sum_to_the_mini_batch_for_every_mode(mode, denominator, expected):
    """Micro batches reduced with the mini batch's denominator add up to the whole-batch loss, for any split."""
    denom = loss_denominator(MASK, mode, NORM)
    for splits in ([1, 2], [2, 1], [1, 1, 1]):
        parts = [aggregate_loss(l, m, mode, denom) for l, m in zip(LOSS.split(splits), MASK.split(splits))]
        assert_close(sum(parts), torch.tensor(expected))


def test_seq_mean_token_sum_norm_default_constant_is_one():
    """Without a constant, seq_mean_token_sum_norm divides by the sequence count like seq_mean_token_sum."""
    assert_close(loss_denominator(MASK, "seq_mean_token_sum_norm"), torch.tensor(3.0))


def test_seq_mean_token_sum_weighs_long_sequences_more():
    """Doubling row 2's tokens' loss moves seq_mean_token_sum by 16 / 3 but seq_mean_token_mean by 4 / 3."""
    doubled = LOSS.clone()
    doubled[2] *= 2
    for mode, change in (("seq_mean_token_sum", 16.0 / 3.0), ("seq_mean_token_mean", 4.0 / 3.0)):
        denom = loss_denominator(MASK, mode)
        delta = aggregate_loss(doubled, MASK, mode, denom) - aggregate_loss(LOSS, MASK, mode, denom)
        assert_close(delta, torch.tensor(change))


def test_unknown_aggregation_is_an_error():
    """A misspelt mode names itself and the valid choices, in both functions."""
    with pytest.raises(ValueError, match="token_meen.*seq_mean_token_sum_norm"):
        loss_denominator(MASK, "token_meen")
    with pytest.raises(ValueError, match="token_meen"):
        aggregate_loss(LOSS, MASK, "token_meen", torch.tensor(1.0))


# --- KL estimators and controllers --------------------------------------------------------------------

LOG_RATIOS = torch.tensor([[0.5, -1.0, 0.0, 2.0, -2.0]])  # x = logp - ref_logp


@pytest.mark.parametrize(
    "estimator, expected",
    [
        ("k1", [0.5, -1.0, 0.0, 2.0, -2.0]),  # x
        ("k2", [0.125, 0.5, 0.0, 2.0, 2.0]),  # x^2 / 2
        # exp(-x) - 1 + x: 0.6065307 - 0.5, 2.7182818 - 2, 0, 0.1353353 + 1, 7.3890561 - 3
        ("k3", [0.1065307, 0.7182818, 0.0, 1.1353353, 4.3890561]),
    ],
)
def test_kl_estimators_at_given_log_ratios(estimator, expected):
    """k1, k2 and k3 at x = [0.5, -1, 0, 2, -2] (ref_logp = -1, logp = x - 1)."""
    ref = torch.full_like(LOG_RATIOS, -1.0)
    assert_close(kl_per_token(ref + LOG_RATIOS, ref, estimator), torch.tensor([expected]), atol=1e-6, rtol=1e-6)


def test_k2_is_never_negative_and_symmetric():
    """k2(x) = k2(-x) >= 0, unlike k1."""
    ref = torch.zeros(1, 5)
    assert_close(kl_per_token(ref + LOG_RATIOS, ref, "k2"), kl_per_token(ref - LOG_RATIOS, ref, "k2"))
    assert (kl_per_token(ref + LOG_RATIOS, ref, "k2") >= 0).all()


def test_fixed_kl_controller_is_constant():
    """Updates with any KL leave the coefficient where it started."""
    ctl = FixedKLController(0.05)
    for kl in (0.0, 1.0, 100.0):
        ctl.update(kl, 64)
    assert ctl.value == 0.05


@pytest.mark.parametrize(
    "kl, expected",
    [
        (6.6, 0.101),  # error 6.6 / 6 - 1 = 0.1 -> 0.1 * (1 + 0.1 * 1000 / 10000) = 0.1 * 1.01
        (5.4, 0.099),  # error -0.1 -> 0.1 * 0.99
        (6.0, 0.1),  # on target: unchanged
        (60.0, 0.102),  # error 9 clipped to 0.2 -> 0.1 * 1.02
        (0.0, 0.098),  # error -1 clipped to -0.2 -> 0.1 * 0.98
    ],
)
def test_adaptive_kl_controller_update(kl, expected):
    """coef *= 1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon with coef 0.1, target 6, n 1000, horizon 10000."""
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(kl, 1000)
    assert ctl.value == pytest.approx(expected, rel=1e-12)


def test_adaptive_kl_controller_updates_compound():
    """Two updates multiply: 0.1 * 1.02 (kl 12, error clipped to 0.2) * 0.995 (kl 5.7, error -0.05) = 0.10149."""
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(12.0, 1000)
    assert ctl.value == pytest.approx(0.102)
    ctl.update(5.7, 1000)
    assert ctl.value == pytest.approx(0.10149)


@pytest.mark.parametrize("target, horizon", [(0.0, 100), (-1.0, 100), (6.0, 0)])
def test_adaptive_kl_controller_rejects_bad_settings(target, horizon):
    """Target and horizon must be positive."""
    with pytest.raises(ValueError, match="adaptive KL"):
        AdaptiveKLController(0.1, target, horizon)


# --- DPO / IPO ----------------------------------------------------------------------------------------

# Two pairs, beta 0.5. Chosen log-ratios [-2 + 2.5, -5 + 4] = [0.5, -1]; rejected [-3 + 2.5, -4 + 4.5] = [-0.5, 0.5];
# h = [1, -1.5].
CHOSEN, REJECTED = torch.tensor([-2.0, -5.0]), torch.tensor([-3.0, -4.0])
REF_CHOSEN, REF_REJECTED = torch.tensor([-2.5, -4.0]), torch.tensor([-2.5, -4.5])


def test_dpo_sigmoid_loss_and_implicit_rewards():
    """Sigmoid DPO loss -log sigmoid(beta h) and implicit rewards beta * log-ratio."""
    # -log sigmoid(0.5 h) = log(1 + e^(-0.5 h)): log(1 + e^-0.5) = 0.4740770, log(1 + e^0.75) = 1.1368710.
    # Implicit rewards beta * log-ratio: chosen [0.25, -0.5], rejected [-0.25, 0.25].
    loss, chosen_reward, rejected_reward = dpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, 0.5, "sigmoid")
    assert_close(loss, torch.tensor([0.4740770, 1.1368710]))
    assert_close(chosen_reward, torch.tensor([0.25, -0.5]))
    assert_close(rejected_reward, torch.tensor([-0.25, 0.25]))


def test_ipo_loss():
    """(h - 1 / (2 beta))^2 with 1 / (2 * 0.5) = 1: (1 - 1)^2 = 0, (-1.5 - 1)^2 = 6.25."""
    loss, chosen_reward, _ = dpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, 0.5, "ipo")
    assert_close(loss, torch.tensor([0.0, 6.25]))
    assert_close(chosen_reward, torch.tensor([0.25, -0.5]))


def test_dpo_gradient_and_detached_rewards():
    """d/d chosen_logp of -log sigmoid(beta h) = -beta * sigmoid(-beta h): -0.5 * sigmoid(-0.5) = -0.1887703."""
    chosen = CHOSEN[:1].clone().requires_grad_(True)
    loss, chosen_reward, rejected_reward = dpo_loss(chosen, REJECTED[:1], REF_CHOSEN[:1], REF_REJECTED[:1], 0.5)
    loss.sum().backward()
    assert_close(chosen.grad, torch.tensor([-0.1887703]))
    assert not chosen_reward.requires_grad and not rejected_reward.requires_grad


def test_dpo_loss_of_equal_log_ratios_is_log_two():
    """h = 0: -log sigmoid(0) = ln 2 = 0.6931472 for any beta."""
    x = torch.tensor([-1.0])
    for beta in (0.1, 2.0):
        assert_close(dpo_loss(x, x, x, x, beta)[0], torch.tensor([0.6931472]))


def test_unknown_dpo_loss_type_is_an_error():
    """Only sigmoid and ipo exist."""
    with pytest.raises(ValueError, match="hinge"):
        dpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, 0.5, "hinge")
