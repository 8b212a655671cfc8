"""dataset=reasoning_gym and reward=reasoning_gym: seeded problems whose ground truth scores with the task's own check."""

from __future__ import annotations

import multiprocessing
import pickle
from concurrent.futures import ProcessPoolExecutor

import pytest
import reasoning_gym

from rlhf.config import ConfigError, compose_config, validate
from rlhf.data.reasoning_gym import reasoning_gym_dataset
from rlhf.models.loading import load_tokenizer
from rlhf.rewards import reasoning_gym as reward_module
from rlhf.rewards.reasoning_gym import reasoning_gym_reward

TASKS = ["basic_arithmetic", "chain_sum"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("builtin:tiny_arith")


def dataset_config(*overrides: str):
    cfg = compose_config([
        "dataset=reasoning_gym", "reward=reasoning_gym", f"dataset.tasks=[{','.join(TASKS)}]", "dataset.train_size=6",
        "dataset.eval_size=2", "dataset.chat_template=simple_concat_with_space", *overrides,
    ])
    validate(cfg)
    return cfg.dataset


def build(tokenizer, seed=1, *overrides: str):
    return reasoning_gym_dataset(cfg=dataset_config(*overrides), tokenizer=tokenizer, seed=seed)


def test_sizes_per_task_and_the_ground_truth_is_the_generated_entry(tokenizer):
    splits = build(tokenizer)
    assert len(splits.train) == 12 and len(splits.eval) == 4
    for task in TASKS:
        problems = reasoning_gym.create_dataset(task, size=8, seed=1)
        train = [e.ground_truth for e in splits.train if e.ground_truth["task"] == task]
        evals = [e.ground_truth for e in splits.eval if e.ground_truth["task"] == task]
        assert [t["entry"] for t in train] == [problems[i] for i in range(6)]
        assert [t["entry"] for t in evals] == [problems[i] for i in range(6, 8)]  # after the training indices
    example = splits.train[0]
    assert example.text == f"{example.ground_truth['entry']['question']} Give only the final answer inside <answer></answer> tags."
    assert [r["kept"] for r in splits.report["sources"]] == [6, 2, 6, 2]


def test_the_run_seed_decides_the_problems(tokenizer):
    assert [e.text for e in build(tokenizer, seed=1).train] == [e.text for e in build(tokenizer, seed=1).train]
    assert [e.text for e in build(tokenizer, seed=1).train] != [e.text for e in build(tokenizer, seed=2).train]


def test_no_eval_problems_means_eval_on_train_and_long_prompts_are_dropped(tokenizer):
    splits = build(tokenizer, 1, "dataset.eval_size=0", "dataset.max_prompt_length=40", "dataset.prompt_suffix=null")
    assert splits.eval == splits.train
    assert sum(r["too_long"] for r in splits.report["sources"]) + len(splits.train) == 12
    assert all(len(e.token_ids) <= 40 for e in splits.train)
    with pytest.raises(ValueError, match="dataset.max_prompt_length=5 tokens"):
        build(tokenizer, 1, "dataset.max_prompt_length=5")


def truths(n=1):
    problems = reasoning_gym.create_dataset("basic_arithmetic", size=n, seed=3)
    return [{"task": "basic_arithmetic", "entry": problems[i]} for i in range(n)]


def test_reward_scores_the_tagged_answer_with_the_tasks_check():
    (truth,) = truths()
    answer = truth["entry"]["answer"]
    responses = [f"So <answer>{answer}</answer>", "<answer>x</answer>", answer, "<answer> </answer>", ""]
    scores = reasoning_gym_reward(prompts=[""] * 5, responses=responses, ground_truths=[truth] * 5)
    assert list(scores) == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert scores.metrics == {"no_answer_rate": 0.6, "scorer_error_rate": 0.0}
    partial = reasoning_gym_reward(prompts=[""], responses=[f"<answer>{answer} ok</answer>"], ground_truths=[truth])
    package = reasoning_gym.get_score_answer_fn("basic_arithmetic")(f"{answer} ok", truth["entry"])
    assert 0 < package < 1 and list(partial) == [package]  # the task's own partial credit, unchanged
    untagged = reasoning_gym_reward(prompts=[""], responses=[f" {answer}\n"], ground_truths=[truth], answer_tag=None)
    assert list(untagged) == [1.0]


def test_a_scorer_that_raises_scores_zero(monkeypatch):
    def broken(answer, entry):
        raise RuntimeError("cannot parse")

    monkeypatch.setattr(reward_module, "task_scorer", lambda task: broken)
    scores = reasoning_gym_reward(prompts=[""], responses=["<answer>x</answer>"], ground_truths=truths())
    assert list(scores) == [0.0] and scores.metrics["scorer_error_rate"] == 1.0


def test_reward_needs_reasoning_gym_ground_truths():
    with pytest.raises(ValueError, match="needs the ground truths of dataset=reasoning_gym"):
        reasoning_gym_reward(prompts=[""], responses=["<answer>7</answer>"], ground_truths=["7"])


def test_ground_truths_score_in_another_process(tokenizer):
    """What a Ray reward worker does: unpickle the ground truths and rebuild the task's scorer there."""
    splits = build(tokenizer)
    truths_ = [e.ground_truth for e in splits.train]
    responses = [f"<answer>{t['entry']['answer']}</answer>" for t in truths_]
    assert pickle.loads(pickle.dumps(truths_)) == truths_
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        scores = pool.submit(reasoning_gym_reward, prompts=[""] * 12, responses=responses, ground_truths=truths_)
        assert list(scores.result(timeout=120)) == [1.0] * 12


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["dataset=reasoning_gym", "dataset.tasks=[basic_arithmetic,no_such_task]"],
         r"dataset.tasks: unknown reasoning-gym task\(s\) \['no_such_task'\]; valid tasks: .*basic_arithmetic, .*chain_sum"),
        (["dataset=reasoning_gym", "dataset.tasks=[]"], r"dataset.tasks is empty"),
        (["dataset=reasoning_gym", "dataset.tasks=[chain_sum,chain_sum]"], r"names a task twice"),
        (["dataset=reasoning_gym", "dataset.train_size=0"], r"dataset.train_size=0 must be >= 1"),
        (["reward=reasoning_gym"], r"reward.functions\[0\].name=reasoning_gym scores the prompts of dataset=reasoning_gym"),
        (["dataset=arith", "dataset.tasks=[chain_sum]"], r"dataset.tasks is not a key of dataset arith .* key of dataset=reasoning_gym"),
    ],
)
def test_bad_settings_fail_before_anything_loads(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose_config(overrides))
