"""Online DPO (PairwisePreference): best/worst pairs per prompt, tie exclusion, the pair denominator, DPO/IPO loss
and metrics."""

from types import SimpleNamespace

import pytest
import torch
from torch.testing import assert_close

from algorithm_fixtures import algorithm_cfg, make_algorithm, trajectories
from rlhf import registry
from rlhf.algorithms import AdvantageInputs, PairwisePreference, advantages as advantage_parts
from rlhf.algorithms.base import OldLogprobs, old_logprob_source
from rlhf.config import ConfigError, compose_config, validate
from rlhf.trajectory import Forward, Trajectories

G = 9.0  # garbage in masked positions
DPO = dict(name="online_dpo", advantage="best_vs_worst", policy_loss={"name": "dpo", "beta": 0.5}, kl_ctl=None,
           num_samples_per_prompt=2, kl_estimator="k1", reuse_training_logprobs=False)  # as the online_dpo preset


def make_dpo(**overrides) -> PairwisePreference:
    """Online DPO as composed: G = 2, beta 0.5 (the dpo loss's), k1 KL."""
    return make_algorithm(**(DPO | overrides))


def make_rollout(mask: torch.Tensor, **fields) -> Trajectories:
    """Rows in groups of 2 with the given mask; window ids number the rows (row i holds token 10 + i)."""
    rows, length = mask.shape
    ids = (10 + torch.arange(rows)).unsqueeze(1).expand(rows, length).clone()
    return trajectories(mask, 2, response_ids=ids, **fields)


# --- best_vs_worst ------------------------------------------------------------------------------------


def test_best_and_worst_first_on_ties():
    """Each prompt's highest and lowest score, the first one on ties."""
    # G = 4: [1, 3, 3, 0] -> best 1 (first of the two 3s), worst 3; [2, 2, 2, 2] -> 4 and 4;
    # [5, -1, 5, -1] -> best 8, worst 9.
    scores = torch.tensor([1.0, 3.0, 3.0, 0.0, 2.0, 2.0, 2.0, 2.0, 5.0, -1.0, 5.0, -1.0])
    pairs = registry.resolve("advantage", "best_vs_worst")
    chosen, rejected = pairs(AdvantageInputs(scores, torch.ones(12, 1), 4), algorithm_cfg(**DPO).advantage)
    assert chosen.tolist() == [1, 4, 8]
    assert rejected.tolist() == [3, 4, 9]


# --- prepare --------------------------------------------------------------------------------------

# Three prompts, G = 2. Scores [1, 3 | 2, 2 | 0, -1]: pairs (chosen, rejected) = (1, 0), (2, 2) tie, (4, 5).
SCORES = torch.tensor([1.0, 3.0, 2.0, 2.0, 0.0, -1.0])
MASK = torch.tensor(
    [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]]
)
REF_LOGP = torch.tensor(
    [
        [-1.0, -1.0, -0.5],  # sum -2.5
        [-1.5, G, G],  # -1.5
        [-0.5, -0.5, G],  # -1.0
        [-1.0, -1.0, -1.0],  # -3.0 (never selected)
        [-1.0, G, G],  # -1.0
        [-1.25, -1.25, G],  # -2.5
    ]
)
# k1 KL of the pre-update policy per row: 0.3, 0.2, 0.3, 0.0, 0.4, 0.4 (mean 1.6 / 6).
OLD_LOGP = REF_LOGP + torch.tensor(
    [[0.1, 0.1, 0.1], [0.2, G, G], [0.0, 0.3, G], [0.1, 0.0, -0.1], [0.4, G, G], [0.2, 0.2, G]]
)
ROWS = [1, 0, 2, 2, 4, 5]  # chosen_0, rejected_0, chosen_1, rejected_1, chosen_2, rejected_2


def build(algo, old_logp=OLD_LOGP, scores=SCORES):
    """`algo.prepare` on the six-row example."""
    return algo.prepare(make_rollout(MASK, scores=scores, old_logp=old_logp, ref_logp=REF_LOGP))


def test_online_dpo_is_registered_and_flags():
    """`best_vs_worst` + `dpo` compose a PairwisePreference: a reference, no critic, pre-update logprobs as the
    online_dpo preset sets (reuse_training_logprobs=false)."""
    assert registry.resolve("advantage", "best_vs_worst") is advantage_parts.best_vs_worst
    algo = make_dpo()
    assert isinstance(algo, PairwisePreference)
    assert algo.needs_reference and not algo.needs_critic
    assert algo.needs_old_logprobs and not algo.needs_entropy


