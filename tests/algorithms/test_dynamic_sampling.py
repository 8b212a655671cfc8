"""DAPO's dynamic sampling: groups whose scores all tie are dropped and refilled from more prompts, within
`algorithm.max_resample_rounds`. Unit tests drive `Collector.collect` with hand-made scored batches; two tiny in-process
runs check what reaches the update and the logged metrics (config errors: tests/config/test_config.py)."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from run_records import records
from rlhf.step.collector import Collector
from rlhf.step.learner import Learner
from rlhf.step.scored import Scored
from rlhf.trajectory import with_groups
from rlhf.config import compose_config
from rlhf.train import train
from rlhf.trajectory import from_completions

PAD = 0


def scored_batch(groups: list[list[float]], width: int = 3, tag: str = "r") -> Scored:
    """One Scored whose group k holds rows scored ``groups[k]``; responses of ``width`` tokens, group ids 0..,
    a row-aligned `baseline_scores` extra equal to the scores, prompts ``{tag}{k}``."""
    scores = torch.tensor([s for group in groups for s in group], dtype=torch.float)
    n, size = len(scores), len(groups[0])
    batch = from_completions(
        torch.ones(n, 2, dtype=torch.long), torch.ones(n, 2, dtype=torch.long), torch.full((n, width), 5),
        torch.ones(n, width), torch.zeros(n, width), torch.ones(n, dtype=torch.bool),
    )
    batch = with_groups(batch, size)
    batch.scores, batch.extras = scores, {"baseline_scores": scores.clone()}
    prompts = [f"{tag}{k}" for k in range(len(groups)) for _ in range(size)]
    return Scored(batch, prompts, [f"{tag}{k}/{i}" for k in range(len(groups)) for i in range(size)],
                         {"reward/x": float(len(groups)), "time/greedy_baseline": 1.0})


class FakeRun:
    """A Collector whose `sample` returns the given batches in turn, and a prompt stream of counted draws."""

    def __init__(self, monkeypatch, batches: list[Scored]) -> None:
        self.batches, self.generated, self.drawn = list(batches), [], []
        self.tokenizer = SimpleNamespace(pad_token_id=PAD)

    def sample(self, examples, samples, sampling, training=True, generator=None):
        self.generated.append((len(examples), samples, training, generator))
        return self.batches.pop(0)

    def draw(self, n: int) -> list[int]:
        self.drawn.append(n)
        return list(range(n))

    def run(self, prompts: int, max_rounds: int = 3, filter_groups: bool = True, generator=None, filter_on: str = "score") -> Scored:
        collector = Collector(
            None, self.tokenizer, None, None, None, prompts_per_step=prompts, samples_per_prompt=2,
            max_resample_rounds=max_rounds if filter_groups else None, filter_on=filter_on,
        )
        collector.sample = self.sample
        return collector.collect(list(range(prompts)), draw=self.draw, generator=generator)


def with_verdicts(scored: Scored, correct: list[list[int]]) -> Scored:
    """``scored`` with each row's verifier verdict (``extras['correct']``), as `Collector.score` adds it."""
    scored.batch.extras["correct"] = torch.tensor([c for group in correct for c in group], dtype=torch.float)
    return scored


def test_filtering_on_accuracy_keeps_groups_whose_verdicts_differ_whatever_the_scores(monkeypatch):
    """Group 0: scores differ (a format bonus) but both wrong; group 1: one right; group 2: both right. DAPO's
    accuracy filter keeps only group 1, where the score filter would keep groups 0 and 1."""
    groups, verdicts = [[0.1, 0.0], [1.1, 0.0], [1.1, 1.1]], [[0, 0], [1, 0], [1, 1]]
    by_accuracy = FakeRun(monkeypatch, [with_verdicts(scored_batch(groups, tag="a"), verdicts)]).run(prompts=3, max_rounds=0, filter_on="accuracy")
    by_score = FakeRun(monkeypatch, [with_verdicts(scored_batch(groups, tag="a"), verdicts)]).run(prompts=3, max_rounds=0)
    assert by_accuracy.prompts == ["a1", "a1"] and by_accuracy.batch.extras["correct"].tolist() == [1, 0]
    assert by_score.prompts == ["a0", "a0", "a1", "a1"]


