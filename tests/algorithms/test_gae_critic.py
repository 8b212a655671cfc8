"""advantage=gae (PPO with a critic): per-token rewards, GAE advantages and returns, KL metrics, the policy loss
and the clipped value loss."""

from dataclasses import replace

import pytest
import torch
from torch.testing import assert_close

from algorithm_fixtures import make_algorithm, trajectories
from rlhf import registry
from rlhf.algorithms import PolicyGradient, advantages as advantage_parts
from rlhf.functional import masked_mean, masked_var
from rlhf.trajectory import Forward

NAN = float("nan")


def make_ppo(**overrides) -> PolicyGradient:
    """PPO with every AlgorithmConfig field: advantage gae, k1 KL in the reward, beta 0.1, no whitening."""
    base = dict(name="ppo", advantage="gae", num_samples_per_prompt=1, beta=0.1, kl_in_reward=True, kl_estimator="k1",
                whiten_advantages=False)
    return make_algorithm(**(base | overrides))


# Three rows: 3 tokens, a 1-token row between longer ones, 4 tokens. Garbage (9, -9, 1e6) where masked.
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
SCORES = torch.tensor([1.0, 2.0, -1.0])
# k1 KL = old - ref at valid tokens: row 0 [0.1, 0.2, -0.1] (sum 0.2), row 1 [0.5] (0.5), row 2 [0, 0.1, 0.2, 0.3] (0.6).
OLD_LOGP = torch.tensor([[-1.0, -1.0, -1.0, 9.0], [-0.5, 9.0, 9.0, 9.0], [-2.0, -2.0, -2.0, -2.0]])
REF_LOGP = torch.tensor([[-1.1, -1.2, -0.9, -9.0], [-1.0, -9.0, -9.0, -9.0], [-2.0, -2.1, -2.2, -2.3]])
VALUES = torch.tensor([[0.5, 0.2, 0.4, 1e6], [1.5, 1e6, 1e6, 1e6], [0.3, 0.6, 0.9, 0.5]])
# Per-token rewards, -0.1 * KL plus the score at the last token:
#   row 0 [-0.01, -0.02, 0.01 + 1] = [-0.01, -0.02, 1.01];  row 1 [-0.05 + 2] = [1.95];
#   row 2 [0, -0.01, -0.02, -0.03 - 1] = [0, -0.01, -0.02, -1.03].


def inputs(old_logp=OLD_LOGP, ref_logp=REF_LOGP, values=VALUES):
    """The hand-made three-row step (one sample per prompt)."""
    return trajectories(MASK, scores=SCORES, old_logp=old_logp, ref_logp=ref_logp, values=values)


def test_gae_is_registered_and_needs_a_critic():
    """`gae` resolves to the GAE estimator; it composes a PolicyGradient that trains a critic."""
    assert registry.resolve("advantage", "gae") is advantage_parts.gae
    algo = make_ppo()
    assert isinstance(algo, PolicyGradient)
    assert algo.needs_critic and algo.needs_old_logprobs and algo.needs_reference


def test_prepare_gamma_one_lambda_one():
    """gamma = lam = 1: returns are the reward-to-go of the per-token rewards, advantages = returns - V."""
    # row 0: to-go [0.98, 0.99, 1.01], A = [0.98 - 0.5, 0.99 - 0.2, 1.01 - 0.4] = [0.48, 0.79, 0.61];
    # row 1: to-go [1.95], A = [0.45];
    # row 2: to-go [-1.06, -1.06, -1.05, -1.03], A = [-1.36, -1.66, -1.95, -1.53].
    batch, _ = make_ppo(gamma=1.0, lam=1.0).prepare(inputs())
    expected_returns = torch.tensor([[0.98, 0.99, 1.01, 0.0], [1.95, 0.0, 0.0, 0.0], [-1.06, -1.06, -1.05, -1.03]])
    expected_adv = torch.tensor([[0.48, 0.79, 0.61, 0.0], [0.45, 0.0, 0.0, 0.0], [-1.36, -1.66, -1.95, -1.53]])
    assert_close(batch.returns, expected_returns)
    assert_close(batch.advantages, expected_adv)
    assert batch.values is VALUES and batch.old_logp is OLD_LOGP and batch.ref_logp is REF_LOGP


