"""The Collector on the built-in model and task: what one `collect` draws, samples and scores, and evaluation."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rlhf.config import compose_config, validate
from rlhf.run.build import build_components

RUN = ["train.prompts_per_step=4", "algorithm.num_samples_per_prompt=3", "logging.tensorboard=false"]


@pytest.fixture
def collector():
    cfg = compose_config(RUN)
    c = build_components(validate(cfg))
    yield c.collector
    c.close()


def test_collect_draws_a_step_of_prompts_and_scores_a_group_per_prompt(collector):
    position = collector.prompts.state_dict()["position"]
    scored = collector.collect()
    assert collector.prompts.state_dict()["position"] == position + 4  # train.prompts_per_step drawn
    assert len(scored.batch) == 12 and scored.batch.group_id.tolist() == [g for g in range(4) for _ in range(3)]
    assert all(scored.prompts[3 * g] == scored.prompts[3 * g + 2] for g in range(4))  # a group shares its prompt
    assert scored.batch.scores is not None and "objective/verifiable_correct_rate" in scored.metrics
    assert scored.batch.loss_mask.shape[1] <= collector.sampling.max_new_tokens


def test_collect_on_given_prompts_with_other_limits(collector):
    examples = collector.prompts.examples[:2]
    scored = collector.collect(examples, sampling=replace(collector.sampling, max_new_tokens=1))
    assert scored.prompts == [ex.text for ex in examples for _ in range(3)]
    assert scored.batch.action_lengths.max().item() <= 1


def test_evaluation_reports_greedy_and_sampled_figures(collector):
    eval_cfg = compose_config(RUN).eval
    metrics, results = collector.evaluate(collector.prompts.examples[:5], eval_cfg)
    assert set(results) == {"greedy", "sampled"} and len(results["greedy"].batch) == 5
    for mode in ("greedy", "sampled"):
        assert {f"eval/{mode}_scores", f"eval/{mode}_correct_rate", f"eval/{mode}_sequence_lengths"} <= set(metrics)
    again, _ = collector.evaluate(collector.prompts.examples[:5], eval_cfg)
    assert again["eval/greedy_scores"] == metrics["eval/greedy_scores"]  # greedy decoding is deterministic
