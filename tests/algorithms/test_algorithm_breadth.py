"""Parts composed by config: REINFORCE++ (with and without a group baseline), ReMax, CISPO and the
rollout corrections, each through `prepare` / `policy_loss` on hand-computed values."""

import math

import pytest
import torch
from torch.testing import assert_close

from algorithm_fixtures import KL_MASK, OLD_LOGP, REF_LOGP, make_algorithm, trajectories
from rlhf import registry
from rlhf.functional import masked_whiten
from rlhf.trajectory import Forward


@pytest.mark.parametrize(
    "kind, name",
    [("advantage", "reinforce_pp"), ("advantage", "reinforce_pp_baseline"), ("advantage", "remax"), ("policy_loss", "cispo"),
     ("rollout_correction", "token_tis"), ("rollout_correction", "seq_tis"), ("rollout_correction", "icepop"),
     ("rollout_correction", "geo_reject")],
)
def test_every_new_part_is_registered_by_name_with_a_docstring(kind, name):
    assert name in registry.names(kind)
    assert registry.resolve(kind, name).__doc__.strip()


def test_reinforce_pp_puts_the_k1_kl_in_each_token_reward_and_whitens_the_returns():
    """beta 0.1, k1 KL [0.5, 0.25] and [1.0]; scores [1, 2]. Token rewards: row 0 [-0.05, -0.025 + 1],
    row 1 [-0.1 + 2]; returns [0.925, 0.975] and [1.9]; whitened over the three tokens."""
    algo = make_algorithm(advantage="reinforce_pp", beta=0.1, kl_estimator="k1", kl_in_reward=True)
    step = trajectories(KL_MASK, 1, scores=torch.tensor([1.0, 2.0]), old_logp=OLD_LOGP, ref_logp=REF_LOGP)
    batch, metrics = algo.prepare(step)
    returns = torch.tensor([[0.925, 0.975, 0.0], [1.9, 0.0, 0.0]])
    assert_close(batch.advantages, masked_whiten(returns, KL_MASK))
    assert batch.advantages[0, 0] < batch.advantages[0, 1] < batch.advantages[1, 0]
    assert metrics["objective/kl"] == pytest.approx((0.75 + 1.0) / 2)


def test_reinforce_pp_baseline_centres_scores_within_the_group_first():
    """One group of two, no KL: scores [3, 1] -> [1, -1] at the last tokens; returns row 0 [1, 1], row 1 [-1];
    whitened over the three tokens: mean 1/3, unbiased std sqrt(4/3)."""
    algo = make_algorithm(advantage="reinforce_pp_baseline", num_samples_per_prompt=2)
    batch, _ = algo.prepare(trajectories(KL_MASK, 2, scores=torch.tensor([3.0, 1.0]), old_logp=torch.zeros(2, 3)))
    scale = math.sqrt(4 / 3 + 1e-8)
    assert_close(batch.advantages, torch.tensor([[2 / 3, 2 / 3, 0.0], [-4 / 3, 0.0, 0.0]]) / scale)


def test_reinforce_pp_baseline_of_a_constant_group_is_zero_before_whitening():
    """A group whose scores are all 0.7 gives returns exactly 0 everywhere, so whitened advantages are 0."""
    algo = make_algorithm(advantage="reinforce_pp_baseline", num_samples_per_prompt=2)
    batch, _ = algo.prepare(trajectories(KL_MASK, 2, scores=torch.tensor([0.7, 0.7]), old_logp=torch.zeros(2, 3)))
    assert torch.equal(batch.advantages, torch.zeros(2, 3))


def test_remax_subtracts_the_greedy_baseline_given_with_the_batch():
    """Scores [1, 0] against the prompt's greedy score 0.25: advantages 0.75 and -0.25 on every valid token."""
    algo = make_algorithm(advantage="remax", num_samples_per_prompt=2)
    assert algo.needs_greedy_baseline
    step = trajectories(KL_MASK, 2, scores=torch.tensor([1.0, 0.0]), old_logp=torch.zeros(2, 3))
    step.extras["baseline_scores"] = torch.tensor([0.25, 0.25])
    batch, _ = algo.prepare(step)
    assert_close(batch.advantages, torch.tensor([[0.75, 0.75, 0.0], [-0.25, 0.0, 0.0]]))


def test_remax_without_a_baseline_says_what_is_missing():
    algo = make_algorithm(advantage="remax", num_samples_per_prompt=2)
    with pytest.raises(ValueError, match="greedy-response score"):
        algo.prepare(trajectories(KL_MASK, 2, scores=torch.tensor([1.0, 0.0]), old_logp=torch.zeros(2, 3)))