def test_prepare_lambda_zero_is_one_step_td():
    """gamma 1, lam 0: advantages are one-step TD errors r_t + V_{t+1} - V_t."""
    # row 0: [-0.01 + 0.2 - 0.5, -0.02 + 0.4 - 0.2, 1.01 - 0.4] = [-0.31, 0.18, 0.61];  row 1: [1.95 - 1.5] = [0.45];
    # row 2: [0 + 0.6 - 0.3, -0.01 + 0.9 - 0.6, -0.02 + 0.5 - 0.9, -1.03 - 0.5] = [0.3, 0.29, -0.42, -1.53].
    # returns = A + V: row 0 [0.19, 0.38, 1.01]; row 1 [1.95]; row 2 [0.6, 0.89, 0.48, -1.03].
    batch, _ = make_ppo(gamma=1.0, lam=0.0).prepare(inputs())
    expected_adv = torch.tensor([[-0.31, 0.18, 0.61, 0.0], [0.45, 0.0, 0.0, 0.0], [0.3, 0.29, -0.42, -1.53]])
    expected_returns = torch.tensor([[0.19, 0.38, 1.01, 0.0], [1.95, 0.0, 0.0, 0.0], [0.6, 0.89, 0.48, -1.03]])
    assert_close(batch.advantages, expected_adv)
    assert_close(batch.returns, expected_returns)


def test_prepare_metrics():
    """prepare metrics: rewards, non-score reward, KL, values and returns."""
    # non_score_reward = -0.1 * KL sums [0.2, 0.5, 0.6] -> mean -0.13 / 3 = -0.0433333; objective/kl = 1.3 / 3.
    # rlhf_reward = mean row reward sums (0.98 + 1.95 - 1.06) / 3 = 0.6233333; val/values = 4.9 / 8 = 0.6125;
    # val/returns (gamma = lam = 1) = (0.98 + 0.99 + 1.01 + 1.95 - 1.06 - 1.06 - 1.05 - 1.03) / 8 = 0.09125.
    _, metrics = make_ppo(gamma=1.0, lam=1.0).prepare(inputs())
    assert metrics == pytest.approx(
        {
            "objective/rlhf_reward": 0.6233333,
            "objective/non_score_reward": -0.0433333,
            "objective/kl": 0.4333333,
            "objective/kl_coef": 0.1,
            "val/values": 0.6125,
            "val/returns": 0.09125,
        },
        abs=1e-6,
    )


def test_prepare_with_kl_as_a_loss_keeps_the_score_only():
    """kl_in_reward false: per-token rewards are the score alone; objective/kl is still reported."""
    # kl_in_reward false: per-token rewards are the scores alone; non_score_reward 0, objective/kl still 1.3 / 3.
    # gamma = lam = 1: row 0 A = [1 - 0.5, 1 - 0.2, 1 - 0.4]; row 1 [2 - 1.5];
    #                  row 2 [-1 - 0.3, -1 - 0.6, -1 - 0.9, -1 - 0.5].
    batch, metrics = make_ppo(gamma=1.0, lam=1.0, kl_in_reward=False).prepare(inputs())
    expected = torch.tensor([[0.5, 0.8, 0.6, 0.0], [0.5, 0.0, 0.0, 0.0], [-1.3, -1.6, -1.9, -1.5]])
    assert_close(batch.advantages, expected)
    assert metrics["objective/non_score_reward"] == 0.0
    assert metrics["objective/rlhf_reward"] == pytest.approx(2.0 / 3.0)
    assert metrics["objective/kl"] == pytest.approx(1.3 / 3.0)


def test_prepare_without_reference():
    """beta 0: no KL at all; rewards are the scores, no ref_logp tensor and no KL metrics."""
    batch, metrics = make_ppo(beta=0.0, gamma=1.0, lam=1.0).prepare(inputs(ref_logp=None))
    assert batch.ref_logp is None and "objective/kl" not in metrics
    assert_close(batch.advantages[1], torch.tensor([0.5, 0.0, 0.0, 0.0]))


def test_whitened_advantages_leave_returns_alone():
    """whiten_advantages: valid advantages get mean 0 and unbiased variance 1, 0 on padding; returns unchanged."""
    plain, _ = make_ppo(gamma=1.0, lam=1.0).prepare(inputs())
    batch, _ = make_ppo(gamma=1.0, lam=1.0, whiten_advantages=True).prepare(inputs())
    adv = batch.advantages
    assert_close(masked_mean(adv, MASK), torch.tensor(0.0), atol=1e-6, rtol=0)
    assert_close(masked_var(adv, MASK), torch.tensor(1.0), atol=1e-5, rtol=0)
    assert torch.equal(adv[~MASK.bool()], torch.zeros(4))
    assert torch.equal(batch.returns, plain.returns)


