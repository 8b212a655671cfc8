"""`arith_retry`: addition, asked again after a wrong answer; the retry-aware warm start; the preset learns."""

from __future__ import annotations

from dataclasses import fields

import random
from collections import Counter

import pytest
import torch
from omegaconf import OmegaConf

from rlhf import registry, warmstart
from rlhf.config.schema import RewardConfig, RewardFunctionConfig
from rlhf.envs.base import EnvConfig
from rlhf.data.prompts import PromptExample
from rlhf.envs.builtin import ArithRetryConfig, ArithRetryMaker
from rlhf.errors import ConfigError
from rlhf.models.loading import load_causal_lm, load_tokenizer
from rlhf.rewards.combine import RewardSet

TASK = PromptExample(text="3+4=", token_ids=(), ground_truth="7")


def maker(max_turns: int = 2, **reward) -> ArithRetryMaker:
    """A maker over the arith rewards (arith_correct 1.0, integer_format 0.1) or ``reward``."""
    functions = [
        RewardFunctionConfig(name="arith_correct"), RewardFunctionConfig(name="integer_format", weight=0.1)
    ]
    cfg = OmegaConf.structured(RewardConfig(**{"functions": functions, **reward}))
    env = EnvConfig(name="arith_retry", max_turns=max_turns)
    return ArithRetryMaker(cfg=env, tokenizer=None, rewards=RewardSet(cfg))


def test_registered_with_its_keys():
    assert registry.resolve("env", "arith_retry") is ArithRetryMaker
    assert ArithRetryMaker.config is ArithRetryConfig and ArithRetryMaker.uses_dataset is True
    assert {f.name for f in fields(ArithRetryConfig)} == {f.name for f in fields(EnvConfig)}  # no keys of its own
    assert (ArithRetryConfig().max_turns, ArithRetryConfig().max_tokens) == (2, 32)  # its defaults: one retry


def test_a_right_first_answer_ends_the_episode_with_full_reward():
    env = maker().make(TASK)
    assert env.reset(seed=5) == ("3+4=", {})
    observation, reward, terminated, truncated, info = env.step("7")
    assert (observation, terminated, truncated, info["success"], info["attempt"]) == ("", True, False, True, 1)
    assert reward == pytest.approx(1.1)  # arith_correct 1.0 + 0.1 integer_format


@pytest.mark.parametrize(
    ("retry", "reward", "success"), [("7", 0.55, True), ("8", 0.05, False), ("", 0.0, False)]
)
def test_a_wrong_answer_is_asked_again_once_at_half_reward(retry, reward, success):
    env = maker().make(TASK)
    env.reset(seed=0)
    observation, first, terminated, truncated, info = env.step("8")
    assert (observation, terminated, truncated, info["success"]) == ("3+4=", False, False, False)
    assert first == pytest.approx(0.1)  # a wrong integer: the format reward only
    observation, second, terminated, truncated, info = env.step(retry)
    assert (observation, terminated, truncated) == ("", True, False)
    assert (info["success"], info["attempt"]) == (success, 2)
    assert second == pytest.approx(reward)


def test_returns_rank_first_try_above_retry_above_two_misses():
    def episode_return(*answers: str) -> float:
        env = maker().make(TASK)
        env.reset(seed=0)
        return sum(env.step(answer)[1] for answer in answers)

    assert episode_return("7") > episode_return("8", "7") > episode_return("8", "8") > episode_return("x", "x")


def test_reset_starts_a_fresh_episode():
    env = maker().make(TASK)
    env.reset(seed=0)
    env.step("8")
    env.reset(seed=0)
    assert env.step("8")[2] is False, "after reset the first answer again earns a retry"


