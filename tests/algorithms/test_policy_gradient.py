"""Policy-gradient algorithms: registry, reward shaping, advantages, prepare (KL in the reward, KL metrics,
adaptive KL) and truncated importance sampling."""

import math

import pytest
import torch
from torch.testing import assert_close

from algorithm_fixtures import KL_MASK, OLD_LOGP, REF_LOGP, SCORES, build_kl_example, make_algorithm, trajectories
from rlhf import registry
from rlhf.config.compose import compose_config
from rlhf.algorithms import AdvantageInputs, PolicyGradient, advantages as advantage_parts, build_algorithm
from rlhf.trajectory import Forward

BIG = 1e6


def advantages(algo, rewards: torch.Tensor, mask: torch.Tensor, group: int = 1) -> torch.Tensor:
    """Per-token advantages from `prepare` on sequence rewards, without a reference (so without KL)."""
    batch, _ = algo.prepare(trajectories(mask, group, scores=rewards, old_logp=torch.zeros(mask.shape)))
    return batch.advantages


# --- registry ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["grpo", "reinforce", "rloo"])
def test_advantages_resolve_by_name(name):
    """`registry.resolve('advantage', name)` returns the estimator; `build_algorithm` composes a PolicyGradient."""
    assert registry.resolve("advantage", name) is getattr(advantage_parts, name)
    assert name in registry.names("advantage")
    algo = make_algorithm(advantage=name)
    assert isinstance(algo, PolicyGradient) and algo.advantage.obj is getattr(advantage_parts, name)


def test_algorithm_accepts_an_omegaconf_config():
    """The composed `algorithm` node (parts chosen by group) builds the algorithm: G=2 group [0, 4] -> [-2, 2]."""
    cfg = compose_config(["algorithm=dr_grpo", "algorithm.num_samples_per_prompt=2"])
    algo = build_algorithm(cfg.algorithm, cfg.generator.max_new_tokens)
    assert_close(advantages(algo, torch.tensor([0.0, 4.0]), torch.ones(2, 1), group=2), torch.tensor([[-2.0], [2.0]]))


def test_needs_reference_follows_beta():
    """The reference model is only needed when beta > 0."""
    assert make_algorithm(beta=0.0).needs_reference is False
    assert make_algorithm(beta=0.1).needs_reference is True


# --- reward shaping (AdvantageInputs) -----------------------------------------------------------------

KL = torch.tensor([[0.5, 0.25, BIG], [1.0, BIG, BIG]])


def shape_rewards(algo, kl):
    """(sequence rewards, non-score rewards) as the algorithm's advantage estimator sees them."""
    inputs = AdvantageInputs(SCORES, KL_MASK, 1, kl, algo.kl_coef, algo.cfg.kl_in_reward)
    return inputs.sequence_rewards(), inputs.non_score_rewards()


def test_shape_rewards_with_kl_in_reward():
    """non_score = -beta * summed valid KL = -0.1 * [0.75, 1.0] = [-0.075, -0.1]; reward = score + it."""
    rewards, non_score = shape_rewards(make_algorithm(beta=0.1, kl_in_reward=True), KL)
    assert_close(non_score, torch.tensor([-0.075, -0.1]))
    assert_close(rewards, torch.tensor([0.925, 1.9]))


def test_shape_rewards_without_kl_in_reward():
    """kl_in_reward false: scores pass through, non-score reward is 0."""
    rewards, non_score = shape_rewards(make_algorithm(beta=0.1, kl_in_reward=False), KL)
    assert_close(rewards, SCORES)
    assert_close(non_score, torch.zeros(2))


def test_shape_rewards_without_reference_kl():
    """kl None (no reference model): scores pass through even with kl_in_reward true."""
    rewards, non_score = shape_rewards(make_algorithm(beta=0.1, kl_in_reward=True), None)
    assert_close(rewards, SCORES)
    assert_close(non_score, torch.zeros(2))


# --- advantages -------------------------------------------------------------------------------------

