"""Policy-gradient estimators: reward shaping, build_batch (advantages, KL metrics), loss and metrics, registry."""

import math
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from torch.testing import assert_close

from rlhf import registry
from rlhf.config.schema import AlgorithmConfig, GeneratorConfig
from rlhf.estimators import GRPO, RLOO, Forward, PolicyGradientEstimator, Reinforce, StepInputs, TrainBatch
from rlhf.functional import AdaptiveKLController, FixedKLController
from rlhf.generators.base import Rollout

BIG = 1e6


def make_cfg(**overrides):
    """A plain namespace with every AlgorithmConfig field (schema defaults, then overrides)."""
    fields = asdict(AlgorithmConfig(estimator="grpo"))
    fields.update(overrides)
    return SimpleNamespace(**fields)


def make_rollout(mask: torch.Tensor) -> Rollout:
    """A rollout with the given response mask; token ids do not matter to the estimators."""
    rows, length = mask.shape
    return Rollout(
        query_ids=torch.ones(rows, 2, dtype=torch.long),
        query_mask=torch.ones(rows, 2, dtype=torch.long),
        response_ids=torch.ones(rows, length, dtype=torch.long),
        response_mask=mask,
        logprobs=torch.zeros(rows, length),
        stopped=torch.ones(rows, dtype=torch.bool),
    )


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