def test_observations_use_only_the_tiny_models_alphabet():
    tokenizer = load_tokenizer("builtin:tiny_arith_retry")
    env = maker().make(PromptExample(text="9+9=", token_ids=(), ground_truth="18"))
    first, _ = env.reset(seed=0)
    again = env.step("17")[0]
    for text in (first, again):
        assert tokenizer.unk_token_id not in tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_run_without_a_verifier_or_with_a_reward_model_is_refused():
    with pytest.raises(ConfigError, match="use reward=arith"):
        maker(functions=[RewardFunctionConfig(name="length_penalty")])
    with pytest.raises(ConfigError, match="reward.path=null"):
        maker(path="rm")


def test_one_turn_is_refused_naming_max_turns():
    with pytest.raises(ConfigError, match="env.max_turns=1 leaves no turn for the retry; set env.max_turns=2"):
        maker(max_turns=1)


def test_the_retry_warm_start_writes_the_turns_as_the_environment_plays_them():
    """Every demonstration is an episode of the environment: the problem again after a wrong answer, nothing
    after a right one; the loss covers the answers and their EOS only."""
    tokenizer = load_tokenizer("builtin:tiny_arith_retry")
    examples = warmstart.build_examples(tokenizer, max_operand=2, per_problem=16, seed=0, retry=True)
    retried = 0
    for ids, trained in examples:
        prompt, *answers = tokenizer.decode(ids).removeprefix("<bos>").split("<eos>")
        problem = prompt[: prompt.index("=") + 1]
        truth = str(sum(map(int, problem[:-1].split("+"))))
        env = maker().make(PromptExample(text=problem, token_ids=(), ground_truth=truth))
        assert env.reset(seed=0)[0] == problem and answers[-1] == ""
        observation, _, done, _, _ = env.step(prompt[len(problem) :])
        if not done:
            retried += 1
            assert answers[0].startswith(observation)
        assert len(answers) == (1 if done else 2)
        loss_text = tokenizer.decode([i for i, t in zip(ids, trained) if t])
        retry = "" if done else answers[0][len(observation) :] + "<eos>"
        assert loss_text == prompt[len(problem) :] + "<eos>" + retry
    assert 0.5 < retried / len(examples) < 0.9  # about 70% of first answers are wrong


def test_retry_demonstrations_follow_the_advertised_mix():
    rng = random.Random(0)
    kinds = Counter()
    for _ in range(4000):
        reply = warmstart.retry_demonstration("7", "8", rng, 18)
        kinds["correct" if reply == "7" else "repeat" if reply == "8" else "other"] += 1
    assert abs(kinds["correct"] / 4000 - (0.30 + 0.2 / 19)) < 0.03
    assert abs(kinds["repeat"] / 4000 - (0.40 + 0.2 / 19)) < 0.03


def retry_answers(model_name: str, samples: int = 64) -> Counter:
    """What ``model_name`` samples after `<bos>3+4=8<eos>3+4=` (a wrong first answer, the problem again)."""
    torch.manual_seed(0)
    tokenizer, model = load_tokenizer(model_name), load_causal_lm(model_name)
    context = tokenizer("3+4=")["input_ids"] + tokenizer("8", add_special_tokens=False)["input_ids"]
    context += [tokenizer.eos_token_id] + tokenizer("3+4=", add_special_tokens=False)["input_ids"]
    inputs = torch.tensor([context] * samples)
    with torch.no_grad():
        out = model.generate(
            inputs, attention_mask=torch.ones_like(inputs), do_sample=True, max_new_tokens=4,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )
    return Counter(tokenizer.decode(row[len(context) :], skip_special_tokens=True) for row in out)


def test_only_the_retry_warm_start_answers_a_retry():
    """The single-turn model never saw a token after <eos> and mostly answers a retry with nothing; the retry
    model answers with a number, sometimes the right one (RL has something to reinforce)."""
    single, retry = retry_answers("builtin:tiny_arith"), retry_answers("builtin:tiny_arith_retry")
    assert single[""] > 0.5 * 64
    assert sum(n for answer, n in retry.items() if answer.isdigit()) > 0.8 * 64
    assert 0.1 * 64 < retry["7"] and retry["8"] > 0.1 * 64  # right, or the rejected answer repeated
