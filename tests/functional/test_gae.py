"""Per-token rewards and GAE for PPO: last valid token, score placement, advantages and returns."""

import pytest
import torch
from torch.testing import assert_close

from rlhf.functional import gae_advantages, last_token_index, token_level_rewards

NAN = float("nan")
BIG = 1e6

# Row 0: 3 tokens then padding; row 1: a 1-token row between longer ones; row 2: all 4 tokens valid.
MASK = torch.tensor(
    [
        [1.0, 1.0, 1.0, 0.0],
        [1.0, 0.0, 0.0, 0.0],
        [1.0, 1.0, 1.0, 1.0],
    ]
)
# Garbage (NaN, 1e6) after each row's last valid token must not reach any output.
REWARDS = torch.tensor(
    [
        [0.0, 0.0, 1.0, NAN],
        [2.0, BIG, NAN, 5.0],
        [0.1, 0.0, 0.0, 1.0],
    ]
)
VALUES = torch.tensor(
    [
        [0.5, 0.2, 0.4, BIG],
        [1.5, NAN, 3.0, 3.0],
        [0.3, 0.6, 0.9, 0.5],
    ]
)


# --- last_token_index ---------------------------------------------------------------------------------


def test_last_token_index_of_right_padded_rows():
    """Rows of lengths 3, 1, 4 end at 2, 0, 3; an empty row gives 0."""
    mask = torch.cat([MASK, torch.zeros(1, 4)])
    assert last_token_index(mask).tolist() == [2, 0, 3, 0]
    assert last_token_index(mask).dtype == torch.long


def test_last_token_index_of_left_and_right_padded_rows():
    """A left-padded prompt + right-padded response (long attention mask): [0 0 1 1 1 0] ends at 4."""
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [0, 1, 0, 0, 0, 0]])
    assert last_token_index(mask).tolist() == [4, 5, 1]


# --- token_level_rewards ------------------------------------------------------------------------------


def test_token_level_rewards_put_the_score_at_the_last_valid_token():
    """Scores land at each row's last valid token on top of the per-token KL rewards; padding becomes 0."""
    # Scores [1, 2, 3] land at positions 2, 0, 3 on top of the per-token KL rewards; padding becomes 0.
    # row 0: [-0.1, -0.2, -0.3 + 1] = [-0.1, -0.2, 0.7, 0];  row 1: [-0.5 + 2, 0, 0, 0] = [1.5, 0, 0, 0];
    # row 2: [0, -0.1, 0, -0.2 + 3] = [0, -0.1, 0, 2.8].
    kl_rewards = torch.tensor(
        [
            [-0.1, -0.2, -0.3, NAN],
            [-0.5, BIG, NAN, BIG],
            [0.0, -0.1, 0.0, -0.2],
        ]
    )
    rewards = token_level_rewards(torch.tensor([1.0, 2.0, 3.0]), kl_rewards, MASK)
    expected = torch.tensor(
        [
            [-0.1, -0.2, 0.7, 0.0],
            [1.5, 0.0, 0.0, 0.0],
            [0.0, -0.1, 0.0, 2.8],
        ]
    )
    assert_close(rewards, expected)


def test_token_level_rewards_without_kl_is_the_score_alone():
    """Zero KL rewards: each row is all 0 but its score at the last valid token."""
    rewards = token_level_rewards(torch.tensor([-1.0, 4.0, 0.5]), torch.zeros(3, 4), MASK)
    expected = torch.tensor([[0.0, 0.0, -1.0, 0.0], [4.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.5]])
    assert_close(rewards, expected)


def test_token_level_rewards_do_not_modify_inputs():
    """The KL rewards tensor passed in is left unchanged (the score is added to a copy)."""
    kl_rewards = torch.tensor([[-0.1, -0.2, -0.3, 0.0]])
    before = kl_rewards.clone()
    token_level_rewards(torch.tensor([1.0]), kl_rewards, MASK[:1])
    assert torch.equal(kl_rewards, before)


# --- gae_advantages -----------------------------------------------------------------------------------


def test_gae_gamma_one_lambda_one_returns_are_reward_to_go():
    """gamma = lam = 1: A_t = sum_{k>=t} r_k - V_t, so returns = A + V = reward-to-go."""
    # row 0: to-go [1, 1, 1], A = [1 - 0.5, 1 - 0.2, 1 - 0.4] = [0.5, 0.8, 0.6];
    # row 1: to-go [2], A = [2 - 1.5] = [0.5];
    # row 2: to-go [1.1, 1, 1, 1], A = [1.1 - 0.3, 1 - 0.6, 1 - 0.9, 1 - 0.5] = [0.8, 0.4, 0.1, 0.5].
    adv, returns = gae_advantages(REWARDS, VALUES, MASK, gamma=1.0, lam=1.0)
    expected_adv = torch.tensor([[0.5, 0.8, 0.6, 0.0], [0.5, 0.0, 0.0, 0.0], [0.8, 0.4, 0.1, 0.5]])
    expected_returns = torch.tensor([[1.0, 1.0, 1.0, 0.0], [2.0, 0.0, 0.0, 0.0], [1.1, 1.0, 1.0, 1.0]])
    assert_close(adv, expected_adv)
    assert_close(returns, expected_returns)


