"""Policy-gradient policy_loss: aggregation, KL term, entropy bonus, clip variants, metrics, denominators, flags."""

import math

import pytest
import torch
from torch.testing import assert_close

from algorithm_fixtures import build_kl_example, make_algorithm, trajectories
from rlhf.functional import AdaptiveKLController, FixedKLController
from rlhf.trajectory import Forward

MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # row 0 padded at the end, row 1 short
# Valid ratios r (old_logp = 0): A=+1 r=1.1 -> -1.1; A=+1 r=1.5 -> -1.2 (clipped); A=-1 r=0.5 -> 0.8 (clipped).
RATIOS = [[1.1, 1.5, None], [0.5, None, None]]
ADV = torch.tensor([[1.0, 1.0, 0.0], [-1.0, 0.0, 0.0]])
KL_X = [[0.5, -1.0, None], [0.0, None, None]]  # log-ratios to the reference at valid tokens


def _inputs(garbage: float = 3.0):
    """logp, old_logp, ref_logp with `garbage`-derived values in masked positions."""
    logp = torch.tensor([[math.log(r) if r else garbage for r in row] for row in RATIOS])
    old_logp = torch.where(MASK.bool(), torch.zeros(2, 3), torch.full((2, 3), -garbage))
    x = torch.tensor([[v if v is not None else 0.0 for v in row] for row in KL_X])
    ref_logp = torch.where(MASK.bool(), logp - x, torch.full((2, 3), 2 * garbage))
    return logp, old_logp, ref_logp


def loss_batch(old_logp, ref_logp=None, adv=ADV, mask=MASK):
    """A micro batch as prepare leaves it: old/ref logprobs and advantages set."""
    return trajectories(mask, old_logp=old_logp, ref_logp=ref_logp, advantages=adv)


def policy_loss(algo, logp, old_logp, ref_logp, adv, mask, denominator, entropy=None):
    """(loss, metrics) of `algo.policy_loss` on one micro batch built from plain tensors; no critic involved."""
    assert not algo.needs_critic
    return algo.policy_loss(loss_batch(old_logp, ref_logp, adv, mask), Forward(logp, entropy), denominator)


def test_policy_loss_token_mean_and_metrics():
    """token_mean over 3 valid tokens: (-1.1 - 1.2 + 0.8) / 3 = -0.5.

    clipfrac 2/3; ratio (1.1 + 1.5 + 0.5) / 3 = 1.0333333;
    approxkl 0.5 * (ln^2 1.1 + ln^2 1.5 + ln^2 0.5) / 3 = 0.5 * (0.0090840 + 0.1644020 + 0.4804530) / 3 = 0.1089898.
    """
    algo = make_algorithm(loss_agg="token_mean")
    logp, old_logp, _ = _inputs()
    loss, metrics = policy_loss(algo, logp, old_logp, None, ADV, MASK, torch.tensor(3.0))
    assert_close(loss, torch.tensor(-0.5))
    assert set(metrics) == {"loss/policy_avg", "policy/approxkl_avg", "policy/clipfrac_avg", "val/ratio"}
    assert_close(metrics["loss/policy_avg"], torch.tensor(-0.5))
    assert_close(metrics["policy/clipfrac_avg"], torch.tensor(2.0 / 3.0))
    assert_close(metrics["val/ratio"], torch.tensor(1.0333333))
    assert_close(metrics["policy/approxkl_avg"], torch.tensor(0.1089898), atol=1e-6, rtol=0)


def test_policy_loss_seq_mean_token_mean():
    """Sequence means (-1.1 - 1.2) / 2 = -1.15 and 0.8 / 1; (-1.15 + 0.8) / 2 sequences = -0.175."""
    logp, old_logp, _ = _inputs()
    algo = make_algorithm(loss_agg="seq_mean_token_mean")
    loss, _ = policy_loss(algo, logp, old_logp, None, ADV, MASK, torch.tensor(2.0))
    assert_close(loss, torch.tensor(-0.175))