@pytest.mark.parametrize("beta", [0.0, -0.1])
def test_online_dpo_needs_positive_beta(beta):
    """beta is the DPO temperature, a key of the dpo loss's node: 0 or less is refused by validate, naming it."""
    with pytest.raises(ConfigError, match=rf"algorithm.policy_loss.beta={beta} must be > 0"):
        validate(compose_config(["algorithm=online_dpo", f"algorithm.policy_loss.beta={beta}"]))


def test_prepare_interleaves_chosen_and_rejected():
    """Rows come out as chosen, rejected per prompt; ref logprobs follow their rows; the tie pair is invalid."""
    batch, _ = build(make_dpo())
    assert batch.rows_per_unit == 2 and batch.num_units == 3
    assert batch.window_ids[:, 0].tolist() == [10 + r for r in ROWS]
    assert torch.equal(batch.loss_mask, MASK[ROWS])
    assert torch.equal(batch.ref_logp, REF_LOGP[ROWS])
    assert batch.extras["pair_valid"].tolist() == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]


def test_prepare_metrics():
    """prepare metrics: mean margin, mean score, valid-pair fraction, pre-update KL."""
    # margins [3 - 1, 0, 0 - (-1)] = [2, 0, 1] -> mean 1; mean score 7 / 6; 2 of 3 pairs valid;
    # objective/kl (k1, pre-update policy, all six rows) = (0.3 + 0.2 + 0.3 + 0 + 0.4 + 0.4) / 6 = 0.2666667.
    _, metrics = build(make_dpo())
    assert metrics == pytest.approx(
        {
            "objective/scores_margin": 1.0,
            "objective/rlhf_reward": 7.0 / 6.0,
            "objective/non_score_reward": 0.0,
            "val/valid_pairs": 2.0 / 3.0,
            "objective/kl": 1.6 / 6.0,
        }
    )


def test_prepare_without_old_logprobs_has_no_kl():
    """reuse_training_logprobs: no pre-update forward, so prepare reports no objective/kl."""
    algo = make_dpo(reuse_training_logprobs=True)
    assert algo.needs_old_logprobs is False and algo.needs_entropy is True
    _, metrics = build(algo, old_logp=None)
    assert "objective/kl" not in metrics


def test_denominator_counts_valid_pairs():
    """The whole batch has 2 valid pairs; units {0, 1} have 1; unit {1} alone (the tie) has 0, clamped to 1."""
    algo = make_dpo()
    batch, _ = build(algo)
    assert algo.denominator(batch).item() == 2.0
    assert algo.denominator(batch.select_units(torch.tensor([0, 1]))).item() == 1.0
    assert algo.denominator(batch.select_units(torch.tensor([1]))).item() == 1.0


# --- policy_loss --------------------------------------------------------------------------------------

# Training logprobs of the selected rows (order ROWS), garbage where masked. With the ref sums above:
#   pair 0: chosen  [-1.0]          = -1.0 vs ref -1.5 -> ratio  0.5; rejected [-1, -1, -1] = -3.0 vs ref -2.5 -> -0.5; h = 1
#   pair 1: the tie, both [-0.2, -0.3] = -0.5 vs ref -1.0 -> 0.5 each; h = 0 (excluded)
#   pair 2: chosen  [-2.0]          = -2.0 vs ref -1.0 -> ratio -1.0; rejected [-1, -1] = -2.0 vs ref -2.5 -> 0.5;  h = -1.5
LOGP = torch.tensor(
    [[-1.0, G, G], [-1.0, -1.0, -1.0], [-0.2, -0.3, G], [-0.2, -0.3, G], [-2.0, G, G], [-1.0, -1.0, G]]
)
# beta 0.5: -log sigmoid(0.5) = 0.4740770, -log sigmoid(-0.75) = 1.1368710; the mean over 2 valid pairs:
DPO_LOSS = (0.4740770 + 1.1368710) / 2  # 0.8054740
IPO_LOSS = ((1.0 - 1.0) ** 2 + (-1.5 - 1.0) ** 2) / 2  # (h - 1 / (2 * 0.5))^2 -> (0 + 6.25) / 2


@pytest.mark.parametrize("loss_name, expected", [("dpo", DPO_LOSS), ("ipo", IPO_LOSS)])
def test_loss_and_metrics(loss_name, expected):
    """The loss averages valid pairs only; metrics are means over valid pairs."""
    # logps/chosen (-1 - 2) / 2 = -1.5; logps/rejected (-3 - 2) / 2 = -2.5;
    # reward/chosen 0.5 * (0.5 - 1) / 2 = -0.125; reward/rejected 0.5 * (-0.5 + 0.5) / 2 = 0;
    # reward_margin (0.5 * 1 + 0.5 * -1.5) / 2 = -0.125.
    algo = make_dpo(policy_loss={"name": loss_name, "beta": 0.5})
    batch, _ = build(algo)
    loss, metrics = algo.policy_loss(batch, Forward(LOGP), algo.denominator(batch))
    assert not algo.needs_critic and not hasattr(algo, "value_loss")  # was: the fused loss's value loss is None
    assert_close(loss, torch.tensor(expected))
    assert set(metrics) == {
        "objective/loss", "logps/chosen", "logps/rejected", "reward/chosen", "reward/rejected", "reward_margin"
    }
    expected_metrics = {
        "objective/loss": expected,
        "logps/chosen": -1.5,
        "logps/rejected": -2.5,
        "reward/chosen": -0.125,
        "reward/rejected": 0.0,
        "reward_margin": -0.125,
    }
    for key, value in expected_metrics.items():
        assert_close(metrics[key], torch.tensor(value), msg=key)