@pytest.mark.parametrize("garbage", [0.0, -30.0, 1e6])
def test_prepare_ignores_finite_garbage_where_masked(garbage):
    """Other finite garbage in masked logprobs and values changes no tensor the loss reads and no metric."""
    clean_batch, clean_metrics = make_ppo(lam=0.9).prepare(inputs())
    dirty = lambda x, g: torch.where(MASK.bool(), x, torch.full_like(x, g))  # noqa: E731
    dirty_inputs = inputs(dirty(OLD_LOGP, garbage), dirty(REF_LOGP, -garbage), dirty(VALUES, garbage))
    batch, metrics = make_ppo(lam=0.9).prepare(dirty_inputs)
    assert torch.equal(batch.advantages, clean_batch.advantages)
    assert torch.equal(batch.returns, clean_batch.returns)
    assert metrics == pytest.approx(clean_metrics)


def test_prepare_metrics_ignore_nan_where_masked():
    """NaN in masked old logprobs must not reach any metric (masked_sum drops padding everywhere else)."""
    dirty_old = torch.where(MASK.bool(), OLD_LOGP, torch.full_like(OLD_LOGP, NAN))
    _, metrics = make_ppo(gamma=1.0, lam=1.0).prepare(inputs(old_logp=dirty_old))
    assert metrics["objective/non_score_reward"] == pytest.approx(-0.0433333, abs=1e-6)


def test_prepare_needs_values():
    """Without critic values GAE cannot run: a ValueError."""
    with pytest.raises(ValueError, match="critic's values"):
        make_ppo().prepare(inputs(values=None))


# --- policy_loss and value_loss -----------------------------------------------------------------------

# Three rows (2 tokens, a 1-token row, 3 tokens); logp = old_logp so every ratio is 1 and the surrogate is -A.
LOSS_MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
ADV = torch.tensor([[1.0, -1.0, NAN], [2.0, NAN, NAN], [0.5, 0.5, -2.0]])
# Value tokens (V, V_old, R), clip 0.2:
#   row 0: (1.0, 0.5, 2.0) -> V_c 0.7, max(1, 1.69) / 2 = 0.845 clipped; (0.6, 0.5, 2.0) -> 1.96 / 2 = 0.98
#   row 1: (0.0, 0.0, 1.0) -> 1 / 2 = 0.5
#   row 2: (0.0, 0.5, -1.0) -> V_c 0.3, max(1, 1.69) / 2 = 0.845 clipped; (1.0, 0.5, 0.0) -> V_c 0.7, max(1, 0.49) / 2 = 0.5;
#          (0.5, 0.5, 0.5) -> 0
NEW_VALUES = torch.tensor([[1.0, 0.6, NAN], [0.0, NAN, NAN], [0.0, 1.0, 0.5]])
OLD_VALUES = torch.tensor([[0.5, 0.5, NAN], [0.0, 7.0, 7.0], [0.5, 0.5, 0.5]])
RETURNS = torch.tensor([[2.0, 2.0, -7.0], [1.0, NAN, 3.0], [-1.0, 0.0, 0.5]])


def loss_batch():
    """A training batch with the loss tensors above (old_logp 0 everywhere); the rollout's values are OLD_VALUES."""
    return trajectories(LOSS_MASK, old_logp=torch.zeros(3, 3), advantages=ADV, returns=RETURNS, values=OLD_VALUES)


def test_policy_loss_and_weighted_value_loss():
    """policy_loss and value_loss (vf_coef * value loss) with token_mean over 6 tokens."""
    # token_mean over 6 tokens, vf_coef 0.1, cliprange_value 0.2.
    # policy: -A = [-1, 1, -2, -0.5, -0.5, 2] sums to -1 -> -1/6;
    # value: (0.845 + 0.98 + 0.5 + 0.845 + 0.5 + 0) / 6 = 3.67 / 6 = 0.6116667, times 0.1 = 0.0611667;
    # val/clipfrac_avg 2 / 6.
    algo = make_ppo(vf_coef=0.1, cliprange_value=0.2, beta=0.0)
    batch = loss_batch()
    denominator = algo.denominator(batch)
    policy_loss, metrics = algo.policy_loss(batch, Forward(torch.zeros(3, 3)), denominator)
    value_loss, value_metrics = algo.value_loss(batch, Forward(values=NEW_VALUES), denominator)
    metrics = metrics | value_metrics
    assert_close(policy_loss, torch.tensor(-1.0 / 6.0))
    assert_close(value_loss, torch.tensor(0.0611667))
    assert_close(metrics["loss/value_avg"], torch.tensor(0.6116667))
    assert_close(metrics["val/clipfrac_avg"], torch.tensor(2.0 / 6.0))
    assert_close(metrics["loss/policy_avg"], torch.tensor(-1.0 / 6.0))
    assert_close(metrics["policy/clipfrac_avg"], torch.tensor(0.0))
    assert set(metrics) == {
        "loss/policy_avg", "policy/approxkl_avg", "policy/clipfrac_avg", "val/ratio", "loss/value_avg", "val/clipfrac_avg"
    }