def test_tied_groups_are_dropped_and_the_step_filled_from_a_second_draw(monkeypatch):
    fake = FakeRun(monkeypatch, [
        scored_batch([[1, 1], [0, 1], [2, 2]], width=3, tag="a"),
        scored_batch([[0, 0], [1, 0], [3, 1]], width=5, tag="b"),
    ])
    out = fake.run(prompts=3)
    assert fake.drawn == [3] and len(fake.generated) == 2
    assert out.batch.group_id.tolist() == [0, 0, 1, 1, 2, 2]
    assert out.scores.tolist() == [0, 1, 1, 0, 3, 1]
    assert out.prompts == ["a1", "a1", "b1", "b1", "b2", "b2"] and out.responses[2:4] == ["b1/0", "b1/1"]
    assert torch.equal(out.batch.extras["baseline_scores"], out.scores)  # extras stay row-aligned
    assert out.batch.loss_mask.shape == (6, 5) and out.batch.loss_mask[:2].sum().item() == 6  # short rows padded
    assert out.metrics["dynamic_sampling/rounds"] == 2 and out.metrics["dynamic_sampling/kept_groups"] == 3
    assert out.metrics["dynamic_sampling/kept_share"] == pytest.approx(3 / 6)
    assert out.metrics["reward/x"] == 3 and out.metrics["time/greedy_baseline"] == 2  # first round's; times summed


def test_a_surplus_is_cut_to_exactly_the_step_size(monkeypatch):
    fake = FakeRun(monkeypatch, [scored_batch([[0, 1], [1, 1]]), scored_batch([[4, 5], [6, 7]])])
    out = fake.run(prompts=2)
    assert out.scores.tolist() == [0, 1, 4, 5] and out.batch.group_id.tolist() == [0, 0, 1, 1]
    assert out.metrics["dynamic_sampling/kept_share"] == pytest.approx(3 / 4)
    assert out.metrics["dynamic_sampling/kept_groups"] == 2


def test_a_full_first_batch_draws_nothing_more(monkeypatch):
    fake = FakeRun(monkeypatch, [scored_batch([[0, 1], [1, 2]])])
    out = fake.run(prompts=2)
    assert fake.drawn == [] and out.metrics["dynamic_sampling/rounds"] == 1 and len(out.batch) == 4


@pytest.mark.parametrize("max_rounds", [0, 1, 3])
def test_the_rounds_limit_holds_and_all_tied_steps_train_on_the_last_batch(monkeypatch, caplog, max_rounds):
    batches = [scored_batch([[k, k], [k, k]], tag=f"t{k}") for k in range(max_rounds + 2)]
    fake = FakeRun(monkeypatch, batches)
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        out = fake.run(prompts=2, max_rounds=max_rounds)
    assert len(fake.generated) == max_rounds + 1 and fake.drawn == [2] * max_rounds
    assert out.prompts == batches[max_rounds].prompts  # the last batch, as it is
    assert out.metrics["dynamic_sampling/rounds"] == max_rounds + 1 and out.metrics["dynamic_sampling/kept_groups"] == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"algorithm.max_resample_rounds={max_rounds}" in warnings[0]


def test_out_of_rounds_trains_on_the_groups_it_kept(monkeypatch, caplog):
    fake = FakeRun(monkeypatch, [scored_batch([[0, 1], [2, 2], [3, 3]]), scored_batch([[1, 1], [5, 4], [6, 6]])])
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        out = fake.run(prompts=3, max_rounds=1)
    assert out.scores.tolist() == [0, 1, 5, 4] and out.batch.group_id.tolist() == [0, 0, 1, 1]
    assert out.metrics["dynamic_sampling/kept_groups"] == 2 and "2 of 3 groups" in caplog.text


