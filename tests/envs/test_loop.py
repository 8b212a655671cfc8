"""The agent loop with the real HF generator on a tiny model: the tokens and logprobs the trainer uses are exactly
what the generator sampled, observations are masked, faults lose episodes (never the run), budgets truncate."""

from __future__ import annotations

from dataclasses import fields

import asyncio
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from rlhf.data.prompts import PromptExample, PromptStream
from rlhf.envs.base import EnvConfig, check_prompt_room
from rlhf.errors import ConfigError
from rlhf.envs.loop import EpisodeRunner
from rlhf.trajectory import group_size
from rlhf.envs.rows import episode_rows
from rlhf.generators.base import SamplingParams
from rlhf.training.policy import TorchPolicy
from rlhf.step.collector import Collector
from rlhf.step.scored import group_rows, kept_groups
from rlhf.step.learner import sample_train_gap

CPU = torch.device("cpu")


def env_cfg(**overrides):
    values = dict(name="toy", template="no", num_parallel=3, max_turns=3, max_tokens=64, max_concurrency=4,
                  step_timeout_s=30.0, failed_retries=0, max_failed_share=0.5, reward_reduce="sum", eval_size=32)
    assert set(values) == {f.name for f in fields(EnvConfig)}  # every key the agent loop may read
    return SimpleNamespace(**values | overrides)


class Retry:
    """Asks `1+2=` up to three times; reward 1 for a `3`, else the question again. ``fault`` breaks it on purpose."""

    def __init__(self, fault: str | None = None) -> None:
        self.fault, self.turn = fault, 0

    def reset(self, seed: int):
        return "1+2=", {"seed": seed}

    def step(self, action: str):
        self.turn += 1
        if self.fault == "raise":
            raise KeyError("the user's environment broke")
        if self.fault == "hang":
            time.sleep(30)
        if self.fault == "exit":
            sys.exit(0)
        if self.fault == "malformed":
            return ("1+2=", 1.0)
        right = action == "3"
        return "1+2=", float(right) + 0.1 * self.turn, right, False, {"success": right}


class AsyncRetry(Retry):
    async def step(self, action: str):  # noqa: D102 - an async environment runs the same way
        await asyncio.sleep(0)
        return Retry.step(self, action)


class Maker:
    uses_dataset = False

    def __init__(self, faults: dict[int, str] | None = None, cls=Retry) -> None:
        self.faults, self.cls, self.made = faults or {}, cls, 0

    def make(self, task):
        env = self.cls(self.faults.get(self.made))
        self.made += 1
        return env


