"""A failed episode is not a zero either: the built-in `arith_retry` environment, made to raise for chosen episodes,
has only those played again (fresh, same task) within `env.failed_retries`; one that works on its retry is a row like
any other; one that still fails leaves its group as an unscored row does; past `env.max_failed_share` the run stops
naming the environment, the last complete step saved."""

from __future__ import annotations

import json

import pytest
import torch

from rlhf.config import compose_config, validate
from rlhf.envs.builtin import ArithRetryMaker
from rlhf.run.build import build_components
from rlhf.step.collector import EpisodesFailed, LostEpisodes
from rlhf.step.scored import group_rows, take_groups
from rlhf.train import train

# episodes made, in order (the task's text), and the make indices whose episode raises in step()
FLAKY: dict = {"made": [], "fail": set(), "fail_from": None, "of_16": 16}
RUN = ["env=arith_retry", "env.name=test_episode_retries.FlakyArith", "model=tiny_arith_retry", "train.prompts_per_step=4",
       "algorithm.num_samples_per_prompt=4", "train.micro_batch_size=16", "logging.tensorboard=false",
       "checkpoint.save_final_model=false"]


class Broken:
    """An `arith_retry` episode whose service fell over: reset works, step raises."""

    def __init__(self, episode) -> None:
        self.episode = episode

    def reset(self, seed: int):
        return self.episode.reset(seed)

    def step(self, action: str):
        raise ConnectionError("the environment's server went away")


class FlakyArith(ArithRetryMaker):
    """(By import path, so no other test's registry sees it.) The built-in `arith_retry`, whose n-th episode made raises in step() when n is in FLAKY["fail"] (or from
    make FLAKY["fail_from"] on, the first FLAKY["of_16"] of each 16 made)."""

    def make(self, task):
        episode = super().make(task)
        n = len(FLAKY["made"])
        FLAKY["made"].append(task.text)
        late = FLAKY["fail_from"] is not None and n >= FLAKY["fail_from"] and (n - FLAKY["fail_from"]) % 16 < FLAKY["of_16"]
        broken = n in FLAKY["fail"] or late
        return Broken(episode) if broken else episode


def built(*more: str):
    cfg = compose_config([*RUN, *more])
    return build_components(validate(cfg))


def collect(c, fail: set[int]):
    FLAKY.update(made=[], fail=fail, fail_from=None)
    torch.manual_seed(3)
    return c.collector.collect()


def test_only_the_failed_episodes_are_played_again_and_a_success_is_a_normal_row():
    c = built("env.failed_retries=1")
    try:
        scored = collect(c, {1, 6})  # one episode of the first task, one of the second
    finally:
        c.close()
    first = FLAKY["made"][:16]
    assert FLAKY["made"][16:] == [first[1], first[6]]  # those two again, nothing else
    assert len(scored.batch) == 16 and group_rows(scored.batch.group_id) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert scored.prompts[1] == first[1] and scored.prompts[6] == first[6]  # in their failed episodes' places
    assert scored.batch.loss_mask[[1, 6]].sum(dim=1).gt(0).all()  # played: actions to train on
    m = scored.metrics
    assert (m["env/retried_episodes"], m["env/failed_episodes"], m["env/failed_share"]) == (2.0, 0.0, 0.0)
    assert m["env/failed_dropped_groups"] == 0.0 and m["env/num_episodes"] == 16


def test_an_episode_that_fails_its_retries_too_leaves_its_group_as_if_never_drawn():
    """Make 1 fails, and so does its one retry (make 16); make 5's retry (17) works. GRPO needs 2 per group: group 0
    trains its 3 others, its advantages those of the 3 alone."""
    c = built("env.failed_retries=1")
    try:
        scored = collect(c, {1, 5, 16})
        made = FLAKY["made"]
        assert made[16:] == [made[1], made[5]]  # one retry each (env.failed_retries=1)
        m = scored.metrics
        assert (m["env/retried_episodes"], m["env/failed_episodes"], m["env/failed_share"]) == (2.0, 1.0, 1 / 16)
        assert [len(g) for g in group_rows(scored.batch.group_id)] == [3, 4, 4, 4]
        assert m["env/num_episodes"] == 15 and m["env/failed_dropped_groups"] == 0.0
        whole, _ = c.learner.prepare(scored)
        alone, _ = c.learner.prepare(take_groups(scored, [[0, 1, 2]]))
        assert torch.equal(whole.advantages[:3], alone.advantages)
    finally:
        c.close()


