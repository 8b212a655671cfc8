"""Rule-based reward functions and RewardSet: weights, the non-stop penalty, verifier metrics, plug-ins."""

from __future__ import annotations

import textwrap

import pytest
import torch
from omegaconf import OmegaConf

from rlhf.config.schema import RewardConfig, RewardFunctionConfig
from rlhf.registry import RegistryError
from rlhf.rewards.combine import RewardSet
from rlhf.rewards.rules import arith_correct, exact_match, integer_format, length_penalty


def reward_cfg(*functions: tuple, non_stop_penalty: bool = True, penalty: float = -10.0):
    """A typed reward config from (name, weight, args) tuples."""
    return OmegaConf.structured(
        RewardConfig(
            functions=[RewardFunctionConfig(name=name, weight=weight, args=args) for name, weight, args in functions],
            non_stop_penalty=non_stop_penalty,
            penalty_reward_value=penalty,
        )
    )


def score(cfg, responses, ground_truths, stopped):
    """RewardSet(cfg).score on the given responses (prompts are irrelevant to these functions)."""
    return RewardSet(cfg).score(["p"] * len(responses), responses, ground_truths, torch.tensor(stopped))


# --- rule functions -----------------------------------------------------------------------------------


def test_arith_correct():
    """Exactly the integer answer scores 1, whitespace allowed; extra text, wrong numbers or non-integers score 0."""
    responses = ["7", " 7\n", "07", "7.0", "8", "7 apples", "", "-3"]
    truths = ["7", "7", "7", "7", "7", "7", "7", -3]
    assert arith_correct(prompts=None, responses=responses, ground_truths=truths) == [1, 1, 1, 0, 0, 0, 0, 1]


def test_integer_format():
    """A bare (possibly negative) integer scores 1; anything else 0."""
    responses = ["12", " -4 ", "1+2", "abc", "", "3.5"]
    assert integer_format(prompts=None, responses=responses, ground_truths=[None] * 6) == [1, 1, 0, 0, 0, 0]


def test_exact_match():
    """Stripped response equal to the stripped ground truth (as a string) scores 1."""
    responses = ["hello", " hello ", "Hello", "12", "12"]
    truths = ["hello", "hello", "hello", 12, "012"]
    assert exact_match(prompts=None, responses=responses, ground_truths=truths) == [1, 1, 0, 1, 0]


def test_length_penalty():
    """Minus the characters beyond target_chars, never positive."""
    responses = ["", "abc", "abcdef"]
    assert length_penalty(prompts=None, responses=responses, ground_truths=[None] * 3) == [-0.0, -3.0, -6.0]
    assert length_penalty(prompts=None, responses=responses, ground_truths=[None] * 3, target_chars=4) == [0, 0, -2]


def test_verifier_marks():
    """Correctness checks are verifiers; format and length shaping are not."""
    assert arith_correct.is_verifier and exact_match.is_verifier
    assert not getattr(integer_format, "is_verifier", False)
    assert not getattr(length_penalty, "is_verifier", False)


# --- RewardSet ----------------------------------------------------------------------------------------


def test_reward_set_sums_with_weights_and_args():
    """The score is the weighted sum of every function, with each function's args passed through."""
    cfg = reward_cfg(
        ("arith_correct", 2.0, {}), ("integer_format", 0.5, {}), ("length_penalty", 0.25, {"target_chars": 1})
    )
    scores, metrics = score(cfg, ["7", "x", "8", "777"], ["7"] * 4, [True] * 4)
    assert scores.tolist() == pytest.approx([2.5, 0.0, 0.5, 0.5 - 0.5])
    assert metrics["reward/arith_correct"] == pytest.approx(0.25)
    assert metrics["reward/integer_format"] == pytest.approx(0.75)
    assert metrics["reward/length_penalty"] == pytest.approx(-0.5)


def test_non_stop_penalty_replaces_scores_of_truncated_responses():
    """With non_stop_penalty, a response that never stopped scores penalty_reward_value, whatever its text."""
    cfg = reward_cfg(("arith_correct", 1.0, {}), penalty=-3.0)
    scores, _ = score(cfg, ["7", "7", "8"], ["7"] * 3, [True, False, False])
    assert scores.tolist() == [1.0, -3.0, -3.0]


def test_no_non_stop_penalty_keeps_scores():
    """With non_stop_penalty false, truncated responses keep their computed score."""
    cfg = reward_cfg(("arith_correct", 1.0, {}), non_stop_penalty=False, penalty=-3.0)
    scores, _ = score(cfg, ["7", "7", "8"], ["7"] * 3, [True, False, False])
    assert scores.tolist() == [1.0, 1.0, 0.0]