@pytest.mark.parametrize(
    "estimator, kl_loss",
    [
        ("k1", -1.0 / 6.0),  # (0.5 - 1 + 0) / 3
        ("k2", 0.625 / 3.0),  # (0.125 + 0.5 + 0) / 3 = 0.2083333
        ("k3", 0.2749375),  # (0.1065307 + 0.7182818 + 0) / 3
    ],
)
def test_policy_loss_adds_beta_kl_when_kl_is_a_loss(estimator, kl_loss):
    """kl_in_reward false, beta 0.1, ref given: loss = -0.5 + 0.1 * kl_loss, reported as loss/kl_avg."""
    algo = make_algorithm(beta=0.1, kl_in_reward=False, kl_estimator=estimator)
    logp, old_logp, ref_logp = _inputs()
    loss, metrics = policy_loss(algo, logp, old_logp, ref_logp, ADV, MASK, torch.tensor(3.0))
    assert_close(metrics["loss/kl_avg"], torch.tensor(kl_loss), atol=1e-6, rtol=0)
    assert_close(metrics["loss/policy_avg"], torch.tensor(-0.5))
    assert_close(loss, torch.tensor(-0.5 + 0.1 * kl_loss), atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "overrides, with_ref",
    [
        (dict(beta=0.1, kl_in_reward=True), True),  # KL already in the reward
        (dict(beta=0.0, kl_in_reward=False), True),  # KL disabled
        (dict(beta=0.1, kl_in_reward=False), False),  # no reference logprobs
    ],
)
def test_policy_loss_has_no_kl_term_otherwise(overrides, with_ref):
    """Without (beta > 0, kl_in_reward false, ref_logp given) the loss is the bare surrogate -0.5."""
    logp, old_logp, ref_logp = _inputs()
    algo = make_algorithm(**overrides)
    loss, metrics = policy_loss(algo, logp, old_logp, ref_logp if with_ref else None, ADV, MASK, torch.tensor(3.0))
    assert "loss/kl_avg" not in metrics
    assert_close(loss, torch.tensor(-0.5))


def test_policy_loss_ignores_masked_positions():
    """Different garbage in masked logp / old_logp / ref_logp changes neither loss nor any metric."""
    algo = make_algorithm(beta=0.1, kl_estimator="k3")
    results = []
    for garbage in (0.0, 3.0, -20.0):
        logp, old_logp, ref_logp = _inputs(garbage)
        results.append(policy_loss(algo, logp, old_logp, ref_logp, ADV, MASK, torch.tensor(3.0)))
    for loss, metrics in results[1:]:
        assert_close(loss, results[0][0])
        for key, value in metrics.items():
            assert_close(value, results[0][1][key])


def test_policy_loss_gradient_and_detached_metrics():
    """Loss is differentiable in logp; metrics are detached.

    With A = 0 the surrogate has zero gradient and k1 KL gives beta / denominator = 0.1 / 3 per valid token.
    """
    algo = make_algorithm(beta=0.1, kl_estimator="k1")
    logp, old_logp, ref_logp = _inputs()
    logp.requires_grad_(True)
    loss, metrics = policy_loss(algo, logp, old_logp, ref_logp, torch.zeros(2, 3), MASK, torch.tensor(3.0))
    loss.backward()
    assert_close(logp.grad, MASK * (0.1 / 3.0))
    assert all(not value.requires_grad for value in metrics.values())


def test_policy_loss_micro_batches_sum_to_mini_batch():
    """Rows fed one at a time with the mini-batch denominator sum to the whole-batch loss (-0.5 - 1/60)."""
    algo = make_algorithm(beta=0.1, kl_estimator="k1")
    logp, old_logp, ref_logp = _inputs()
    batch = loss_batch(old_logp, ref_logp)
    denominator = algo.denominator(batch)
    assert_close(denominator, torch.tensor(3.0))
    whole, _ = algo.policy_loss(batch, Forward(logp), denominator)
    units = [torch.tensor([0]), torch.tensor([1])]
    parts = [algo.policy_loss(batch.select_units(u), Forward(logp[u]), denominator)[0] for u in units]
    assert_close(sum(parts), whole)
    assert_close(whole, torch.tensor(-0.5 + 0.1 * (-1.0 / 6.0)))