def test_gae_lambda_zero_is_one_step_td():
    """lam = 0, gamma = 1: A_t = r_t + V_{t+1} - V_t with V = 0 after the last valid token."""
    # row 0: [0 + 0.2 - 0.5, 0 + 0.4 - 0.2, 1 + 0 - 0.4] = [-0.3, 0.2, 0.6];  row 1: [2 - 1.5] = [0.5];
    # row 2: [0.1 + 0.6 - 0.3, 0 + 0.9 - 0.6, 0 + 0.5 - 0.9, 1 - 0.5] = [0.4, 0.3, -0.4, 0.5].
    # returns = A + V: row 0 [0.2, 0.4, 1.0]; row 1 [2.0]; row 2 [0.7, 0.9, 0.5, 1.0].
    adv, returns = gae_advantages(REWARDS, VALUES, MASK, gamma=1.0, lam=0.0)
    expected_adv = torch.tensor([[-0.3, 0.2, 0.6, 0.0], [0.5, 0.0, 0.0, 0.0], [0.4, 0.3, -0.4, 0.5]])
    expected_returns = torch.tensor([[0.2, 0.4, 1.0, 0.0], [2.0, 0.0, 0.0, 0.0], [0.7, 0.9, 0.5, 1.0]])
    assert_close(adv, expected_adv)
    assert_close(returns, expected_returns)


def test_gae_with_discount_and_lambda():
    """gamma = 0.9, lam = 0.5: A_t = delta_t + 0.45 A_{t+1} with delta_t = r_t + 0.9 V_{t+1} - V_t."""
    # gamma = 0.9, lam = 0.5 (gamma * lam = 0.45), delta_t = r_t + 0.9 V_{t+1} - V_t, A_t = delta_t + 0.45 A_{t+1}.
    # row 0: deltas t2 = 1 - 0.4 = 0.6, t1 = 0.9 * 0.4 - 0.2 = 0.16, t0 = 0.9 * 0.2 - 0.5 = -0.32;
    #        A2 = 0.6, A1 = 0.16 + 0.45 * 0.6 = 0.43, A0 = -0.32 + 0.45 * 0.43 = -0.1265.
    # row 1: A0 = 2 - 1.5 = 0.5.
    # row 2: deltas t3 = 1 - 0.5 = 0.5, t2 = 0.9 * 0.5 - 0.9 = -0.45, t1 = 0.9 * 0.9 - 0.6 = 0.21,
    #        t0 = 0.1 + 0.9 * 0.6 - 0.3 = 0.34; A3 = 0.5, A2 = -0.45 + 0.225 = -0.225,
    #        A1 = 0.21 - 0.45 * 0.225 = 0.10875, A0 = 0.34 + 0.45 * 0.10875 = 0.3889375.
    # returns = A + V: row 0 [0.3735, 0.63, 1.0]; row 1 [2.0]; row 2 [0.6889375, 0.70875, 0.675, 1.0].
    adv, returns = gae_advantages(REWARDS, VALUES, MASK, gamma=0.9, lam=0.5)
    expected_adv = torch.tensor(
        [[-0.1265, 0.43, 0.6, 0.0], [0.5, 0.0, 0.0, 0.0], [0.3889375, 0.10875, -0.225, 0.5]]
    )
    expected_returns = torch.tensor(
        [[0.3735, 0.63, 1.0, 0.0], [2.0, 0.0, 0.0, 0.0], [0.6889375, 0.70875, 0.675, 1.0]]
    )
    assert_close(adv, expected_adv)
    assert_close(returns, expected_returns)


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (1.0, 0.0), (0.9, 0.5), (0.99, 0.95)])
def test_gae_returns_are_advantages_plus_values_and_zero_outside_the_mask(gamma, lam):
    """returns = A + V on valid tokens; both are exactly 0 (never NaN) on padding."""
    adv, returns = gae_advantages(REWARDS, VALUES, MASK, gamma, lam)
    valid = MASK.bool()
    assert_close(returns[valid], (adv + VALUES)[valid])
    assert torch.equal(adv[~valid], torch.zeros(int((~valid).sum())))
    assert torch.equal(returns[~valid], torch.zeros(int((~valid).sum())))


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.9, 0.5)])
def test_gae_ignores_everything_after_the_last_valid_token(gamma, lam):
    """Other garbage in padded rewards and values (0, -1e6, inf) gives identical advantages and returns."""
    reference = gae_advantages(REWARDS, VALUES, MASK, gamma, lam)
    for garbage in (0.0, -BIG, float("inf")):
        rewards = torch.where(MASK.bool(), REWARDS, torch.full_like(REWARDS, garbage))
        values = torch.where(MASK.bool(), VALUES, torch.full_like(VALUES, garbage))
        for got, want in zip(gae_advantages(rewards, values, MASK, gamma, lam), reference):
            assert torch.equal(got, want)


def test_gae_rows_are_independent():
    """Each row computed alone gives the same advantages as in the padded batch."""
    adv, returns = gae_advantages(REWARDS, VALUES, MASK, 0.9, 0.5)
    for i in range(3):
        row_adv, row_returns = gae_advantages(REWARDS[i : i + 1], VALUES[i : i + 1], MASK[i : i + 1], 0.9, 0.5)
        assert torch.equal(row_adv, adv[i : i + 1])
        assert torch.equal(row_returns, returns[i : i + 1])
