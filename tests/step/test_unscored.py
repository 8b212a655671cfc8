"""A row a reward could not score (`Unscored`: a sandbox or judge failure) is not a zero: it leaves the batch, its
group's statistics are those of the rows left, it is asked again within `reward.unscored_retries`, it is counted, and
past `reward.max_unscored_share` the run stops naming the function, the last complete step saved."""

from __future__ import annotations

import json

import pytest
import torch

from rlhf.config import compose_config, validate
from rlhf.registry import register
from rlhf.rewards.failure import RewardUnavailable, Unscored
from rlhf.run.build import build_components
from rlhf.step.scored import take_groups
from rlhf.train import train

RUN = ["train.prompts_per_step=4", "algorithm.num_samples_per_prompt=3", "logging.tensorboard=false"]
FAILING: dict = {"rows": set(), "calls": []}  # rows (positions in the first call) the test reward cannot score; calls' sizes
TRAINING_ROWS = 12  # 4 prompts x 3 samples; the evaluation below scores 5 rows a call


@register("reward", "test_sometimes_unscored")
def sometimes_unscored(prompts, responses, ground_truths, **_):
    """`Unscored` for FAILING["rows"] of its first call; any later call (a retry of those rows alone) scores all."""
    first = not FAILING["calls"]
    FAILING["calls"].append(len(responses))
    return [Unscored("the sandbox died") if first and row in FAILING["rows"] else float(len(r) % 3)
            for row, r in enumerate(responses)]


TRAINING_CALLS = {"n": 0}


@register("reward", "test_unscored_from_step_2")
def unscored_from_step_2(prompts, responses, ground_truths, **_):
    """1.0 everywhere until step 2's batch, from which on every row is `Unscored` (retries too)."""
    TRAINING_CALLS["n"] += len(responses) == TRAINING_ROWS
    return [Unscored("the judge timed out") if TRAINING_CALLS["n"] >= 2 else 1.0 for _ in responses]


def scoring(*more: str) -> list[str]:
    return [*RUN, "reward.functions=[{name: arith_correct}, {name: test_sometimes_unscored}]", *more]


@pytest.fixture
def parts():
    cfg = compose_config(scoring("reward.unscored_retries=0"))
    c = build_components(validate(cfg))
    yield c
    c.close()


def collect_from(c, start: dict, failing: set):
    """A step's batch drawn from prompt stream state ``start`` with the same sampling seed, ``failing`` unscored."""
    FAILING.update(rows=failing, calls=[])
    c.collector.prompts.load_state_dict(start)
    torch.manual_seed(5)
    return c.collector.collect()


def test_the_rows_left_train_as_if_the_unscored_ones_were_never_drawn(parts):
    start = parts.collector.prompts.state_dict()
    whole = collect_from(parts, start, set())
    masked = collect_from(parts, start, {1, 3, 4})  # group 0 keeps 2 rows; group 1 keeps 1, under GRPO's 2: it goes
    expected = take_groups(whole, [[0, 2], [6, 7, 8], [9, 10, 11]])
    assert masked.prompts == expected.prompts and masked.responses == expected.responses
    assert torch.equal(masked.batch.group_id, expected.batch.group_id) and torch.equal(masked.scores, expected.scores)
    assert masked.metrics["reward/unscored_rows"] == 3 and masked.metrics["reward/unscored_dropped_groups"] == 1
    assert masked.metrics["reward/test_sometimes_unscored_unscored"] == 3
    assert "unscored" not in masked.batch.extras
    got, _ = parts.learner.prepare(masked)
    want, _ = parts.learner.prepare(expected)
    assert got.advantages.abs().sum() > 0 and torch.equal(got.advantages, want.advantages)


def test_an_unscored_row_is_asked_again_alone_and_then_scored():
    cfg = compose_config(scoring("reward.unscored_retries=1"))
    c = build_components(validate(cfg))
    try:
        FAILING.update(rows={2, 7}, calls=[])
        scored = c.collector.collect()
    finally:
        c.close()
    assert FAILING["calls"] == [12, 2]  # the batch, then the two failed rows alone
    assert len(scored.batch) == 12 and "reward/unscored_rows" not in scored.metrics


@register("reward", "test_unscored_sampled_rows")
def unscored_sampled_rows(prompts, responses, ground_truths, **_):
    """`Unscored` for every row of a training batch (12 rows), 1.0 for any other (ReMax's 4 greedy responses)."""
    return [Unscored("the grader is down") if len(responses) == TRAINING_ROWS else 1.0 for _ in responses]


def test_remaxs_error_names_the_functions_that_failed_the_sampled_rows():
    """ReMax scores a greedy response per prompt after the sampled batch; the error names what failed the sampled
    rows (the reward set's last batch was the greedy one, which every function scored: it named none)."""
    cfg = compose_config([*RUN, "algorithm/advantage=remax", "reward.functions=[{name: test_unscored_sampled_rows}]",
                          "reward.unscored_retries=0"])
    c = build_components(validate(cfg))
    try:
        with pytest.raises(RewardUnavailable, match=r"12 of the batch's 12 rows could not be scored, past reward."
                           r"max_unscored_share=0.25 \(reward function 'test_unscored_sampled_rows': 12 rows, first "
                           r"reason: the grader is down\)"):
            c.collector.collect()
    finally:
        c.close()


def test_past_the_share_the_run_stops_naming_the_function_with_the_last_step_saved(tmp_path):
    TRAINING_CALLS["n"] = 0
    out = tmp_path / "run"
    cfg = compose_config([*RUN, "reward.functions=[{name: test_unscored_from_step_2}]", "train.num_steps=3",
                          "eval.every=0", "eval.max_prompts=5", "eval.num_samples=1", "checkpoint.every=1",
                          "reward.max_unscored_share=0.25"])
    with pytest.raises(RewardUnavailable, match=r"12 of the batch's 12 rows could not be scored, past "
                       r"reward.max_unscored_share=0.25 \(reward function 'test_unscored_from_step_2': 12 rows, first "
                       r"reason: the judge timed out\)"):
        train(cfg, out)
    saved = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert saved == ["step_00000001"]
    assert json.loads((out / "checkpoints" / "step_00000001" / "trainer_state.json").read_text())["step"] == 1