# --- flags and denominators ---------------------------------------------------------------------------


def test_policy_gradient_flags():
    """No critic; pre-update logprobs always; entropy in the training forward only with an entropy bonus."""
    algo = make_algorithm()
    assert algo.needs_critic is False and algo.needs_old_logprobs is True and algo.needs_entropy is False
    assert make_algorithm(entropy_coef=0.01).needs_entropy is True


def test_kl_controller_follows_config():
    """kl_ctl fixed gives a FixedKLController at beta; adaptive an AdaptiveKLController with target and horizon."""
    fixed = make_algorithm(beta=0.1).kl_ctl
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.1
    adaptive = make_algorithm(beta=0.1, kl_ctl="adaptive", target=2.0, horizon=50).kl_ctl
    assert isinstance(adaptive, AdaptiveKLController)
    assert (adaptive.value, adaptive.target, adaptive.horizon) == (0.1, 2.0, 50)


@pytest.mark.parametrize(
    "loss_agg, loss_agg_norm, max_new_tokens, expected",
    [
        ("token_mean", None, 8, 3.0),  # 3 valid tokens
        ("seq_mean_token_mean", None, 8, 2.0),  # 2 sequences
        ("seq_mean_token_sum", None, 8, 2.0),  # 2 sequences
        ("seq_mean_token_sum_norm", None, 8, 16.0),  # 2 sequences * generator.max_new_tokens 8
        ("seq_mean_token_sum_norm", 4.0, 8, 8.0),  # 2 sequences * loss_agg_norm 4 (wins over the generator)
    ],
)
def test_denominator_per_aggregation(loss_agg, loss_agg_norm, max_new_tokens, expected):
    """The mini-batch denominator on MASK (rows of 2 and 1 valid tokens) for each loss aggregation."""
    algo = make_algorithm(max_new_tokens, loss_agg=loss_agg, loss_agg_norm=loss_agg_norm)
    batch = loss_batch(torch.zeros(2, 3))
    assert_close(algo.denominator(batch).float(), torch.tensor(expected))


@pytest.mark.parametrize(
    "loss_agg, expected",
    [
        ("seq_mean_token_sum", -0.75),  # sequence sums (-1.1 - 1.2) = -2.3 and 0.8 -> -1.5 / 2
        ("seq_mean_token_sum_norm", -0.09375),  # -1.5 / (2 sequences * max_new_tokens 8)
    ],
)
def test_policy_loss_token_sum_aggregations(loss_agg, expected):
    """The surrogate summed per sequence, divided by the algorithm's own denominator."""
    algo = make_algorithm(8, loss_agg=loss_agg)
    logp, old_logp, _ = _inputs()
    batch = loss_batch(old_logp)
    loss, _ = algo.policy_loss(batch, Forward(logp), algo.denominator(batch))
    assert_close(loss, torch.tensor(expected))


# --- clip variants through the config -----------------------------------------------------------------


def test_clip_eps_high_from_config():
    """clip_eps_high 0.6: A=+1 r=1.5 is no longer clipped -> (-1.1 - 1.5 + 0.8) / 3 = -0.6, clipfrac 1/3."""
    logp, old_logp, _ = _inputs()
    loss, metrics = policy_loss(make_algorithm(clip_eps_high=0.6), logp, old_logp, None, ADV, MASK, torch.tensor(3.0))
    assert_close(loss, torch.tensor(-0.6))
    assert_close(metrics["policy/clipfrac_avg"], torch.tensor(1.0 / 3.0))


def test_dual_clip_c_from_config():
    """A=-1, r=5: max(5, 1.2) = 5 without dual-clip; dual_clip_c 3 caps it at 3 and counts it as clipped."""
    mask, adv, logp = torch.ones(1, 1), -torch.ones(1, 1), torch.tensor([[math.log(5.0)]])
    old_logp, denominator = torch.zeros(1, 1), torch.tensor(1.0)
    plain, plain_metrics = policy_loss(make_algorithm(), logp, old_logp, None, adv, mask, denominator)
    dual, dual_metrics = policy_loss(make_algorithm(dual_clip_c=3.0), logp, old_logp, None, adv, mask, denominator)
    assert_close(plain, torch.tensor(5.0))
    assert_close(dual, torch.tensor(3.0))
    assert plain_metrics["policy/clipfrac_avg"].item() == 0.0 and dual_metrics["policy/clipfrac_avg"].item() == 1.0