class Recording:
    """The real generator, remembering what every generate call returned for which context."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, []

    def generate(self, prompts, sampling):
        out = self.inner.generate(prompts, sampling)
        self.calls.append((prompts, out))
        return out


def sampled_actions(recording: Recording) -> list[tuple[list[int], list[int], list[float]]]:
    """(context, action tokens, logprobs) of every row the generator returned."""
    found = []
    for prompts, out in recording.calls:
        for row, prompt in enumerate(prompts):
            keep = out.loss_mask[row].bool()
            found.append((list(prompt), out.window_ids[row][keep].tolist(), out.gen_logp[row][keep].tolist()))
    return found


def play(make_generator, tiny_model_dir, tokenizer, maker, cfg, groups=2, group_size=3, max_new_tokens=4):
    recording = Recording(make_generator(tiny_model_dir))
    runner = EpisodeRunner(maker, cfg, tokenizer, tokenizer.eos_token_id)
    torch.manual_seed(0)
    episodes = runner.run(recording, [None] * groups, list(range(groups)), group_size, SamplingParams(max_new_tokens))
    return episodes, recording


def test_trained_tokens_and_logprobs_are_the_sampled_ones(make_generator, tiny_model_dir, tokenizer, policy_cfg, model_cfg, train_cfg):
    episodes, recording = play(make_generator, tiny_model_dir, tokenizer, Maker(), env_cfg())
    assert len(episodes) == 6 and not any(ep.failed for ep in episodes)
    assert any(len(ep.turns) > 1 for ep in episodes), "the random tiny model should need a retry somewhere"
    batch = episode_rows(episodes, "sum", tokenizer.pad_token_id)
    sampled = sampled_actions(recording)
    start = batch.window_start
    for row, ep in enumerate(episodes):
        real = batch.input_ids[row][batch.attention_mask[row].bool()].tolist()
        assert real == ep.token_ids()
        # walk the turns: each action equals what the generator returned for exactly the context before it
        context = []
        for turn in ep.turns:
            context += turn.observation_ids
            assert (context, turn.action_ids, turn.action_logp) in sampled
            context += turn.action_ids
        # in the row: action tokens carry mask 1 and the sampled logprob; observation tokens mask 0 and logprob 0
        window_len = int(batch.attention_mask[row, start:].sum())
        window = batch.input_ids[row, start : start + window_len].tolist()
        mask = batch.loss_mask[row, :window_len].tolist()
        logp = batch.gen_logp[row, :window_len].tolist()
        flat = [(i, 1.0, lp) for t in ep.turns for i, lp in zip(t.action_ids, t.action_logp)]
        obs = [i for t in ep.turns[1:] for i in t.observation_ids]
        assert [(i, m, lp) for i, m, lp in zip(window, mask, logp) if m == 1.0] == flat
        assert sorted(i for i, m in zip(window, mask) if m == 0.0) == sorted(obs)
        assert all(lp == 0.0 for m, lp in zip(mask, logp) if m == 0.0)
    # the trainer's own logprobs on the assembled rows (whole history as context) match the generator's
    policy = TorchPolicy(policy_cfg, model_cfg, train_cfg(), total_optimizer_steps=1, device=CPU)
    trained, _ = policy.rollout_logprobs(batch, chunk=8)
    gap = sample_train_gap(batch.gen_logp, trained, batch.loss_mask)
    assert gap["val/generator_logprob_diff"] < 1e-4, gap


def test_turn_rewards_sit_on_each_turns_last_action_token(make_generator, tiny_model_dir, tokenizer):
    episodes, _ = play(make_generator, tiny_model_dir, tokenizer, Maker(), env_cfg())
    for reduce in ("sum", "last"):
        batch = episode_rows(episodes, reduce, tokenizer.pad_token_id)
        for row, ep in enumerate(episodes):
            rewards = [t.reward for t in ep.turns]
            expected = sum(rewards) if reduce == "sum" else rewards[-1]
            assert batch.scores[row].item() == pytest.approx(expected)
            nonzero = batch.turn_rewards[row][batch.turn_rewards[row] != 0].tolist()
            assert nonzero == pytest.approx(rewards if reduce == "sum" else rewards[-1:])
    assert batch.group_id.tolist() == [0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("cls", [Retry, AsyncRetry])
def test_faults_lose_their_episodes_not_their_groups_nor_the_run(make_generator, tiny_model_dir, tokenizer, cls, caplog):
    faults = {1: "raise", 4: "malformed"}
    episodes, _ = play(make_generator, tiny_model_dir, tokenizer, Maker(faults, cls), env_cfg(), groups=3)
    failed = [i for i, ep in enumerate(episodes) if ep.failed]
    assert failed == [1, 4]
    assert "KeyError" in episodes[1].error and "step() must return" in episodes[4].error
    groups, lost = group_rows(torch.tensor([ep.group for ep in episodes])), [ep.failed for ep in episodes]
    assert kept_groups(groups, lost, min_group=2) == [[0, 2], [3, 5], [6, 7, 8]]  # groups of 3: the two hit keep 2 each
    assert kept_groups(groups, lost, min_group=3) == [[6, 7, 8]]  # an estimator that needs 3: the hit groups go whole
    assert sum("episode lost" in r.message for r in caplog.records) == 2  # each distinct error logged once


def test_a_hung_step_times_out(make_generator, tiny_model_dir, tokenizer):
    start = time.perf_counter()
    episodes, _ = play(make_generator, tiny_model_dir, tokenizer, Maker({0: "hang"}), env_cfg(step_timeout_s=0.5), groups=1)
    assert episodes[0].failed and "env.step_timeout_s=0.5" in episodes[0].error
    assert not any(ep.failed for ep in episodes[1:])
    assert time.perf_counter() - start < 25  # the 30 s sleep was abandoned, not waited for


@pytest.mark.parametrize("cls", [Retry, AsyncRetry])
def test_sys_exit_in_step_loses_its_episode_at_once(make_generator, tiny_model_dir, tokenizer, cls):
    """A step() calling sys.exit is the user's error, reported at once (not a stopped event loop and a timeout)."""
    cfg = env_cfg(step_timeout_s=120.0)  # a timeout would name env.step_timeout_s instead of the SystemExit
    episodes, _ = play(make_generator, tiny_model_dir, tokenizer, Maker({0: "exit"}, cls), cfg, groups=2)
    assert episodes[0].failed and episodes[0].error.startswith("step: EnvError: SystemExit(0) raised")
    assert not any(ep.failed for ep in episodes[1:])  # the other episodes, on the same loop, go on