def test_tie_pair_gets_no_gradient():
    """Only the valid pairs' rows receive gradient; the tie pair's rows and masked tokens get exactly 0."""
    algo = make_dpo()
    batch, _ = build(algo)
    logp = LOGP.clone().requires_grad_(True)
    loss, _ = algo.policy_loss(batch, Forward(logp), algo.denominator(batch))
    loss.backward()
    assert torch.equal(logp.grad[2:4], torch.zeros(2, 3))
    assert torch.equal(logp.grad[batch.loss_mask == 0], torch.zeros(7))
    assert (logp.grad[[0, 1, 4, 5]][batch.loss_mask[[0, 1, 4, 5]].bool()] != 0).all()


def test_micro_batches_sum_to_mini_batch():
    """One pair per micro batch with the mini batch's denominator (2 valid pairs) adds up to the whole loss."""
    algo = make_dpo()
    batch, _ = build(algo)
    denominator = algo.denominator(batch)
    whole, _ = algo.policy_loss(batch, Forward(LOGP), denominator)
    parts = []
    for unit in range(3):
        micro = batch.select_units(torch.tensor([unit]))
        parts.append(algo.policy_loss(micro, Forward(LOGP[2 * unit : 2 * unit + 2]), denominator)[0])
    assert_close(sum(parts), whole)
    assert_close(parts[1], torch.tensor(0.0))


def test_reuse_training_logprobs_reports_kl_and_entropy_from_the_training_forward():
    """reuse_training_logprobs: objective/kl and objective/entropy come from the training forward."""
    # objective/kl (k1) from the training logprobs of the six selected rows: per-row log-ratio sums
    # [0.5, -0.5, 0.5, 0.5, -1.0, 0.5] -> 0.5 / 6; objective/entropy: row token counts [1, 3, 2, 2, 1, 2] -> 11 / 6.
    algo = make_dpo(reuse_training_logprobs=True)
    batch, _ = build(algo, old_logp=None)
    entropy = torch.where(batch.loss_mask.bool(), torch.ones(6, 3), torch.full((6, 3), G))
    _, metrics = algo.policy_loss(batch, Forward(LOGP, entropy), algo.denominator(batch))
    assert_close(metrics["objective/kl"], torch.tensor(0.5 / 6.0))
    assert_close(metrics["objective/entropy"], torch.tensor(11.0 / 6.0))
    assert_close(metrics["objective/loss"], torch.tensor(DPO_LOSS))


def test_no_kl_in_loss_metrics_without_reuse():
    """Without reuse_training_logprobs the loss reports no objective/kl (prepare already did)."""
    algo = make_dpo()
    batch, _ = build(algo)
    _, metrics = algo.policy_loss(batch, Forward(LOGP), algo.denominator(batch))
    assert "objective/kl" not in metrics and "objective/entropy" not in metrics


def test_no_valid_pair_gives_zero_loss():
    """All scores equal: every pair is a tie, the loss is 0 (denominator clamped to 1), not NaN."""
    algo = make_dpo()
    batch, metrics = build(algo, scores=torch.ones(6))
    assert metrics["val/valid_pairs"] == 0.0
    loss, _ = algo.policy_loss(batch, Forward(LOGP), algo.denominator(batch))
    assert loss.item() == 0.0
    assert isinstance(batch, Trajectories)


def test_where_its_old_logprobs_come_from():
    """A pass of their own for the pre-update KL, or none with reuse_training_logprobs (the KL from the training
    forward), whatever the number of optimiser steps."""
    one, four = SimpleNamespace(num_epochs=1, num_mini_batches=1), SimpleNamespace(num_epochs=1, num_mini_batches=4)
    assert old_logprob_source(make_dpo(reuse_training_logprobs=False), one) is OldLogprobs.PASS
    assert old_logprob_source(make_dpo(reuse_training_logprobs=True), one) is OldLogprobs.NONE
    assert old_logprob_source(make_dpo(reuse_training_logprobs=True), four) is OldLogprobs.NONE