def test_every_round_uses_the_given_generator_and_training_scores(monkeypatch):
    pinned = object()
    fake = FakeRun(monkeypatch, [scored_batch([[1, 1]]), scored_batch([[0, 1]])])
    fake.run(prompts=1, generator=pinned)
    assert [(g is pinned, training) for _, _, training, g in fake.generated] == [(True, True), (True, True)]


def test_off_it_is_one_generate_call_and_no_metrics(monkeypatch):
    batch = scored_batch([[1, 1], [1, 1]])
    fake = FakeRun(monkeypatch, [batch])
    out = fake.run(prompts=2, filter_groups=False)
    assert out is batch and len(fake.generated) == 1 and fake.drawn == []


def test_versions_follow_their_rows(monkeypatch):
    first, second = scored_batch([[1, 1], [0, 2]]), scored_batch([[3, 4], [5, 5]])
    first.versions, second.versions = torch.tensor([7, 7, 8, 8]), torch.tensor([9, 9, 10, 10])
    out = FakeRun(monkeypatch, [first, second]).run(prompts=2)
    assert out.versions.tolist() == [8, 8, 9, 9]


# --- tiny in-process runs ---------------------------------------------------------------------------------------

HALF_TIED = '''
import random

def half_tied(prompts, responses, ground_truths, **_):
    """0 for every sample of a prompt whose first operand is even; random otherwise."""
    return [0.0 if int(p.strip()[0]) % 2 == 0 else random.random() for p in prompts]


def tied(prompts, responses, ground_truths, **_):
    return [0.5] * len(responses)
'''
TINY = ["train.prompts_per_step=4", "algorithm.num_samples_per_prompt=4", "train.micro_batch_size=16", "eval.num_samples=0",
        "eval.greedy=false", "logging.tensorboard=false", "checkpoint.save_final_model=false", "reward.non_stop_penalty=false",
        "algorithm.filter_groups=true"]


def run(tmp_path: Path, monkeypatch, *overrides: str) -> tuple[dict[int, dict], list]:
    """(metrics by step, the batches that reached the update) of an in-process run with the rewards above."""
    (tmp_path / "tie_rewards.py").write_text(HALF_TIED)
    monkeypatch.syspath_prepend(str(tmp_path))
    updated = []
    train_batch = Learner.train

    def recording(learner, batch, guard):
        updated.append(batch.to("cpu"))
        return train_batch(learner, batch, guard)

    monkeypatch.setattr(Learner, "train", recording)
    train(compose_config([*TINY, *overrides]), tmp_path / "run")
    return records(tmp_path / "run"), updated


@pytest.mark.parametrize("schedule", ["sync", "async"])
def test_no_trained_group_has_tied_scores(tmp_path, monkeypatch, schedule):
    steps, updated = run(tmp_path, monkeypatch, "train.num_steps=2", f"schedule={schedule}",
                         "reward.functions=[{name: tie_rewards.half_tied}]", "algorithm.max_resample_rounds=8")
    assert len(updated) == 2
    for batch in updated:
        groups = batch.scores.view(-1, 4)  # rows of a group are contiguous, 4 per prompt
        assert groups.shape[0] == 4 and batch.group_id.tolist() == [g for g in range(4) for _ in range(4)]
        assert (groups.std(dim=1) > 0).all()
    for step in (1, 2):
        assert steps[step]["dynamic_sampling/kept_groups"] == 4
        assert 0 < steps[step]["dynamic_sampling/kept_share"] < 1 and steps[step]["dynamic_sampling/rounds"] >= 2


def test_all_tied_rewards_stop_after_the_rounds_limit(tmp_path, monkeypatch, caplog):
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        steps, updated = run(tmp_path, monkeypatch, "train.num_steps=1", "reward.functions=[{name: tie_rewards.tied}]",
                             "algorithm.max_resample_rounds=2")
    assert steps[1]["dynamic_sampling/rounds"] == 3 and steps[1]["dynamic_sampling/kept_groups"] == 0
    assert steps[1]["dynamic_sampling/kept_share"] == 0 and len(updated[0]) == 16  # the last batch, as it is
    assert "algorithm.max_resample_rounds=2" in caplog.text