def test_every_episode_failing_stops_the_run(make_generator, tiny_model_dir, tokenizer):
    runner = EpisodeRunner(Maker({i: "raise" for i in range(4)}), env_cfg(), tokenizer, tokenizer.eos_token_id)
    tasks = [PromptExample("", (), ground_truth=s) for s in (5, 6)]
    collector = Collector(make_generator(tiny_model_dir), tokenizer, None, PromptStream(tasks, seed=1), SamplingParams(4),
                          prompts_per_step=2, samples_per_prompt=2, env=runner)
    with pytest.raises(RuntimeError, match="4 of the batch's 4 episodes failed.*env.max_failed_share=0.5.*KeyError"):
        collector.collect()


@pytest.mark.parametrize("share, stops", [(0.5, False), (0.2, True)])
def test_a_batch_stops_the_run_only_past_the_failed_share(make_generator, tiny_model_dir, tokenizer, share, stops):
    """One episode of four fails (25%): the run goes on with a group of one less under env.max_failed_share=0.5 (GRPO's
    advantages over the ragged groups), and stops under 0.2, naming the key."""
    runner = EpisodeRunner(Maker({1: "raise"}), env_cfg(max_failed_share=share), tokenizer, tokenizer.eos_token_id)
    tasks = [PromptExample("", (), ground_truth=s) for s in (5, 6)]
    collector = Collector(make_generator(tiny_model_dir), tokenizer, None, PromptStream(tasks, seed=1), SamplingParams(4),
                          prompts_per_step=2, samples_per_prompt=2, env=runner, min_group=1)
    if stops:
        with pytest.raises(RuntimeError, match=r"1 of the batch's 4 episodes failed .*env.max_failed_share=0.2"):
            collector.collect()
        return
    scored = collector.collect()
    assert scored.batch.group_id.tolist() == [0, 1, 1] and scored.metrics["env/failed_episodes"] == 1.0
    assert group_size(scored.batch.group_id).tolist() == [1, 2]


def test_token_budget_truncates_the_action_and_ends_the_episode(make_generator, tiny_model_dir, tokenizer):
    prompt_len = len(tokenizer("1+2=")["input_ids"])
    cfg = env_cfg(max_tokens=prompt_len + 2)
    episodes, _ = play(make_generator, tiny_model_dir, tokenizer, Maker(), cfg, max_new_tokens=6)
    assert all(len(ep.token_ids()) <= cfg.max_tokens for ep in episodes)
    cut = [ep for ep in episodes if ep.end == "max_tokens" and not ep.stopped]  # the action was cut to the budget
    assert cut and all(ep.turns[-1].reward == 0.0 and len(ep.turns[-1].action_ids) == 2 for ep in cut)


def test_a_first_observation_that_fills_env_max_tokens_names_the_key_and_the_fix(make_generator, tiny_model_dir, tokenizer):
    """Before: the episodes ended with no action and the batch failed later with "episodes with no action token cannot
    be trained on", naming neither env.max_tokens nor the prompt's length."""
    prompt_len = len(tokenizer("1+2=")["input_ids"])
    cfg = env_cfg(max_tokens=prompt_len)
    episodes, recording = play(make_generator, tiny_model_dir, tokenizer, Maker(), cfg, groups=1)
    assert all(ep.failed for ep in episodes) and not recording.calls  # nothing generated for them
    assert f"is {prompt_len} tokens, which fills env.max_tokens={prompt_len}" in episodes[0].error
    assert f"raise env.max_tokens above {prompt_len}" in episodes[0].error