def test_unclipped_value_loss():
    """cliprange_value None: 0.5 * (V - R)^2 = [0.5, 0.98, 0.5, 0.5, 0.5, 0] -> 2.98 / 6, nothing clipped; vf_coef 0.5."""
    algo = make_ppo(vf_coef=0.5, cliprange_value=None, beta=0.0)
    batch = loss_batch()
    value_loss, metrics = algo.value_loss(batch, Forward(values=NEW_VALUES), algo.denominator(batch))
    assert_close(metrics["loss/value_avg"], torch.tensor(2.98 / 6.0))
    assert_close(value_loss, torch.tensor(0.5 * 2.98 / 6.0))
    assert metrics["val/clipfrac_avg"].item() == 0.0


def test_value_loss_seq_mean_token_mean():
    """seq_mean_token_mean: the value loss is the mean of per-row token means."""
    # row means (0.845 + 0.98) / 2 = 0.9125, 0.5, (0.845 + 0.5 + 0) / 3 = 0.4483333 -> 1.8608333 / 3 = 0.6202778
    algo = make_ppo(loss_agg="seq_mean_token_mean", beta=0.0)
    batch = loss_batch()
    _, metrics = algo.value_loss(batch, Forward(values=NEW_VALUES), algo.denominator(batch))
    assert_close(metrics["loss/value_avg"], torch.tensor(0.6202778))


def test_value_loss_gradient_reaches_only_the_values():
    """The value loss's gradient reaches the values (not logp), 0 on clipped and padded tokens."""
    # d value_loss / dV = vf_coef * (V - R) / 6 on unclipped valid tokens, 0 on clipped and padded ones;
    # the policy loss does not depend on the values.
    algo = make_ppo(vf_coef=0.1, beta=0.0)
    batch = loss_batch()  # finite padding here: the chain rule gives 0 * NaN = NaN at NaN-padded tokens
    names = ("old_logp", "advantages", "returns", "values")
    batch = replace(batch, **{k: torch.nan_to_num(getattr(batch, k), nan=1e3) for k in names})
    values = torch.nan_to_num(NEW_VALUES, nan=1e3).requires_grad_(True)
    logp = torch.zeros(3, 3, requires_grad=True)
    denominator = algo.denominator(batch)
    policy_loss, _ = algo.policy_loss(batch, Forward(logp), denominator)
    value_loss, _ = algo.value_loss(batch, Forward(values=values), denominator)
    value_loss.backward()
    # unclipped (V - R): row 0 t1 0.6 - 2 = -1.4; row 1 t0 0 - 1 = -1; row 2 t1 1 - 0 = 1, t2 0.
    expected = torch.tensor([[0.0, -1.4, 0.0], [-1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]) * 0.1 / 6.0
    assert_close(values.grad, expected)
    assert logp.grad is None
    assert not any(t.requires_grad for t in (batch.returns, batch.values))
    assert policy_loss.grad_fn is not None


def test_value_loss_micro_batches_sum_to_mini_batch():
    """Rows fed one at a time with the mini-batch denominator add up to the whole batch's value loss."""
    algo = make_ppo(beta=0.0)
    batch = loss_batch()
    denominator = algo.denominator(batch)
    whole, _ = algo.value_loss(batch, Forward(values=NEW_VALUES), denominator)
    parts = []
    for unit in range(3):
        micro = batch.select_units(torch.tensor([unit]))
        parts.append(algo.value_loss(micro, Forward(values=NEW_VALUES[unit : unit + 1]), denominator)[0])
    assert_close(sum(parts), whole)


def test_value_loss_needs_the_critic_forward():
    """A Forward without values is a ValueError naming the critic."""
    with pytest.raises(ValueError, match="critic"):
        make_ppo(beta=0.0).value_loss(loss_batch(), Forward(torch.zeros(3, 3)), torch.tensor(6.0))


def test_ppo_policy_loss_adds_kl_when_kl_is_a_loss():
    """kl_in_reward false: the PPO policy loss includes beta * KL, reported as loss/kl_avg."""
    # kl_in_reward false, beta 0.1, k1: policy loss -1/6 + 0.1 * (sum of logp - ref) / 6 with ref = -0.3 everywhere:
    # 6 valid tokens * 0.3 / 6 = 0.3 -> -1/6 + 0.03.
    algo = make_ppo(kl_in_reward=False, beta=0.1, kl_estimator="k1")
    batch = replace(loss_batch(), ref_logp=torch.full((3, 3), -0.3))
    policy_loss, metrics = algo.policy_loss(batch, Forward(torch.zeros(3, 3)), algo.denominator(batch))
    assert_close(metrics["loss/kl_avg"], torch.tensor(0.3))
    assert_close(policy_loss, torch.tensor(-1.0 / 6.0 + 0.03))
