"""`single_turn`: a prompt, one action scored by the run's rule reward functions, the episode over."""

from __future__ import annotations

from dataclasses import fields

import pytest
from omegaconf import OmegaConf

from rlhf import registry
from rlhf.config.schema import RewardConfig, RewardFunctionConfig
from rlhf.envs.base import EnvConfig
from rlhf.data.prompts import PromptExample
from rlhf.envs.single_turn import SingleTurnConfig, SingleTurnMaker
from rlhf.errors import ConfigError
from rlhf.rewards.combine import RewardSet

TASK = PromptExample(text="3+4=", token_ids=(), ground_truth=7)


def maker(**reward) -> SingleTurnMaker:
    """A maker over the arith rewards (arith_correct 1.0, integer_format 0.1) unless ``reward`` says otherwise."""
    functions = [RewardFunctionConfig(name="arith_correct"), RewardFunctionConfig(name="integer_format", weight=0.1)]
    cfg = OmegaConf.structured(RewardConfig(**{"functions": functions, **reward}))
    env = EnvConfig(name="single_turn")
    return SingleTurnMaker(cfg=env, tokenizer=None, rewards=RewardSet(cfg))


def test_registered_with_its_keys():
    assert registry.resolve("env", "single_turn") is SingleTurnMaker
    assert SingleTurnMaker.config is SingleTurnConfig and SingleTurnMaker.uses_dataset is True
    assert {f.name for f in fields(SingleTurnConfig)} == {f.name for f in fields(EnvConfig)} and SingleTurnConfig().max_turns == 1


@pytest.mark.parametrize(
    ("action", "reward", "scores", "success"),
    [
        (" 7", 1.1, {"arith_correct": 1.0, "integer_format": 1.0}, True),  # right integer, right format
        ("8", 0.1, {"arith_correct": 0.0, "integer_format": 1.0}, False),  # wrong integer
        ("seven", 0.0, {"arith_correct": 0.0, "integer_format": 0.0}, False),  # not an integer
    ],
)
def test_one_step_scored_by_the_rule_functions(action, reward, scores, success):
    env = maker().make(TASK)
    assert env.reset(seed=3) == ("3+4=", {})
    observation, got, terminated, truncated, info = env.step(action)
    assert (observation, terminated, truncated) == ("", True, False)
    assert got == pytest.approx(reward) and info == {"rewards": scores, "success": success}


def test_without_a_verifier_no_success_is_claimed():
    env = maker(functions=[RewardFunctionConfig(name="length_penalty", args={"target_chars": 1})]).make(TASK)
    env.reset(seed=0)
    assert env.step("123")[1:] == (-2.0, True, False, {"rewards": {"length_penalty": -2.0}})


def test_reward_model_is_refused_naming_reward_path():
    with pytest.raises(ConfigError, match=r"reward.path='rm': env.name=single_turn .* set reward.path=null"):
        maker(path="rm")


def test_no_reward_functions_is_refused():
    with pytest.raises(ConfigError, match="reward.functions, and it is empty"):
        maker(functions=[])


def test_make_needs_a_task():
    with pytest.raises(ValueError, match="need a dataset row"):
        maker().make(None)
