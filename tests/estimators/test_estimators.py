"""Policy-gradient estimators: reward shaping, build_batch (advantages, KL metrics), loss and metrics, registry."""

import math

import pytest
import torch
from omegaconf import OmegaConf
from torch.testing import assert_close

from estimator_fixtures import algorithm_cfg, rollout_with_mask
from rlhf import registry
from rlhf.config.schema import AlgorithmConfig, GeneratorConfig
from rlhf.estimators import GRPO, RLOO, Forward, PolicyGradientEstimator, Reinforce, StepInputs, TrainBatch
from rlhf.functional import AdaptiveKLController, FixedKLController
from rlhf.generators.base import Rollout

BIG = 1e6


def make_cfg(**overrides):
    """A plain namespace with every AlgorithmConfig field (schema defaults, then overrides)."""
    return algorithm_cfg(**overrides)


def make_rollout(mask: torch.Tensor) -> Rollout:
    """A rollout with the given response mask; token ids do not matter to the estimators."""
    return rollout_with_mask(mask)


def advantages(est, rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token advantages from `build_batch` on sequence rewards, without a reference (so without KL)."""
    inputs = StepInputs(make_rollout(mask), rewards, torch.zeros(mask.shape), None, None, est.group_size)
    batch, _ = est.build_batch(inputs)
    return batch.tensors["advantages"]


def policy_loss(est, logp, old_logp, ref_logp, adv, mask, denominator, entropy=None):
    """(loss, metrics) of `est.loss` on one micro batch built from plain tensors; the value loss must be None."""
    tensors = {"old_logp": old_logp, "advantages": adv}
    if ref_logp is not None:
        tensors["ref_logp"] = ref_logp
    loss, value_loss, metrics = est.loss(TrainBatch(make_rollout(mask), tensors), Forward(logp, entropy), denominator)
    assert value_loss is None
    return loss, metrics


# --- registry ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, cls", [("grpo", GRPO), ("reinforce", Reinforce), ("rloo", RLOO)])
def test_estimators_resolve_by_name(name, cls):
    """`registry.resolve('estimator', name)` returns the estimator class; `build` calls it with cfg=."""
    assert registry.resolve("estimator", name) is cls
    assert name in registry.names("estimator")
    est = registry.build("estimator", name, cfg=make_cfg(estimator=name))
    assert isinstance(est, cls) and isinstance(est, PolicyGradientEstimator)


def test_estimator_accepts_an_omegaconf_config():
    """A structured OmegaConf AlgorithmConfig works like the namespace: G=2 group [0, 4] -> [-2, 2]."""
    cfg = OmegaConf.structured(AlgorithmConfig(estimator="grpo", num_samples_per_prompt=2, norm_adv_by_std=False))
    est = registry.build("estimator", "grpo", cfg=cfg, gen_cfg=OmegaConf.structured(GeneratorConfig()))
    assert est.group_size == 2
    assert_close(advantages(est, torch.tensor([0.0, 4.0]), torch.ones(2, 1)), torch.tensor([[-2.0], [2.0]]))


def test_needs_reference_follows_beta():
    """The reference model is only needed when beta > 0."""
    assert GRPO(make_cfg(beta=0.0)).needs_reference is False
    assert GRPO(make_cfg(beta=0.1)).needs_reference is True


# --- shape_rewards ----------------------------------------------------------------------------------

SCORES = torch.tensor([1.0, 2.0])
KL = torch.tensor([[0.5, 0.25, BIG], [1.0, BIG, BIG]])
KL_MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def test_shape_rewards_with_kl_in_reward():
    """non_score = -beta * summed valid KL = -0.1 * [0.75, 1.0] = [-0.075, -0.1]; reward = score + it."""
    est = GRPO(make_cfg(beta=0.1, kl_in_reward=True))
    rewards, non_score = est.shape_rewards(SCORES, KL, KL_MASK)
    assert_close(non_score, torch.tensor([-0.075, -0.1]))
    assert_close(rewards, torch.tensor([0.925, 1.9]))


def test_shape_rewards_without_kl_in_reward():
    """kl_in_reward false: scores pass through, non-score reward is 0."""
    est = GRPO(make_cfg(beta=0.1, kl_in_reward=False))
    rewards, non_score = est.shape_rewards(SCORES, KL, KL_MASK)
    assert_close(rewards, SCORES)
    assert_close(non_score, torch.zeros(2))


def test_shape_rewards_without_reference_kl():
    """kl None (no reference model): scores pass through even with kl_in_reward true."""
    rewards, non_score = GRPO(make_cfg(beta=0.1, kl_in_reward=True)).shape_rewards(SCORES, None, KL_MASK)
    assert_close(rewards, SCORES)
    assert_close(non_score, torch.zeros(2))


# --- advantages -------------------------------------------------------------------------------------

# Row 1 is a short sequence between long ones; row 3 is fully masked.
ADV_MASK = torch.tensor(
    [
        [1.0, 1.0, 0.0],
        [1.0, 0.0, 0.0],
        [1.0, 1.0, 1.0],
        [0.0, 0.0, 0.0],
    ]
)


def test_grpo_advantages_per_token():
    """G=2, rewards [0, 4 | 1, 1]: group 1 -> -+2 / sqrt(8) = -+0.7071068, constant group 2 -> 0."""
    adv = advantages(GRPO(make_cfg(num_samples_per_prompt=2)), torch.tensor([0.0, 4.0, 1.0, 1.0]), ADV_MASK)
    s = 0.7071068
    expected = torch.tensor([[-s, -s, 0.0], [s, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert adv.shape == (4, 3)
    assert_close(adv, expected, atol=1e-5, rtol=0)


def test_grpo_advantages_without_std():
    """norm_adv_by_std false: rewards [0, 4 | 1, 1] -> [-2, 2 | 0, 0] on valid tokens."""
    est = GRPO(make_cfg(num_samples_per_prompt=2, norm_adv_by_std=False))
    adv = advantages(est, torch.tensor([0.0, 4.0, 1.0, 1.0]), ADV_MASK)
    expected = torch.tensor([[-2.0, -2.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert_close(adv, expected)


def test_reinforce_advantages():
    """Batch baseline: [1, 2, 6] - 3 = [-2, -1, 3], spread over valid tokens."""
    mask = ADV_MASK[:3]
    adv = advantages(Reinforce(make_cfg(estimator="reinforce")), torch.tensor([1.0, 2.0, 6.0]), mask)
    assert_close(adv, torch.tensor([[-2.0, -2.0, 0.0], [-1.0, 0.0, 0.0], [3.0, 3.0, 3.0]]))


def test_reinforce_whitened_advantages():
    """[-2, -1, 3]: mean 0, unbiased var (4 + 1 + 9) / 2 = 7 -> divided by sqrt 7 = 2.6457513."""
    est = Reinforce(make_cfg(estimator="reinforce", whiten_advantages=True))
    adv = est.sequence_advantages(torch.tensor([1.0, 2.0, 6.0]))
    assert_close(adv, torch.tensor([-0.7559289, -0.3779645, 1.1338934]), atol=1e-5, rtol=0)


def test_rloo_advantages():
    """G=2: the other sample is the baseline: [5, 1 | 2, 2] -> [4, -4 | 0, 0]."""
    est = RLOO(make_cfg(estimator="rloo", num_samples_per_prompt=2))
    adv = advantages(est, torch.tensor([5.0, 1.0, 2.0, 2.0]), ADV_MASK)
    expected = torch.tensor([[4.0, 4.0, 0.0], [-4.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert_close(adv, expected)


def test_rloo_whitened_advantages():
    """[4, -4, 0, 0]: unbiased var 32 / 3, std 3.2659863 -> 4 / 3.2659863 = 1.2247449."""
    est = RLOO(make_cfg(estimator="rloo", num_samples_per_prompt=2, whiten_advantages=True))
    adv = est.sequence_advantages(torch.tensor([5.0, 1.0, 2.0, 2.0]))
    assert_close(adv, torch.tensor([1.2247449, -1.2247449, 0.0, 0.0]), atol=1e-5, rtol=0)


# --- policy_loss ------------------------------------------------------------------------------------

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


def test_policy_loss_token_mean_and_metrics():
    """token_mean over 3 valid tokens: (-1.1 - 1.2 + 0.8) / 3 = -0.5.

    clipfrac 2/3; ratio (1.1 + 1.5 + 0.5) / 3 = 1.0333333;
    approxkl 0.5 * (ln^2 1.1 + ln^2 1.5 + ln^2 0.5) / 3 = 0.5 * (0.0090840 + 0.1644020 + 0.4804530) / 3 = 0.1089898.
    """
    est = GRPO(make_cfg(loss_agg="token_mean"))
    logp, old_logp, _ = _inputs()
    loss, metrics = policy_loss(est, logp, old_logp, None, ADV, MASK, torch.tensor(3.0))
    assert_close(loss, torch.tensor(-0.5))
    assert set(metrics) == {"loss/policy_avg", "policy/approxkl_avg", "policy/clipfrac_avg", "val/ratio"}
    assert_close(metrics["loss/policy_avg"], torch.tensor(-0.5))
    assert_close(metrics["policy/clipfrac_avg"], torch.tensor(2.0 / 3.0))
    assert_close(metrics["val/ratio"], torch.tensor(1.0333333))
    assert_close(metrics["policy/approxkl_avg"], torch.tensor(0.1089898), atol=1e-6, rtol=0)


def test_policy_loss_seq_mean_token_mean():
    """Sequence means (-1.1 - 1.2) / 2 = -1.15 and 0.8 / 1; (-1.15 + 0.8) / 2 sequences = -0.175."""
    est = GRPO(make_cfg(loss_agg="seq_mean_token_mean"))
    logp, old_logp, _ = _inputs()
    loss, _ = policy_loss(est, logp, old_logp, None, ADV, MASK, torch.tensor(2.0))
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
    est = GRPO(make_cfg(beta=0.1, kl_in_reward=False, kl_estimator=estimator))
    logp, old_logp, ref_logp = _inputs()
    loss, metrics = policy_loss(est, logp, old_logp, ref_logp, ADV, MASK, torch.tensor(3.0))
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
    est = GRPO(make_cfg(**overrides))
    logp, old_logp, ref_logp = _inputs()
    loss, metrics = policy_loss(est, logp, old_logp, ref_logp if with_ref else None, ADV, MASK, torch.tensor(3.0))
    assert "loss/kl_avg" not in metrics
    assert_close(loss, torch.tensor(-0.5))


def test_policy_loss_ignores_masked_positions():
    """Different garbage in masked logp / old_logp / ref_logp changes neither loss nor any metric."""
    est = GRPO(make_cfg(beta=0.1, kl_estimator="k3"))
    results = []
    for garbage in (0.0, 3.0, -20.0):
        logp, old_logp, ref_logp = _inputs(garbage)
        results.append(policy_loss(est, logp, old_logp, ref_logp, ADV, MASK, torch.tensor(3.0)))
    for loss, metrics in results[1:]:
        assert_close(loss, results[0][0])
        for key, value in metrics.items():
            assert_close(value, results[0][1][key])


def test_policy_loss_gradient_and_detached_metrics():
    """Loss is differentiable in logp; metrics are detached.

    With A = 0 the surrogate has zero gradient and k1 KL gives beta / denominator = 0.1 / 3 per valid token.
    """
    est = GRPO(make_cfg(beta=0.1, kl_estimator="k1"))
    logp, old_logp, ref_logp = _inputs()
    logp.requires_grad_(True)
    loss, metrics = policy_loss(est, logp, old_logp, ref_logp, torch.zeros(2, 3), MASK, torch.tensor(3.0))
    loss.backward()
    assert_close(logp.grad, MASK * (0.1 / 3.0))
    assert all(not value.requires_grad for value in metrics.values())


def test_policy_loss_micro_batches_sum_to_mini_batch():
    """Rows fed one at a time with the mini-batch denominator sum to the whole-batch loss (-0.5 - 1/60)."""
    est = GRPO(make_cfg(beta=0.1, kl_estimator="k1"))
    logp, old_logp, ref_logp = _inputs()
    batch = TrainBatch(make_rollout(MASK), {"old_logp": old_logp, "advantages": ADV, "ref_logp": ref_logp})
    denominator = est.denominator(batch)
    assert_close(denominator, torch.tensor(3.0))
    whole, _, _ = est.loss(batch, Forward(logp), denominator)
    units = [torch.tensor([0]), torch.tensor([1])]
    parts = [est.loss(batch.select_units(u), Forward(logp[u]), denominator)[0] for u in units]
    assert_close(sum(parts), whole)
    assert_close(whole, torch.tensor(-0.5 + 0.1 * (-1.0 / 6.0)))


# --- flags and denominators ---------------------------------------------------------------------------


def test_policy_gradient_flags():
    """No critic; pre-update logprobs always; entropy in the training forward only with an entropy bonus."""
    est = GRPO(make_cfg())
    assert est.needs_critic is False and est.needs_old_logprobs is True and est.needs_entropy is False
    assert GRPO(make_cfg(entropy_coef=0.01)).needs_entropy is True


def test_kl_controller_follows_config():
    """kl_ctl fixed gives a FixedKLController at beta; adaptive an AdaptiveKLController with target and horizon."""
    fixed = GRPO(make_cfg(beta=0.1)).kl_ctl
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.1
    adaptive = GRPO(make_cfg(beta=0.1, kl_ctl="adaptive", target_kl=2.0, kl_horizon=50)).kl_ctl
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
        ("seq_mean_token_sum_norm", None, None, 2.0),  # no generator config: constant 1
    ],
)
def test_denominator_per_aggregation(loss_agg, loss_agg_norm, max_new_tokens, expected):
    """The mini-batch denominator on MASK (rows of 2 and 1 valid tokens) for each loss aggregation."""
    gen_cfg = OmegaConf.structured(GeneratorConfig(max_new_tokens=max_new_tokens)) if max_new_tokens else None
    est = GRPO(make_cfg(loss_agg=loss_agg, loss_agg_norm=loss_agg_norm), gen_cfg)
    batch = TrainBatch(make_rollout(MASK), {"old_logp": torch.zeros(2, 3), "advantages": ADV})
    assert_close(est.denominator(batch).float(), torch.tensor(expected))


@pytest.mark.parametrize(
    "loss_agg, expected",
    [
        ("seq_mean_token_sum", -0.75),  # sequence sums (-1.1 - 1.2) = -2.3 and 0.8 -> -1.5 / 2
        ("seq_mean_token_sum_norm", -0.09375),  # -1.5 / (2 sequences * max_new_tokens 8)
    ],
)
def test_policy_loss_token_sum_aggregations(loss_agg, expected):
    """The surrogate summed per sequence, divided by the estimator's own denominator."""
    est = GRPO(make_cfg(loss_agg=loss_agg), OmegaConf.structured(GeneratorConfig(max_new_tokens=8)))
    logp, old_logp, _ = _inputs()
    batch = TrainBatch(make_rollout(MASK), {"old_logp": old_logp, "advantages": ADV})
    loss, _, _ = est.loss(batch, Forward(logp), est.denominator(batch))
    assert_close(loss, torch.tensor(expected))


# --- clip variants through the config -----------------------------------------------------------------


def test_clip_eps_high_from_config():
    """clip_eps_high 0.6: A=+1 r=1.5 is no longer clipped -> (-1.1 - 1.5 + 0.8) / 3 = -0.6, clipfrac 1/3."""
    est = GRPO(make_cfg(clip_eps_high=0.6))
    logp, old_logp, _ = _inputs()
    loss, metrics = policy_loss(est, logp, old_logp, None, ADV, MASK, torch.tensor(3.0))
    assert_close(loss, torch.tensor(-0.6))
    assert_close(metrics["policy/clipfrac_avg"], torch.tensor(1.0 / 3.0))


def test_dual_clip_c_from_config():
    """A=-1, r=5: max(5, 1.2) = 5 without dual-clip; dual_clip_c 3 caps it at 3 and counts it as clipped."""
    mask, adv, logp = torch.ones(1, 1), -torch.ones(1, 1), torch.tensor([[math.log(5.0)]])
    old_logp, denominator = torch.zeros(1, 1), torch.tensor(1.0)
    plain, plain_metrics = policy_loss(GRPO(make_cfg()), logp, old_logp, None, adv, mask, denominator)
    dual, dual_metrics = policy_loss(GRPO(make_cfg(dual_clip_c=3.0)), logp, old_logp, None, adv, mask, denominator)
    assert_close(plain, torch.tensor(5.0))
    assert_close(dual, torch.tensor(3.0))
    assert plain_metrics["policy/clipfrac_avg"].item() == 0.0 and dual_metrics["policy/clipfrac_avg"].item() == 1.0


# --- build_batch: KL in the reward, KL metrics --------------------------------------------------------

# Pre-update and reference logprobs whose k1 KL at valid tokens is KL above ([0.5, 0.25], [1.0]); garbage elsewhere.
OLD_LOGP = torch.tensor([[-1.0, -2.0, 9.0], [-0.5, 9.0, 9.0]])
REF_LOGP = torch.tensor([[-1.5, -2.25, -9.0], [-1.5, -9.0, -9.0]])


def build(est, old_logp=OLD_LOGP, ref_logp=REF_LOGP, scores=SCORES):
    """`est.build_batch` on the two-row KL example."""
    return est.build_batch(StepInputs(make_rollout(KL_MASK), scores, old_logp, ref_logp, None, est.group_size))


def test_build_batch_with_kl_in_reward():
    """Reinforce, beta 0.1, k1 KL in the reward: shaped rewards, advantages and KL metrics."""
    # Reinforce, beta 0.1, k1: rewards [1 - 0.075, 2 - 0.1] = [0.925, 1.9], mean 1.4125 -> advantages -+0.4875.
    # non_score_reward mean (-0.075 - 0.1) / 2 = -0.0875; objective/kl = (0.75 + 1.0) / 2 = 0.875.
    est = Reinforce(make_cfg(estimator="reinforce", beta=0.1, kl_in_reward=True, kl_estimator="k1"))
    batch, metrics = build(est)
    assert_close(batch.tensors["advantages"], torch.tensor([[-0.4875, -0.4875, 0.0], [0.4875, 0.0, 0.0]]))
    assert metrics["objective/rlhf_reward"] == pytest.approx(1.4125)
    assert metrics["objective/non_score_reward"] == pytest.approx(-0.0875)
    assert metrics["objective/kl"] == pytest.approx(0.875)
    assert metrics["objective/kl_coef"] == pytest.approx(0.1)
    assert batch.tensors["old_logp"] is OLD_LOGP and batch.tensors["ref_logp"] is REF_LOGP
    assert batch.rows_per_unit == 1 and batch.num_units == 2


def test_build_batch_with_kl_as_a_loss_reports_kl_but_keeps_rewards():
    """kl_in_reward false: rewards are the scores [1, 2] -> advantages -+0.5; objective/kl is still 0.875."""
    est = Reinforce(make_cfg(estimator="reinforce", beta=0.1, kl_in_reward=False, kl_estimator="k1"))
    batch, metrics = build(est)
    assert_close(batch.tensors["advantages"], torch.tensor([[-0.5, -0.5, 0.0], [0.5, 0.0, 0.0]]))
    assert metrics["objective/rlhf_reward"] == pytest.approx(1.5)
    assert metrics["objective/non_score_reward"] == 0.0
    assert metrics["objective/kl"] == pytest.approx(0.875)


def test_build_batch_k3_kl_in_reward():
    """k3 KL in the reward: objective/kl and non_score_reward from k3 sums."""
    # k3 at x = [0.5, 0.25] and [1.0]: [0.1065307 + 0.0288008, 0.3678794] -> kl sums [0.1353315, 0.3678794];
    # non_score = -0.1 * them, mean -0.0251605; objective/kl = 0.2516055.
    est = Reinforce(make_cfg(estimator="reinforce", beta=0.1, kl_in_reward=True, kl_estimator="k3"))
    _, metrics = build(est)
    assert metrics["objective/kl"] == pytest.approx(0.2516055, abs=1e-6)
    assert metrics["objective/non_score_reward"] == pytest.approx(-0.0251605, abs=1e-6)
    assert metrics["objective/rlhf_reward"] == pytest.approx(1.5 - 0.0251605, abs=1e-6)


def test_build_batch_without_reference_has_no_kl():
    """beta 0: no reference, no KL metrics, no ref_logp tensor; rewards are the scores."""
    est = Reinforce(make_cfg(estimator="reinforce", beta=0.0))
    assert est.needs_reference is False
    batch, metrics = build(est, ref_logp=None)
    assert set(metrics) == {"objective/rlhf_reward", "objective/non_score_reward"}
    assert set(batch.tensors) == {"old_logp", "advantages"}
    assert_close(batch.tensors["advantages"], torch.tensor([[-0.5, -0.5, 0.0], [0.5, 0.0, 0.0]]))


@pytest.mark.parametrize("garbage", [0.0, 3.0, -20.0, float("nan")])
def test_build_batch_ignores_masked_logprobs(garbage):
    """Any garbage (even NaN) in masked old/ref logprobs leaves advantages and metrics as with clean inputs."""
    est = GRPO(make_cfg(num_samples_per_prompt=2, beta=0.1, kl_in_reward=True, kl_estimator="k3"))
    clean_batch, clean_metrics = build(est)
    dirty = lambda x, g: torch.where(KL_MASK.bool(), x, torch.full_like(x, g))  # noqa: E731
    batch, metrics = build(est, dirty(OLD_LOGP, garbage), dirty(REF_LOGP, -garbage))
    assert_close(batch.tensors["advantages"], clean_batch.tensors["advantages"])
    assert metrics == pytest.approx(clean_metrics)


def test_adaptive_kl_coefficient_moves_between_steps():
    """The adaptive KL coefficient used by build_batch moves after every step."""
    # target 0.5, horizon 20, 2 samples, measured KL 0.875: error 0.75 clipped to 0.2 -> coef * (1 + 0.2 * 2 / 20).
    # Step 1 uses 0.1 (non_score mean -0.0875), then 0.102; step 2 uses 0.102: -0.102 * (0.75 + 1.0) / 2 = -0.08925,
    # then 0.102 * 1.02 = 0.10404.
    est = Reinforce(make_cfg(estimator="reinforce", beta=0.1, kl_in_reward=True, kl_estimator="k1",
                             kl_ctl="adaptive", target_kl=0.5, kl_horizon=20))
    _, first = build(est)
    assert first["objective/kl_coef"] == pytest.approx(0.1)
    assert first["objective/non_score_reward"] == pytest.approx(-0.0875)
    assert est.kl_ctl.value == pytest.approx(0.102)
    _, second = build(est)
    assert second["objective/kl_coef"] == pytest.approx(0.102)
    assert second["objective/non_score_reward"] == pytest.approx(-0.08925)
    assert est.kl_ctl.value == pytest.approx(0.10404)


def test_adaptive_kl_coefficient_shrinks_below_target():
    """target 2.0: error 0.875 / 2 - 1 = -0.5625 clipped to -0.2 -> 0.1 * (1 - 0.2 * 2 / 20) = 0.098."""
    est = Reinforce(make_cfg(estimator="reinforce", beta=0.1, kl_estimator="k1",
                             kl_ctl="adaptive", target_kl=2.0, kl_horizon=20))
    build(est)
    assert est.kl_ctl.value == pytest.approx(0.098)


def test_kl_loss_uses_the_coefficient_of_its_step_and_the_next_step_the_adapted_one():
    """A step's loss uses the coefficient its build_batch logged (0.1); the adaptive update (to 0.102) is the next step's."""
    est = GRPO(make_cfg(num_samples_per_prompt=2, beta=0.1, kl_in_reward=False, kl_estimator="k1",
                        kl_ctl="adaptive", target_kl=0.5, kl_horizon=20))
    _, metrics_step = build(est)
    assert metrics_step["objective/kl_coef"] == pytest.approx(0.1)
    logp, old_logp, ref_logp = _inputs()
    loss, metrics = policy_loss(est, logp, old_logp, ref_logp, ADV, MASK, torch.tensor(3.0))
    assert_close(metrics["loss/kl_avg"], torch.tensor(-1.0 / 6.0))
    assert_close(loss, torch.tensor(-0.5 + 0.1 * (-1.0 / 6.0)))
    build(est)  # the next step
    loss, _ = policy_loss(est, logp, old_logp, ref_logp, ADV, MASK, torch.tensor(3.0))
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
    est = GRPO(make_cfg(entropy_coef=0.01, loss_agg=loss_agg))
    logp, old_logp, _ = _inputs()
    loss, metrics = policy_loss(est, logp, old_logp, None, ADV, MASK, torch.tensor(denominator), ENTROPY)
    assert_close(metrics["loss/entropy_avg"], torch.tensor(entropy))
    assert_close(metrics["loss/policy_avg"], torch.tensor(surrogate))
    assert_close(loss, torch.tensor(surrogate - 0.01 * entropy))


def test_entropy_bonus_gradient():
    """d loss / d entropy = -entropy_coef / denominator = -0.01 / 3 on valid tokens, 0 elsewhere."""
    est = GRPO(make_cfg(entropy_coef=0.01))
    logp, old_logp, _ = _inputs()
    entropy = ENTROPY.clone().requires_grad_(True)
    loss, _ = policy_loss(est, logp, old_logp, None, ADV, MASK, torch.tensor(3.0), entropy)
    loss.backward()
    assert_close(entropy.grad, MASK * (-0.01 / 3.0))


def test_no_entropy_term_without_coefficient():
    """entropy_coef 0: a given entropy is ignored; the loss is the bare surrogate -0.5."""
    logp, old_logp, _ = _inputs()
    loss, metrics = policy_loss(GRPO(make_cfg()), logp, old_logp, None, ADV, MASK, torch.tensor(3.0), ENTROPY)
    assert "loss/entropy_avg" not in metrics
    assert_close(loss, torch.tensor(-0.5))


# --- truncated importance sampling (algorithm.tis_clip) -------------------------------------------------


def test_tis_weights_each_token_loss_by_the_truncated_trainer_generator_ratio():
    """Ratio 1 everywhere (logp = old_logp), so the surrogate is -A per token; with tis_clip=2 and generator
    logprobs giving ratios [e^0.5, 4 -> 2] and [1], the token-mean loss is -(1*e^0.5 + 1*2 + (-1)*1) / 3."""
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    rollout = make_rollout(mask)
    old_logp = torch.tensor([[-1.0, -1.0], [-1.0, 0.0]])
    rollout.logprobs = torch.tensor([[-1.5, -1.0 - math.log(4.0)], [-1.0, 0.0]])
    est = GRPO(make_cfg(tis_clip=2.0, num_samples_per_prompt=2, norm_adv_by_std=False, loss_agg="token_mean", beta=0.0))
    batch, metrics = est.build_batch(StepInputs(rollout, torch.tensor([1.0, -1.0]), old_logp, None, None, 2))
    assert_close(batch.tensors["is_weights"], torch.tensor([[math.exp(0.5), 2.0], [1.0, 0.0]]))
    assert metrics["val/is_clipfrac"] == pytest.approx(1 / 3)
    assert metrics["val/is_weight_mean"] == pytest.approx((math.exp(0.5) + 2.0 + 1.0) / 3)
    loss, _, _ = est.loss(batch, Forward(old_logp.clone()), est.denominator(batch))
    assert loss.item() == pytest.approx(-(math.exp(0.5) + 2.0 - 1.0) / 3, rel=1e-6)


def test_tis_off_adds_no_weights_and_leaves_the_loss_alone():
    mask = torch.ones(2, 2)
    rollout = make_rollout(mask)
    rollout.logprobs = torch.full((2, 2), -3.0)  # far from the trainer: would matter if TIS were on
    est = GRPO(make_cfg(num_samples_per_prompt=2, beta=0.0))
    batch, metrics = est.build_batch(StepInputs(rollout, torch.tensor([1.0, 0.0]), torch.zeros(2, 2), None, None, 2))
    assert "is_weights" not in batch.tensors and "val/is_weight_mean" not in metrics
