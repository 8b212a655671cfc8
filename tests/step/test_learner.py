"""The Learner on the built-in model: one update from a real Collector's batch, what it reports and changes, and how
the ranks' results of a mini batch merge."""

from __future__ import annotations

import math
import pickle

import pytest
import torch

from rlhf.algorithms.base import Metrics, OldLogprobs
from rlhf.config import compose_config, validate
from rlhf.run.build import build_components
from rlhf.run.state import NonFiniteError, NonFiniteGuard
from rlhf.step.learner import merge_shares
from rlhf.trajectory import Forward

RUN = ["train.prompts_per_step=4", "algorithm.num_samples_per_prompt=4", "logging.tensorboard=false"]


@pytest.fixture
def parts():
    """The default run's components (built-in model, arith task, GRPO), built in this process."""
    cfg = compose_config(RUN)
    c = build_components(validate(cfg))
    yield c
    c.close()


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_an_update_on_a_collected_batch_moves_the_policy_and_counts_itself(parts):
    scored = parts.collector.collect()
    before = weights(parts.learner.policy.model)
    assert parts.learner.updates == 0
    metrics = parts.learner.update(scored, NonFiniteGuard(3))
    assert parts.learner.updates == 1
    assert any(not torch.equal(before[k], v) for k, v in weights(parts.learner.policy.model).items())
    assert metrics["time/logprobs"] > 0 and metrics["time/training"] > 0
    assert metrics["objective/scores"] == pytest.approx(scored.scores.mean().item())
    assert math.isfinite(metrics["policy/grad_norm"]) and "loss/policy_avg" in metrics
    assert metrics["perf/total_num_tokens"] == float(scored.batch.attention_mask.sum())


def test_an_update_that_fails_midway_still_counts_as_begun(parts, monkeypatch):
    """The run's failure handling reads `updates`: an update that raised may have stepped the optimiser, so the
    step must not be saved as the previous one."""
    scored = parts.collector.collect()
    monkeypatch.setattr(parts.learner.algorithm, "policy_loss", lambda micro, out, denominator: (out.logp.sum() * float("nan"), {}))
    with pytest.raises(NonFiniteError):
        parts.learner.update(scored, NonFiniteGuard(1))
    assert parts.learner.updates == 1


def test_the_weights_to_push_are_the_policys_own(parts):
    parts.learner.update(parts.collector.collect(), NonFiniteGuard(3))
    pushed = parts.learner.weights()
    held = parts.learner.policy.model.state_dict()
    assert pushed.keys() == held.keys() and all(torch.equal(pushed[k], held[k]) for k in held)
    metrics = parts.collector.load_weights(pushed)
    assert metrics["perf/weight_sync_mb"] > 0


def test_rank_results_merge_shares_summed_means_averaged_forwards_stacked():
    a = (True, Metrics(sum={"loss/policy_avg": 0.25}, mean={"policy/clipfrac_avg": 0.1}), Forward(logp=torch.zeros(2, 3)))
    b = (True, Metrics(sum={"loss/policy_avg": 0.5}, mean={"policy/clipfrac_avg": 0.3}), Forward(logp=torch.ones(1, 3)))
    finite, metrics, recorded = merge_shares([a, b])
    assert finite and metrics == pytest.approx({"loss/policy_avg": 0.75, "policy/clipfrac_avg": 0.2})
    assert recorded.logp.tolist() == [[0.0] * 3, [0.0] * 3, [1.0] * 3] and recorded.entropy is None
    assert merge_shares([a, (False, {}, None)]) == (False, {}, None)
    assert merge_shares([a])[1] == a[1]  # one process: its own metrics, unchanged


def test_metrics_declare_their_reduction_and_keep_it_across_processes():
    """A metric's reduction is what its maker declared (not read from its name), and survives pickling (the Ray
    backend returns each rank's metrics)."""
    metrics = Metrics(sum={"objective/loss": 0.5}, mean={"loss/not_a_share": 0.25})
    back = pickle.loads(pickle.dumps(metrics))
    assert back == metrics and back.reduce == {"objective/loss": "sum", "loss/not_a_share": "mean"}
    finite, merged, _ = merge_shares([(True, back, None), (True, metrics, None)])
    assert merged == pytest.approx({"objective/loss": 1.0, "loss/not_a_share": 0.25})
    with pytest.raises(ValueError, match="reduces by 'mean' or 'sum'"):
        metrics.add("val/x", 1.0, "max")


def test_where_the_old_logprobs_come_from_is_decided_once_at_build(parts):
    """The default run (GRPO, one optimiser step per batch) takes them from the training forward: the prepared batch
    has none, and the update reports the metrics they feed."""
    assert parts.learner.old_logprobs is OldLogprobs.TRAINING
    scored = parts.collector.collect()
    prepared, _ = parts.learner.prepare(scored)
    assert prepared.old_logp is None
    metrics = parts.learner.update(scored, NonFiniteGuard(3))
    assert "objective/entropy" in metrics and "checks/logprob_gap_mean" in metrics