def test_a_group_left_under_the_estimators_size_goes():
    c = built("env.failed_retries=0", "env.max_failed_share=0.5")
    try:
        scored = collect(c, {0, 1, 2})  # group 0 keeps one episode, under GRPO's 2
    finally:
        c.close()
    assert FLAKY["made"][16:] == []  # no retries asked for
    m = scored.metrics
    assert (m["env/failed_episodes"], m["env/failed_dropped_groups"], m["env/short_group_episodes"]) == (3.0, 1.0, 1.0)
    assert len(scored.batch) == 12 and scored.tasks == [1, 2, 3]


def test_past_the_share_the_run_stops_naming_the_environment_with_the_last_step_saved(tmp_path):
    """Step 1's episodes work; from step 2 on every episode and every retry raises: the breaker stops the run. (A
    one-step run first counts the episodes made before step 2: the start's parity check plays some too.)"""
    run = [*RUN, "eval.greedy=false", "eval.num_samples=0", "checkpoint.every=1", "env.failed_retries=2"]
    FLAKY.update(made=[], fail=set(), fail_from=None)
    train(compose_config([*run, "train.num_steps=1"]), tmp_path / "one_step")
    FLAKY.update(made=[], fail=set(), fail_from=len(FLAKY["made"]))
    out = tmp_path / "run"
    with pytest.raises(EpisodesFailed, match=r"16 of the batch's 16 episodes failed in environment 'test_episode_retries.FlakyArith' "
                       r"after env.failed_retries=2, past env.max_failed_share=0.5 \(0 more went .*ConnectionError.*\); the failure is the "
                       r"environment's \(or the agent's\), not the policy's: fix it \(or raise env.max_failed_share\)"):
        train(compose_config([*run, "train.num_steps=3"]), out)
    step_2 = FLAKY["made"][FLAKY["fail_from"]:]
    assert len(step_2) == 16 * 3 and step_2[:16] == step_2[16:32] == step_2[32:]  # played, then twice again
    saved = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert saved == ["step_00000001"]
    assert json.loads((out / "checkpoints" / "step_00000001" / "trainer_state.json").read_text())["step"] == 1


def test_lost_episodes_add_up_over_plays_and_the_breaker_reads_the_sum():
    """The stream plays a step's groups in several plays: their losses add up and the breaker reads the sum (one
    play losing 3 of its 4 is not past 0.5 of the step's 16), and a step that kept nothing stops whatever the share."""
    a = LostEpisodes("arith_retry", 0.5, 1, 2, total=4, failed=3, short=1, first="ConnectionError('down')")
    b = LostEpisodes("arith_retry", 0.5, 1, 2, total=12, failed=2, short=0, first="TimeoutError()")
    with pytest.raises(EpisodesFailed, match=r"3 of the batch's 4 episodes failed"):
        a.check()
    step = a.plus(b)
    assert (step.total, step.failed, step.short, step.first) == (16, 5, 1, "ConnectionError('down')")
    step.check()  # 5 of 16 failed: under 0.5, and episodes were kept
    with pytest.raises(EpisodesFailed, match=r"5 of the batch's 16 .* the first error: ConnectionError\('down'\)"):
        step.check(kept=False)  # the step's taken groups all came back empty
    a.check(training=False, kept=True)  # an evaluation has no share limit


def test_under_the_stream_schedule_the_breaker_stops_the_run_at_the_step_whose_episodes_failed(tmp_path):
    """schedule=stream plays episodes on its producer thread, a step ahead: once 10 of every 16 fail (two groups
    whole, two episodes of a third: the play keeps 6), the check of the step that took them stops the run naming the
    environment, the steps before it saved."""
    run = [*RUN, "schedule=stream", "eval.greedy=false", "eval.num_samples=0", "checkpoint.every=1", "env.failed_retries=0"]
    FLAKY.update(made=[], fail=set(), fail_from=None)
    train(compose_config([*run, "train.num_steps=1"]), tmp_path / "one_step")  # the start's checks, step 1, and a step ahead
    FLAKY.update(made=[], fail=set(), fail_from=len(FLAKY["made"]), of_16=10)
    out = tmp_path / "run"
    try:
        with pytest.raises(EpisodesFailed, match=r"10 of the batch's 16 episodes failed in environment 'test_episode_retries.FlakyArith' "
                           r"after env.failed_retries=0, past env.max_failed_share=0.5"):
            train(compose_config([*run, "train.num_steps=4"]), out)
    finally:
        FLAKY["of_16"] = 16
    saved = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert saved and saved == [f"step_{n:08d}" for n in range(1, len(saved) + 1)] and len(saved) < 4, saved
    assert FLAKY["made"][FLAKY["fail_from"]:], "no episode failed: the breaker had nothing to stop"