# --- the KL coefficient of a step ---------------------------------------------------------------------


def test_kl_loss_uses_the_coefficient_of_its_step_and_the_next_step_the_adapted_one():
    """A step's loss uses the coefficient its prepare logged (0.1); the adaptive update (0.102) is the next
    step's."""
    algo = make_algorithm(num_samples_per_prompt=2, beta=0.1, kl_in_reward=False, kl_estimator="k1",
                          kl_ctl="adaptive", target=0.5, horizon=20)
    _, metrics_step = build_kl_example(algo, group=2)
    assert metrics_step["objective/kl_coef"] == pytest.approx(0.1)
    logp, old_logp, ref_logp = _inputs()
    loss, metrics = policy_loss(algo, logp, old_logp, ref_logp, ADV, MASK, torch.tensor(3.0))
    assert_close(metrics["loss/kl_avg"], torch.tensor(-1.0 / 6.0))
    assert_close(loss, torch.tensor(-0.5 + 0.1 * (-1.0 / 6.0)))
    build_kl_example(algo, group=2)  # the next step
    loss, _ = policy_loss(algo, logp, old_logp, ref_logp, ADV, MASK, torch.tensor(3.0))
    assert_close(loss, torch.tensor(-0.5 + 0.102 * (-1.0 / 6.0)))


# --- entropy bonus ------------------------------------------------------------------------------------

ENTROPY = torch.tensor([[1.0, 2.0, float("nan")], [3.0, 1e6, -1e6]])  # garbage outside MASK


@pytest.mark.parametrize(
    "loss_agg, denominator, surrogate, entropy",
    [
        ("token_mean", 3.0, -0.5, 2.0),  # entropy (1 + 2 + 3) / 3
        ("seq_mean_token_mean", 2.0, -0.175, 2.25),  # sequence means 1.5 and 3 -> 4.5 / 2
    ],
)
def test_entropy_bonus_lowers_the_loss(loss_agg, denominator, surrogate, entropy):
    """entropy_coef 0.01: loss = surrogate - 0.01 * aggregated entropy, reported as loss/entropy_avg."""
    algo = make_algorithm(entropy_coef=0.01, loss_agg=loss_agg)
    logp, old_logp, _ = _inputs()
    loss, metrics = policy_loss(algo, logp, old_logp, None, ADV, MASK, torch.tensor(denominator), ENTROPY)
    assert_close(metrics["loss/entropy_avg"], torch.tensor(entropy))
    assert_close(metrics["loss/policy_avg"], torch.tensor(surrogate))
    assert_close(loss, torch.tensor(surrogate - 0.01 * entropy))


def test_entropy_bonus_gradient():
    """d loss / d entropy = -entropy_coef / denominator = -0.01 / 3 on valid tokens, 0 elsewhere."""
    logp, old_logp, _ = _inputs()
    entropy = ENTROPY.clone().requires_grad_(True)
    algo = make_algorithm(entropy_coef=0.01)
    loss, _ = policy_loss(algo, logp, old_logp, None, ADV, MASK, torch.tensor(3.0), entropy)
    loss.backward()
    assert_close(entropy.grad, MASK * (-0.01 / 3.0))


def test_no_entropy_term_without_coefficient():
    """entropy_coef 0: a given entropy is ignored; the loss is the bare surrogate -0.5."""
    logp, old_logp, _ = _inputs()
    loss, metrics = policy_loss(make_algorithm(), logp, old_logp, None, ADV, MASK, torch.tensor(3.0), ENTROPY)
    assert "loss/entropy_avg" not in metrics
    assert_close(loss, torch.tensor(-0.5))