# Row 1 is a short sequence between long ones; row 3 is fully masked.
ADV_MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])


def test_grpo_advantages_per_token():
    """G=2, rewards [0, 4 | 1, 1]: group 1 -> -+2 / sqrt(8) = -+0.7071068, constant group 2 -> 0."""
    algo = make_algorithm(num_samples_per_prompt=2)
    adv = advantages(algo, torch.tensor([0.0, 4.0, 1.0, 1.0]), ADV_MASK, group=2)
    s = 0.7071068
    expected = torch.tensor([[-s, -s, 0.0], [s, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert adv.shape == (4, 3)
    assert_close(adv, expected, atol=1e-5, rtol=0)


def test_grpo_advantages_without_std():
    """norm_adv_by_std false: rewards [0, 4 | 1, 1] -> [-2, 2 | 0, 0] on valid tokens."""
    algo = make_algorithm(num_samples_per_prompt=2, norm_adv_by_std=False)
    adv = advantages(algo, torch.tensor([0.0, 4.0, 1.0, 1.0]), ADV_MASK, group=2)
    expected = torch.tensor([[-2.0, -2.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert_close(adv, expected)


def test_reinforce_advantages():
    """Batch baseline: [1, 2, 6] - 3 = [-2, -1, 3], spread over valid tokens."""
    adv = advantages(make_algorithm(advantage="reinforce", whiten_advantages=False), torch.tensor([1.0, 2.0, 6.0]), ADV_MASK[:3])
    assert_close(adv, torch.tensor([[-2.0, -2.0, 0.0], [-1.0, 0.0, 0.0], [3.0, 3.0, 3.0]]))


def test_reinforce_whitened_advantages():
    """[-2, -1, 3]: mean 0, unbiased var (4 + 1 + 9) / 2 = 7 -> divided by sqrt 7 = 2.6457513."""
    algo = make_algorithm(advantage="reinforce", whiten_advantages=True)
    adv = advantages(algo, torch.tensor([1.0, 2.0, 6.0]), torch.ones(3, 1))[:, 0]
    assert_close(adv, torch.tensor([-0.7559289, -0.3779645, 1.1338934]), atol=1e-5, rtol=0)


def test_rloo_advantages():
    """G=2: the other sample is the baseline: [5, 1 | 2, 2] -> [4, -4 | 0, 0]."""
    algo = make_algorithm(advantage="rloo", num_samples_per_prompt=2)
    adv = advantages(algo, torch.tensor([5.0, 1.0, 2.0, 2.0]), ADV_MASK, group=2)
    expected = torch.tensor([[4.0, 4.0, 0.0], [-4.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert_close(adv, expected)


def test_rloo_whitened_advantages():
    """[4, -4, 0, 0]: unbiased var 32 / 3, std 3.2659863 -> 4 / 3.2659863 = 1.2247449."""
    algo = make_algorithm(advantage="rloo", num_samples_per_prompt=2, whiten_advantages=True)
    adv = advantages(algo, torch.tensor([5.0, 1.0, 2.0, 2.0]), torch.ones(4, 1), group=2)[:, 0]
    assert_close(adv, torch.tensor([1.2247449, -1.2247449, 0.0, 0.0]), atol=1e-5, rtol=0)


# --- prepare: KL in the reward, KL metrics --------------------------------------------------------


def test_prepare_with_kl_in_reward():
    """Reinforce, beta 0.1, k1 KL in the reward: shaped rewards, advantages and KL metrics."""
    # Reinforce, beta 0.1, k1: rewards [1 - 0.075, 2 - 0.1] = [0.925, 1.9], mean 1.4125 -> advantages -+0.4875.
    # non_score_reward mean (-0.075 - 0.1) / 2 = -0.0875; objective/kl = (0.75 + 1.0) / 2 = 0.875.
    algo = make_algorithm(advantage="reinforce", whiten_advantages=False, beta=0.1, kl_in_reward=True, kl_estimator="k1")
    batch, metrics = build_kl_example(algo)
    assert_close(batch.advantages, torch.tensor([[-0.4875, -0.4875, 0.0], [0.4875, 0.0, 0.0]]))
    assert metrics["objective/rlhf_reward"] == pytest.approx(1.4125)
    assert metrics["objective/non_score_reward"] == pytest.approx(-0.0875)
    assert metrics["objective/kl"] == pytest.approx(0.875)
    assert metrics["objective/kl_coef"] == pytest.approx(0.1)
    assert batch.old_logp is OLD_LOGP and batch.ref_logp is REF_LOGP
    assert batch.rows_per_unit == 1 and batch.num_units == 2


def test_prepare_with_kl_as_a_loss_reports_kl_but_keeps_rewards():
    """kl_in_reward false: rewards are the scores [1, 2] -> advantages -+0.5; objective/kl is still 0.875."""
    algo = make_algorithm(advantage="reinforce", whiten_advantages=False, beta=0.1, kl_in_reward=False, kl_estimator="k1")
    batch, metrics = build_kl_example(algo)
    assert_close(batch.advantages, torch.tensor([[-0.5, -0.5, 0.0], [0.5, 0.0, 0.0]]))
    assert metrics["objective/rlhf_reward"] == pytest.approx(1.5)
    assert metrics["objective/non_score_reward"] == 0.0
    assert metrics["objective/kl"] == pytest.approx(0.875)


def test_prepare_k3_kl_in_reward():
    """k3 KL in the reward: objective/kl and non_score_reward from k3 sums."""
    # k3 at x = [0.5, 0.25] and [1.0]: [0.1065307 + 0.0288008, 0.3678794] -> kl sums [0.1353315, 0.3678794];
    # non_score = -0.1 * them, mean -0.0251605; objective/kl = 0.2516055.
    _, metrics = build_kl_example(make_algorithm(advantage="reinforce", whiten_advantages=False, beta=0.1, kl_in_reward=True, kl_estimator="k3"))
    assert metrics["objective/kl"] == pytest.approx(0.2516055, abs=1e-6)
    assert metrics["objective/non_score_reward"] == pytest.approx(-0.0251605, abs=1e-6)
    assert metrics["objective/rlhf_reward"] == pytest.approx(1.5 - 0.0251605, abs=1e-6)


def test_prepare_without_reference_has_no_kl():
    """beta 0: no reference, no KL metrics, no ref_logp tensor; rewards are the scores."""
    algo = make_algorithm(advantage="reinforce", whiten_advantages=False, beta=0.0)
    assert algo.needs_reference is False
    batch, metrics = build_kl_example(algo, ref_logp=None)
    assert set(metrics) == {"objective/rlhf_reward", "objective/non_score_reward"}
    assert batch.old_logp is OLD_LOGP and batch.ref_logp is None and batch.returns is None and batch.extras == {}
    assert_close(batch.advantages, torch.tensor([[-0.5, -0.5, 0.0], [0.5, 0.0, 0.0]]))


@pytest.mark.parametrize("garbage", [0.0, 3.0, -20.0, float("nan")])
def test_prepare_ignores_masked_logprobs(garbage):
    """Any garbage (even NaN) in masked old/ref logprobs leaves advantages and metrics as with clean inputs."""
    algo = make_algorithm(num_samples_per_prompt=2, beta=0.1, kl_in_reward=True, kl_estimator="k3")
    clean_batch, clean_metrics = build_kl_example(algo, group=2)
    dirty = lambda x, g: torch.where(KL_MASK.bool(), x, torch.full_like(x, g))  # noqa: E731
    batch, metrics = build_kl_example(algo, dirty(OLD_LOGP, garbage), dirty(REF_LOGP, -garbage), group=2)
    assert_close(batch.advantages, clean_batch.advantages)
    assert metrics == pytest.approx(clean_metrics)


def test_adaptive_kl_coefficient_moves_between_steps():
    """The adaptive KL coefficient used by prepare moves after every step."""
    # target 0.5, horizon 20, 2 samples, measured KL 0.875: error 0.75 clipped to 0.2 -> coef * (1 + 0.2 * 2 / 20).
    # Step 1 uses 0.1 (non_score mean -0.0875), then 0.102; step 2 uses 0.102: -0.102 * (0.75 + 1.0) / 2 = -0.08925,
    # then 0.102 * 1.02 = 0.10404.
    algo = make_algorithm(advantage="reinforce", whiten_advantages=False, beta=0.1, kl_in_reward=True, kl_estimator="k1",
                          kl_ctl="adaptive", target=0.5, horizon=20)
    _, first = build_kl_example(algo)
    assert first["objective/kl_coef"] == pytest.approx(0.1)
    assert first["objective/non_score_reward"] == pytest.approx(-0.0875)
    assert algo.kl_ctl.value == pytest.approx(0.102)
    _, second = build_kl_example(algo)
    assert second["objective/kl_coef"] == pytest.approx(0.102)
    assert second["objective/non_score_reward"] == pytest.approx(-0.08925)
    assert algo.kl_ctl.value == pytest.approx(0.10404)


def test_adaptive_kl_coefficient_shrinks_below_target():
    """target 2.0: error 0.875 / 2 - 1 = -0.5625 clipped to -0.2 -> 0.1 * (1 - 0.2 * 2 / 20) = 0.098."""
    algo = make_algorithm(advantage="reinforce", whiten_advantages=False, beta=0.1, kl_estimator="k1",
                          kl_ctl="adaptive", target=2.0, horizon=20)
    build_kl_example(algo)
    assert algo.kl_ctl.value == pytest.approx(0.098)


# --- rollout corrections (algorithm.rollout_correction) -------------------------------------------------


def test_tis_weights_each_token_loss_by_the_truncated_trainer_generator_ratio():
    """Ratio 1 everywhere (logp = old_logp), so the surrogate is -A per token; with token_tis capped at 2 and generator
    logprobs giving ratios [e^0.5, 4 -> 2] and [1], the token-mean loss is -(1*e^0.5 + 1*2 + (-1)*1) / 3."""
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    old_logp = torch.tensor([[-1.0, -1.0], [-1.0, 0.0]])
    gen_logp = torch.tensor([[-1.5, -1.0 - math.log(4.0)], [-1.0, 0.0]])
    algo = make_algorithm(rollout_correction="token_tis", clip=2.0, num_samples_per_prompt=2, norm_adv_by_std=False, loss_agg="token_mean", beta=0.0)
    step = trajectories(mask, 2, scores=torch.tensor([1.0, -1.0]), old_logp=old_logp, gen_logp=gen_logp)
    batch, metrics = algo.prepare(step)
    assert_close(batch.extras["is_weights"], torch.tensor([[math.exp(0.5), 2.0], [1.0, 0.0]]))
    assert metrics["rollout_corr/flagged_share"] == pytest.approx(1 / 3)
    assert metrics["rollout_corr/weight_mean"] == pytest.approx((math.exp(0.5) + 2.0 + 1.0) / 3)
    assert metrics["rollout_corr/ratio_max"] == pytest.approx(4.0) and metrics["rollout_corr/kept_share"] == 1.0
    loss, _ = algo.policy_loss(batch, Forward(old_logp.clone()), algo.denominator(batch))
    assert loss.item() == pytest.approx(-(math.exp(0.5) + 2.0 - 1.0) / 3, rel=1e-6)


def test_tis_off_adds_no_weights_and_leaves_the_loss_alone():
    mask = torch.ones(2, 2)
    algo = make_algorithm(num_samples_per_prompt=2, beta=0.0)
    # generator logprobs far from the trainer: they would matter if TIS were on
    gen_logp = torch.full((2, 2), -3.0)
    step = trajectories(mask, 2, scores=torch.tensor([1.0, 0.0]), old_logp=torch.zeros(2, 2), gen_logp=gen_logp)
    batch, metrics = algo.prepare(step)
    assert "is_weights" not in batch.extras and not any(key.startswith("rollout_corr/") for key in metrics)
