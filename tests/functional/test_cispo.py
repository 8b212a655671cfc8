"""CISPO's loss (MiniMax-M1) on hand-computed values: the clipped weight is detached, so clipped tokens keep gradient."""

import math

import torch
from torch.testing import assert_close

from rlhf.functional import cispo_policy_loss, clipped_policy_loss

# One row, ratios 0.5, 1.0, 3.0 against old_logp; advantages +1, -2, +1.
OLD = torch.tensor([[-1.0, -2.0, -3.0]])
LOGP = OLD + torch.log(torch.tensor([[0.5, 1.0, 3.0]]))
ADV = torch.tensor([[1.0, -2.0, 1.0]])


def test_value_is_minus_clipped_weight_times_advantage_times_logp():
    """eps_low 0.2, eps_high 0.28: weights clip(0.5)=0.8, 1.0, clip(3.0)=1.28; loss_t = -w_t * A_t * logp_t."""
    loss, clipped, log_ratio = cispo_policy_loss(LOGP, OLD, ADV, 0.2, 0.28)
    logp = LOGP[0].tolist()
    expected = [-0.8 * 1.0 * logp[0], -1.0 * -2.0 * logp[1], -1.28 * 1.0 * logp[2]]
    assert_close(loss, torch.tensor([expected]))
    assert clipped.tolist() == [[True, False, True]]
    assert_close(log_ratio, torch.log(torch.tensor([[0.5, 1.0, 3.0]])))


def test_clipped_tokens_still_get_the_clipped_weight_as_gradient():
    """d loss_t / d logp_t = -w_t * A_t: [-0.8, 2.0, -1.28]. PPO's clip gives the third token (A > 0, ratio above
    1 + eps) exactly zero gradient."""
    logp = LOGP.clone().requires_grad_(True)
    cispo_policy_loss(logp, OLD, ADV, 0.2, 0.28)[0].sum().backward()
    assert_close(logp.grad, torch.tensor([[-0.8, 2.0, -1.28]]))
    ppo_logp = LOGP.clone().requires_grad_(True)
    clipped_policy_loss(ppo_logp, OLD, ADV, 0.2, 0.28)[0].sum().backward()
    assert ppo_logp.grad[0, 2].item() == 0.0


def test_no_lower_bound_when_eps_low_is_one():
    """clip_eps_low=1 leaves ratios below 1 as they are (MiniMax-M1 tunes only the upper bound)."""
    loss, clipped, _ = cispo_policy_loss(LOGP, OLD, ADV, 1.0, 4.0)
    assert not clipped.any()
    assert math.isclose(loss[0, 0].item(), -0.5 * LOGP[0, 0].item(), rel_tol=1e-6)