def test_cispo_loss_through_the_algorithm_reports_clipped_tokens_and_keeps_their_gradient():
    """GRPO advantages +-0.7071 (one group [1, 0]); the new policy's ratio is 2 on every token. CISPO with
    eps_high 0.28 clips the weight to 1.28 yet every token has gradient -1.28 * A / 3 (token mean over 3)."""
    algo = make_algorithm(policy_loss="cispo", clip_eps_high=0.28, num_samples_per_prompt=2, beta=0.0)
    batch, _ = algo.prepare(trajectories(KL_MASK, 2, scores=torch.tensor([1.0, 0.0]), old_logp=torch.zeros(2, 3)))
    logp = torch.full((2, 3), math.log(2.0), requires_grad=True)
    loss, metrics = algo.policy_loss(batch, Forward(logp), algo.denominator(batch))
    loss.backward()
    adv = batch.advantages
    assert_close(logp.grad, -1.28 * adv / 3)
    assert metrics["policy/clipfrac_avg"].item() == 1.0


CORRECTION_KEYS = {"token_tis": {"clip": 2.0}, "seq_tis": {"clip": 2.0}, "icepop": {"low": 0.5, "high": 1.8}, "geo_reject": {"low": 0.5, "high": 1.8}}


@pytest.mark.parametrize(
    "correction, kept, flagged",
    [("token_tis", 1.0, 1 / 3), ("seq_tis", 1.0, 2 / 3), ("icepop", 2 / 3, 1 / 3), ("geo_reject", 1 / 3, 2 / 3)],
)
def test_rollout_corrections_weight_the_loss_and_report_what_they_did(correction, kept, flagged):
    """Generator ratios: row 0 [1, 4] (sequence 4, geometric 2), row 1 [1.5]. Cap 2, band [0.5, 1.8]."""
    old_logp = torch.zeros(2, 3)
    gen_logp = -torch.log(torch.tensor([[1.0, 4.0, 1.0], [1.5, 1.0, 1.0]]))
    algo = make_algorithm(rollout_correction=correction, **CORRECTION_KEYS[correction], num_samples_per_prompt=2, beta=0.0)
    batch, metrics = algo.prepare(trajectories(KL_MASK, 2, scores=torch.tensor([1.0, 0.0]), old_logp=old_logp, gen_logp=gen_logp))
    assert metrics["rollout_corr/kept_share"] == pytest.approx(kept)
    assert metrics["rollout_corr/masked_share"] == pytest.approx(1 - kept)
    assert metrics["rollout_corr/flagged_share"] == pytest.approx(flagged)
    assert metrics["rollout_corr/ratio_max"] == pytest.approx(4.0)
    assert metrics["rollout_corr/ratio_mean"] == pytest.approx((1 + 4 + 1.5) / 3)
    # the loss is the surrogate (-A at ratio 1) weighted token by token
    loss, _ = algo.policy_loss(batch, Forward(old_logp.clone()), algo.denominator(batch))
    kept_tokens = batch.loss_mask.bool()  # the rejecting corrections take rejected tokens out of the mask
    expected = (-batch.advantages * batch.extras["is_weights"])[kept_tokens].sum() / kept_tokens.sum()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert kept_tokens.sum().item() == round(kept * 3)


@pytest.mark.parametrize("correction", ["icepop", "geo_reject"])
@pytest.mark.parametrize("drop", [True, False])
def test_rejected_tokens_leave_every_term_unless_drop_rejected_is_false(correction, drop):
    """Hand values: row 0 ratios [1, 4], row 1 [1.5], band [0.5, 1.8]. icepop rejects the token at ratio 4; geo_reject
    the whole of row 0 (geometric mean 2). Dropped, they count in no term: the KL loss and the denominator see only
    the kept tokens; kept in the mask (drop_rejected=false), only their policy-loss weight is 0."""
    old_logp = torch.zeros(2, 3)
    gen_logp = -torch.log(torch.tensor([[1.0, 4.0, 1.0], [1.5, 1.0, 1.0]]))
    ref_logp = torch.tensor([[-0.5, -3.0, 0.0], [-1.0, 0.0, 0.0]])  # a different KL at every token
    algo = make_algorithm(rollout_correction=correction, **CORRECTION_KEYS[correction], drop_rejected=drop,
                          num_samples_per_prompt=2, beta=0.1)
    batch, _ = algo.prepare(trajectories(KL_MASK, 2, scores=torch.tensor([1.0, 0.0]), old_logp=old_logp,
                                             gen_logp=gen_logp, ref_logp=ref_logp))
    rejected = {"icepop": [[0, 1]], "geo_reject": [[0, 0], [0, 1]]}[correction]
    expected_mask = KL_MASK.clone()
    if drop:
        for row, col in rejected:
            expected_mask[row, col] = 0
    assert batch.loss_mask.tolist() == expected_mask.tolist()
    _, metrics = algo.policy_loss(batch, Forward(old_logp.clone()), algo.denominator(batch))
    k3 = torch.exp(ref_logp - old_logp) - (ref_logp - old_logp) - 1  # the KL loss's per-token term at these values
    assert algo.denominator(batch).item() == expected_mask.sum().item()
    expected_kl = (k3 * expected_mask).sum() / expected_mask.sum()  # a mean over the tokens in the mask only
    assert metrics["loss/kl_avg"].item() == pytest.approx(expected_kl.item(), rel=1e-6)
