"""GSPO's sequence ratio, the unclipped importance-sampling loss, per-turn returns and REBN, and GAE across the
observation gaps of multi-turn rows; hand-computed values on small tensors."""

import math

import torch
from torch.testing import assert_close

from rlhf.functional import gae_advantages, gspo_policy_loss, importance_sampling_loss, rebn_advantages, turn_returns

G = 9.0  # garbage in masked positions

# --- gspo_policy_loss ---------------------------------------------------------------------------------

# Row 0: log-ratios [0.1, 0.3] (mean 0.2, s = e^0.2 = 1.2214028), A = +1. Per token, PPO would clip only the
# second (e^0.1 = 1.105 < 1.2 < e^0.3); GSPO clips the whole sequence at 1.2: loss -1.2 on both tokens.
# Row 1: log-ratios [0, -0.1, 0.1] (mean 0, s = 1), A = -2: loss 2 per token, not clipped.
GSPO_MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
OLD = torch.tensor([[-1.0, -2.0, G], [-0.5, -1.0, -1.5]])
LOGP = OLD + torch.tensor([[0.1, 0.3, -G], [0.0, -0.1, 0.1]])
GSPO_ADV = torch.tensor([[1.0, 1.0, 0.0], [-2.0, -2.0, -2.0]])


def test_gspo_uses_one_length_normalised_ratio_per_sequence_and_clips_it():
    loss, clipped, log_ratio = gspo_policy_loss(LOGP, OLD, GSPO_ADV, GSPO_MASK, 0.2, 0.2)
    assert_close(log_ratio, torch.tensor([[0.2] * 3, [0.0] * 3]))
    assert_close(loss * GSPO_MASK, torch.tensor([[-1.2, -1.2, 0.0], [2.0, 2.0, 2.0]]))
    assert (clipped & GSPO_MASK.bool()).tolist() == [[True, True, False], [False, False, False]]


def test_gspo_token_gradient_is_minus_advantage_times_sequence_ratio():
    """Unclipped (wide clip range): d loss_t / d logp_t = -A * s, with no 1/n from the mean; 0 where clipped."""
    logp = LOGP.clone().requires_grad_(True)
    loss, _, _ = gspo_policy_loss(logp, OLD, GSPO_ADV, GSPO_MASK, 10.0, 10.0)
    (loss * GSPO_MASK).sum().backward()
    s = math.exp(0.2)
    assert_close(logp.grad, torch.tensor([[-s, -s, 0.0], [2.0, 2.0, 2.0]]))
    logp.grad = None
    loss, _, _ = gspo_policy_loss(logp, OLD, GSPO_ADV, GSPO_MASK, 0.2, 0.2)
    (loss * GSPO_MASK).sum().backward()
    assert_close(logp.grad, torch.tensor([[0.0, 0.0, 0.0], [2.0, 2.0, 2.0]]))  # row 0 clipped


# --- importance_sampling_loss -------------------------------------------------------------------------


def test_importance_sampling_loss_value_and_gradient():
    """-A * exp(logp - sampler): log-ratios [0.5, -1], A [2, -1] -> [-2 e^0.5, e^-1] = [-3.2974425, 0.3678794];
    the gradient -A * ratio has the same values."""
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    sampler = torch.tensor([[-1.5, -1.0]])
    loss, log_ratio = importance_sampling_loss(logp, sampler, torch.tensor([[2.0, -1.0]]))
    expected = torch.tensor([[-3.2974425, 0.3678794]])
    assert_close(log_ratio.detach(), torch.tensor([[0.5, -1.0]]))
    assert_close(loss.detach(), expected)
    loss.sum().backward()
    assert_close(logp.grad, expected)


# --- turn_returns and rebn_advantages -----------------------------------------------------------------

# Row 0: two turns (tokens 0-1 and 4-5) around a 2-token observation whose rewards (7) must be ignored; turn
# rewards 1 and 4 at the turn ends. Row 1: one turn of 3 tokens, reward 2.
TURN_MASK = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]])
TURN_REWARDS = torch.tensor([[0.0, 1.0, 7.0, 7.0, 0.0, 4.0], [0.0, 0.0, 2.0, 0.0, 0.0, 0.0]])