def test_env_max_tokens_that_no_prompt_fits_is_a_config_error_before_models_load():
    prompts = [PromptExample(f"p{n}", tuple(range(n)), ground_truth=0) for n in (5, 6, 9)]
    with pytest.raises(ConfigError, match=r"env.max_tokens=5 .*at least 5 tokens \(the longest 9\); raise env.max_tokens above 9"):
        check_prompt_room(prompts, max_tokens=5)
    assert check_prompt_room(prompts, max_tokens=6) == 2  # two prompts leave no room: counted, for a warning
    assert check_prompt_room(prompts, max_tokens=10) == 0


def test_a_run_whose_env_max_tokens_no_prompt_fits_stops_before_any_model_loads(tmp_path, monkeypatch):
    """`experiment=multiturn_tiny env.max_tokens=5`: before, the parity gate (models loaded) failed with "episodes with
    no action token cannot be trained on", naming neither the key nor the prompts' length."""
    from rlhf.config import compose_config
    from rlhf.run import build
    from rlhf.train import train

    monkeypatch.setattr(build, "build_local_models", lambda *a, **k: pytest.fail("a model loaded before the refusal"))
    with pytest.raises(ConfigError, match=r"^env.max_tokens=5 \(tokens per episode, prompt included\) leaves no room"):
        train(compose_config(["experiment=multiturn_tiny", "env.max_tokens=5", "train.num_steps=1"]), tmp_path / "run")


def test_max_turns_ends_running_episodes(make_generator, tiny_model_dir, tokenizer):
    episodes, _ = play(make_generator, tiny_model_dir, tokenizer, Maker(), env_cfg(max_turns=1))
    assert all(len(ep.turns) == 1 for ep in episodes)
    assert {ep.end for ep in episodes} <= {"terminated", "max_turns"}
    assert all(ep.end == "terminated" for ep in episodes if ep.turns[0].action == "3")


def test_a_dataset_prompt_keeps_the_datasets_own_tokens(make_generator, tiny_model_dir, tokenizer):
    """When `reset` returns the row's text, the episode starts with the row's token ids (as a single-turn run would)."""
    class Echo(Retry):
        def __init__(self, task) -> None:
            super().__init__()
            self.task = task

        def reset(self, seed: int):
            return self.task.text, {}

    class RowMaker:
        uses_dataset = True

        def make(self, task):
            return Echo(task)

    row = PromptExample(text="1+2=", token_ids=tuple(tokenizer("1+2=", add_special_tokens=False)["input_ids"]), ground_truth="3")
    other = PromptExample(text="1+2=", token_ids=(), ground_truth="3")  # no tokens of its own: tokenised like a prompt
    runner = EpisodeRunner(RowMaker(), env_cfg(max_turns=1), tokenizer, tokenizer.eos_token_id)
    episodes = runner.run(make_generator(tiny_model_dir), [row, other], [0, 1], 1, SamplingParams(4))
    assert episodes[0].turns[0].observation_ids == list(row.token_ids)  # no BOS: the row's own tokenisation
    assert episodes[1].turns[0].observation_ids == tokenizer("1+2=")["input_ids"]  # BOS added


def test_an_evaluation_that_loses_every_episode_is_reported_not_the_runs_end(make_generator, tiny_model_dir, tokenizer):
    runner = EpisodeRunner(Maker({i: "raise" for i in range(8)}), env_cfg(), tokenizer, tokenizer.eos_token_id)
    tasks = [PromptExample("", (), ground_truth=s) for s in (5, 6)]
    collector = Collector(make_generator(tiny_model_dir), tokenizer, None, PromptStream(tasks, seed=1), SamplingParams(4),
                          prompts_per_step=2, samples_per_prompt=2, env=runner)
    metrics, results = collector.evaluate(tasks, SimpleNamespace(max_prompts=None, greedy=True, num_samples=0))
    assert metrics == {"eval/greedy_failed_episodes": 2.0} and results == {}