def test_verifiable_correct_rate_counts_stopped_verified_only():
    """The correct rate counts responses that every verifier accepts and that stopped."""
    cfg = reward_cfg(("arith_correct", 1.0, {}), ("integer_format", 1.0, {}), non_stop_penalty=False)
    _, metrics = score(cfg, ["7", "7", "8", "7"], ["7"] * 4, [True, False, True, True])
    assert metrics["objective/verifiable_correct_rate"] == pytest.approx(2 / 4)


def test_verifiable_correct_rate_needs_all_verifiers():
    """With two verifiers, a response counts only when both accept it."""
    cfg = reward_cfg(("arith_correct", 1.0, {}), ("exact_match", 1.0, {}))
    _, metrics = score(cfg, ["7", "07"], ["7", "7"], [True, True])  # "07": arith_correct yes, exact_match no
    assert metrics["objective/verifiable_correct_rate"] == pytest.approx(0.5)


def test_no_verifier_no_correct_rate():
    """Without a verifier function there is no correct-rate metric."""
    _, metrics = score(reward_cfg(("integer_format", 1.0, {})), ["7"], ["7"], [True])
    assert "objective/verifiable_correct_rate" not in metrics


# --- plug-ins and errors ------------------------------------------------------------------------------


@pytest.fixture
def user_rewards(tmp_path, monkeypatch) -> str:
    """A user module on sys.path with a reward function, a verifier and a broken function; returns its name."""
    module = "user_rewards_for_tests"
    (tmp_path / f"{module}.py").write_text(
        textwrap.dedent(
            """
            def shout_bonus(prompts, responses, ground_truths, bonus=1.0, **_):
                return [bonus if r.endswith("!") else 0.0 for r in responses]

            def contains_truth(prompts, responses, ground_truths, **_):
                return [float(str(g) in r) for r, g in zip(responses, ground_truths)]
            contains_truth.is_verifier = True

            def one_score_only(prompts, responses, ground_truths, **_):
                return [1.0]

            NOT_A_FUNCTION = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return module


def test_user_function_by_import_path(user_rewards):
    """A function named by import path is imported, called with its args, and weighted like a builtin."""
    cfg = reward_cfg((f"{user_rewards}.shout_bonus", 2.0, {"bonus": 1.5}), ("integer_format", 1.0, {}))
    scores, metrics = score(cfg, ["7!", "7", "no!"], ["7"] * 3, [True] * 3)
    assert scores.tolist() == [3.0, 1.0, 3.0]
    assert metrics[f"reward/{user_rewards}.shout_bonus"] == pytest.approx(1.0)  # unweighted mean
    assert "objective/verifiable_correct_rate" not in metrics


def test_user_verifier_feeds_correct_rate(user_rewards):
    """A user function marked is_verifier counts towards the verifiable correct rate."""
    cfg = reward_cfg((f"{user_rewards}.contains_truth", 1.0, {}))
    _, metrics = score(cfg, ["the answer is 7", "8", "7"], ["7"] * 3, [True, True, False])
    assert metrics["objective/verifiable_correct_rate"] == pytest.approx(1 / 3)


def test_unknown_reward_lists_registered_and_names_key():
    """An unknown plain name is an error naming the config key and listing the registered functions."""
    cfg = reward_cfg(("integer_format", 1.0, {}), ("no_such_reward", 1.0, {}))
    with pytest.raises(RegistryError) as err:
        RewardSet(cfg)
    message = str(err.value)
    assert "no_such_reward" in message and "reward.functions[1].name" in message
    for name in ("arith_correct", "exact_match", "integer_format", "length_penalty"):
        assert name in message
    assert isinstance(err.value, ValueError)


def test_unimportable_or_missing_attribute_names_key(user_rewards):
    """A bad import path or a missing attribute is an error naming the config key."""
    with pytest.raises(RegistryError, match=r"reward\.functions\[0\]\.name"):
        RewardSet(reward_cfg(("no_such_package_xyz.fn", 1.0, {})))
    with pytest.raises(RegistryError, match=r"reward\.functions\[0\]\.name"):
        RewardSet(reward_cfg((f"{user_rewards}.missing_fn", 1.0, {})))


def test_non_callable_reward_is_rejected(user_rewards):
    """An import path to something that is not a function is a TypeError naming the key."""
    with pytest.raises(TypeError, match=r"reward\.functions\[0\]\.name"):
        RewardSet(reward_cfg((f"{user_rewards}.NOT_A_FUNCTION", 1.0, {})))


def test_wrong_number_of_scores_raises(user_rewards):
    """A function returning a different number of scores than responses is a ValueError naming it."""
    rewards = RewardSet(reward_cfg((f"{user_rewards}.one_score_only", 1.0, {})))
    with pytest.raises(ValueError, match="one_score_only.*1 scores for 3 responses"):
        rewards.score(["p"] * 3, ["a", "b", "c"], [None] * 3, torch.ones(3, dtype=torch.bool))