def test_turn_returns_discount_over_turns_not_tokens():
    """gamma 0.5: G_2 = 4, G_1 = 1 + 0.5 * 4 = 3; the single-turn row's return is its reward 2."""
    per_token, per_turn, exists = turn_returns(TURN_REWARDS, TURN_MASK, 0.5)
    assert_close(per_token, torch.tensor([[3.0, 3.0, 0.0, 0.0, 4.0, 4.0], [2.0, 2.0, 2.0, 0.0, 0.0, 0.0]]))
    assert_close(per_turn, torch.tensor([[3.0, 4.0], [2.0, 0.0]]))
    assert exists.tolist() == [[True, True], [True, False]]


def test_rebn_normalises_over_every_turn_of_the_batch():
    """Turn returns [3, 4, 2]: mean 3, biased std sqrt(2/3) -> [0, 1.2247449 | -1.2247449] on each turn's tokens."""
    a = 1.2247449
    expected = torch.tensor([[0.0, 0.0, 0.0, 0.0, a, a], [-a, -a, -a, 0.0, 0.0, 0.0]])
    assert_close(rebn_advantages(TURN_REWARDS, TURN_MASK, 0.5), expected, atol=1e-5, rtol=0)


def test_rebn_single_turn_rows_are_whitened_scores():
    """Scores [1, 2, 6] at each row's last token: mean 3, biased std sqrt(14/3) = 2.1602469."""
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    rewards = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 6.0]])
    scores = torch.tensor([1.0, 2.0, 6.0])
    adv = rebn_advantages(rewards, mask, gamma=0.5)
    expected = torch.tensor([-0.9258201, -0.4629100, 1.3887301])
    assert_close(adv, expected.unsqueeze(1) * mask, atol=1e-5, rtol=0)
    assert_close(adv, ((scores - scores.mean()) / scores.std(unbiased=False)).unsqueeze(1) * mask, atol=1e-5, rtol=0)


# --- gae_advantages across observation gaps -----------------------------------------------------------


def test_gae_skips_observation_tokens_instead_of_ending_the_episode():
    """A row [1, 0, 1] equals the row [1, 1] with the gap removed, exactly; 0 at the gap.

    gamma 0.5, lam 0.5, r = [0.5, 1.0], V = [0.2, 0.4]: delta_1 = 1 - 0.4 = 0.6 = A_1;
    delta_0 = 0.5 + 0.5 * 0.4 - 0.2 = 0.5, A_0 = 0.5 + 0.25 * 0.6 = 0.65; returns A + V = [0.85, 1.0].
    """
    gap_adv, gap_ret = gae_advantages(
        torch.tensor([[0.5, G, 1.0]]), torch.tensor([[0.2, G, 0.4]]), torch.tensor([[1.0, 0.0, 1.0]]), 0.5, 0.5
    )
    adv, ret = gae_advantages(torch.tensor([[0.5, 1.0]]), torch.tensor([[0.2, 0.4]]), torch.ones(1, 2), 0.5, 0.5)
    assert_close(adv, torch.tensor([[0.65, 0.6]]))
    assert_close(ret, torch.tensor([[0.85, 1.0]]))
    assert torch.equal(gap_adv[:, [0, 2]], adv) and torch.equal(gap_ret[:, [0, 2]], ret)
    assert gap_adv[0, 1].item() == 0.0 and gap_ret[0, 1].item() == 0.0


def test_gae_single_turn_right_padding_is_unchanged():
    """A right-padded row equals its unpadded self: the episode ends at the last valid token."""
    padded_adv, padded_ret = gae_advantages(
        torch.tensor([[0.5, 1.0, G]]), torch.tensor([[0.2, 0.4, G]]), torch.tensor([[1.0, 1.0, 0.0]]), 0.5, 0.5
    )
    assert_close(padded_adv, torch.tensor([[0.65, 0.6, 0.0]]))
    assert_close(padded_ret, torch.tensor([[0.85, 1.0, 0.0]]))


def test_rebn_with_the_bessel_corrected_std_and_geMs_eps():
    """Two rows, one turn each: returns 1 and 3 (gamma 1). Biased std 1; unbiased sqrt(2); the eps is added to it."""
    rewards = torch.tensor([[0.0, 1.0], [0.0, 3.0]])
    mask = torch.ones(2, 2)
    biased = rebn_advantages(rewards, mask, gamma=1.0, eps=1e-6)
    unbiased = rebn_advantages(rewards, mask, gamma=1.0, eps=1e-9, unbiased=True)
    torch.testing.assert_close(biased, torch.tensor([[-1.0, -1.0], [1.0, 1.0]]) / (1 + 1e-6))
    torch.testing.assert_close(unbiased, torch.tensor([[-1.0, -1.0], [1.0, 1.0]]) / (2**0.5 + 1e-9))
