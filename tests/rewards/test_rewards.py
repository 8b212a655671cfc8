"""Reward functions, RewardSet (weights, penalty, verifiers, plug-ins, reward model) and RewardModelScorer."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from rlhf.config import ConfigError, compose_config, validate
from rlhf.config.schema import RewardConfig, RewardFunctionConfig
from rlhf.registry import RegistryError, register
from rlhf.rewards.failure import Unscored
from rlhf.models.value import load_value_model, sequence_scores
from rlhf.rewards.combine import RewardSet
from rlhf.rewards.model import RewardModelScorer, RunningMoments
from rlhf.rewards.rules import arith_correct, exact_match, integer_format, length_penalty
from rlhf.trajectory import Trajectories, from_completions


def reward_cfg(*functions: tuple, non_stop_penalty: bool = True, penalty: float = -10.0, **model_options):
    """A typed reward config from (name, weight, args) tuples; ``model_options`` are the reward-model fields."""
    return OmegaConf.structured(
        RewardConfig(
            functions=[RewardFunctionConfig(name=name, weight=weight, args=args) for name, weight, args in functions],
            non_stop_penalty=non_stop_penalty,
            penalty_reward_value=penalty,
            **model_options,
        )
    )


def stopped_rollout(stopped: list[bool]) -> Trajectories:
    """One-token trajectories whose only meaningful field is ``stopped`` (all RewardSet reads without a model)."""
    rows = len(stopped)
    return from_completions(
        query_ids=torch.ones(rows, 1, dtype=torch.long),
        query_mask=torch.ones(rows, 1, dtype=torch.long),
        response_ids=torch.ones(rows, 1, dtype=torch.long),
        response_mask=torch.ones(rows, 1),
        logprobs=torch.zeros(rows, 1),
        stopped=torch.tensor(stopped),
    )


def score(cfg, responses, ground_truths, stopped):
    """RewardSet(cfg).score on the given responses (prompts are irrelevant to these functions)."""
    return RewardSet(cfg).score(["p"] * len(responses), responses, ground_truths, stopped_rollout(stopped))


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


@register("reward", "test_unscored_on_x")
def unscored_on_x(prompts, responses, ground_truths, **_):
    """`Unscored` for a response "x" (retries too), else 1.0."""
    return [Unscored(f"cannot read {r!r}") if r == "x" else 1.0 for r in responses]


def test_score_rows_returns_each_functions_unscored_rows_with_the_scores():
    """Each function that left rows unscored comes back with the batch's scores: its rows and first reason (it was
    state of the RewardSet, `last_unscored`, which the next batch scored overwrote); a batch all scored has none."""
    rewards = RewardSet(reward_cfg(("arith_correct", 1.0, {}), ("test_unscored_on_x", 1.0, {}), non_stop_penalty=False))
    responses = ["7", "x", "x", "8"]
    scored = rewards.score_rows(["p"] * 4, responses, ["7"] * 4, stopped_rollout([True] * 4))
    assert scored.unscored.tolist() == [False, True, True, False]
    assert scored.failures == {"test_unscored_on_x": (2, "cannot read 'x'")}
    assert scored.scores.tolist() == [2.0, 0.0, 0.0, 1.0] and scored.metrics["reward/test_unscored_on_x_unscored"] == 2.0
    clean = rewards.score_rows(["p"] * 2, ["7", "8"], ["7"] * 2, stopped_rollout([True] * 2))
    assert clean.failures == {} and not clean.unscored.any()
    assert scored.failures == {"test_unscored_on_x": (2, "cannot read 'x'")}  # what the first batch returned stays


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
    """An import path to something that is not a function is a config error naming the key (`validate` resolves it
    too, before any model loads)."""
    with pytest.raises(ConfigError, match=r"\(config key `reward\.functions\[0\]\.name`\) is int 3, not a function"):
        RewardSet(reward_cfg((f"{user_rewards}.NOT_A_FUNCTION", 1.0, {})))


def test_wrong_number_of_scores_raises(user_rewards):
    """A function returning a different number of scores than responses is a ValueError naming it."""
    rewards = RewardSet(reward_cfg((f"{user_rewards}.one_score_only", 1.0, {})))
    with pytest.raises(ValueError, match="one_score_only.*1 scores for 3 responses"):
        rewards.score(["p"] * 3, ["a", "b", "c"], [None] * 3, stopped_rollout([True] * 3))


# --- RunningMoments -----------------------------------------------------------------------------------


def test_running_moments_hand_computed():
    """Running mean and population variance over two batches, by hand."""
    # [1, 2, 3, 6]: mean 3, variance (4 + 1 + 0 + 9) / 4 = 3.5; then [7, 7]: all six have mean 26 / 6 = 4.3333333
    # and variance 148 / 6 - 4.3333333^2 = 5.8888889 (population variances).
    moments = RunningMoments()
    assert (moments.count, moments.mean, moments.var) == (0, 0.0, 1.0)
    moments.update(torch.tensor([1.0, 2.0, 3.0, 6.0]))
    assert (moments.count, moments.mean, moments.var) == (4, pytest.approx(3.0), pytest.approx(3.5))
    moments.update(torch.tensor([7.0, 7.0]))
    assert (moments.count, moments.mean, moments.var) == (6, pytest.approx(4.3333333), pytest.approx(5.8888889))


def test_running_moments_match_numpy_over_concatenated_batches():
    """After every batch (sizes 3, 1, 5, 0, 7, with shifted scales) mean and variance equal numpy's over all so far."""
    generator = torch.Generator().manual_seed(0)
    moments, seen = RunningMoments(), []
    for size, shift, scale in [(3, 0.0, 1.0), (1, 5.0, 1.0), (5, -2.0, 3.0), (0, 0.0, 1.0), (7, 10.0, 0.5)]:
        batch = torch.randn(size, generator=generator) * scale + shift
        moments.update(batch)
        seen.extend(batch.tolist())
        if seen:
            assert moments.count == len(seen)
            assert moments.mean == pytest.approx(np.mean(seen), rel=1e-5, abs=1e-6)
            assert moments.var == pytest.approx(np.var(seen), rel=1e-5, abs=1e-6)


# --- RewardSet with a reward model --------------------------------------------------------------------


class FakeScorer:
    """Stands in for RewardModelScorer: fixed scores and metrics; remembers the rollout it was given."""

    def __init__(self, scores: list[float]) -> None:
        self.scores = torch.tensor(scores)
        self.seen = None

    def score(self, rollout, update_stats=True):
        """(the fixed scores, a metric), as RewardModelScorer.score returns."""
        self.seen = rollout
        return self.scores.clone(), {"reward/model": self.scores.mean().item()}


def test_reward_set_adds_the_weighted_model_score():
    """integer_format [1, 0, 1] + 0.5 * model [2, -4, 1] = [2, -2, 1.5]; the non-stop row then gets -10."""
    cfg = reward_cfg(("integer_format", 1.0, {}), model_weight=0.5)
    rewards = RewardSet(cfg)
    rewards.model = FakeScorer([2.0, -4.0, 1.0])
    rollout = stopped_rollout([True, True, False])
    scores, metrics = rewards.score(["p"] * 3, ["7", "x", "8"], [None] * 3, rollout)
    assert scores.tolist() == pytest.approx([2.0, -2.0, -10.0])
    assert rewards.model.seen is rollout
    assert metrics["reward/model"] == pytest.approx(-1.0 / 3.0)
    assert metrics["reward/integer_format"] == pytest.approx(2.0 / 3.0)


def test_reward_set_with_only_a_model():
    """No functions, model_weight 2, no non-stop penalty: scores are 2 * [2, -4, 1]."""
    rewards = RewardSet(reward_cfg(non_stop_penalty=False, model_weight=2.0))
    rewards.model = FakeScorer([2.0, -4.0, 1.0])
    scores, _ = rewards.score(["p"] * 3, ["a", "b", "c"], [None] * 3, stopped_rollout([True, False, True]))
    assert scores.tolist() == pytest.approx([4.0, -8.0, 2.0])


# --- RewardModelScorer --------------------------------------------------------------------------------


def make_scorer(path: str, chunk: int = 8, **options) -> RewardModelScorer:
    """A CPU float32 scorer for the folder with reward-config ``options`` (normalize, clip)."""
    return RewardModelScorer(reward_cfg(path=path, **options), "float32", torch.device("cpu"), chunk)


def test_scorer_is_frozen_and_scores_the_last_token(reward_model_dir, rollout):
    """Eval mode, no trainable parameters, no graph; raw scores equal sequence_scores on prompt + response."""
    scorer = make_scorer(reward_model_dir)
    assert not scorer.model.training
    assert not any(p.requires_grad for p in scorer.model.parameters())
    raw = scorer.raw_scores(rollout)
    assert raw.shape == (3,) and not raw.requires_grad
    input_ids, attention_mask, _ = rollout.model_inputs()
    with torch.no_grad():
        expected = sequence_scores(load_value_model(reward_model_dir), input_ids, attention_mask)
    torch.testing.assert_close(raw, expected)


def test_scorer_chunking_does_not_change_scores(reward_model_dir, rollout):
    """Scoring in chunks of 1 or 2 rows gives the scores of one 3-row chunk."""
    whole = make_scorer(reward_model_dir, chunk=3).raw_scores(rollout)
    for chunk in (1, 2):
        torch.testing.assert_close(make_scorer(reward_model_dir, chunk=chunk).raw_scores(rollout), whole, atol=1e-5, rtol=0)


def test_scorer_without_options_returns_raw_scores_and_metrics(reward_model_dir, rollout):
    """normalize off, clip null: scores are the raw scores; reward/model and reward/model_std describe them."""
    scorer = make_scorer(reward_model_dir)
    raw = scorer.raw_scores(rollout)
    scores, metrics = scorer.score(rollout)
    torch.testing.assert_close(scores, raw)
    assert metrics["reward/model"] == pytest.approx(raw.mean().item(), abs=1e-6)
    assert metrics["reward/model_std"] == pytest.approx(raw.std().item(), abs=1e-6)


def test_reward_set_with_a_real_scorer(reward_model_dir, rollout):
    """integer_format (1 for each of "30", "4", "1234") + 2 * the reward model's score of each row."""
    rewards = RewardSet(reward_cfg(("integer_format", 1.0, {}), non_stop_penalty=False, model_weight=2.0))
    rewards.model = make_scorer(reward_model_dir)
    raw = rewards.model.raw_scores(rollout)
    scores, metrics = rewards.score(["p"] * 3, ["30", "4", "1234"], [None] * 3, rollout)
    torch.testing.assert_close(scores, 1.0 + 2.0 * raw)
    assert metrics["reward/model"] == pytest.approx(raw.mean().item(), abs=1e-6)


def with_raw(scorer: RewardModelScorer, *batches: list[float]) -> RewardModelScorer:
    """Make the scorer's raw scores the given batches, one per call, so normalisation can be checked by hand."""
    queue = [torch.tensor(batch) for batch in batches]
    scorer.raw_scores = lambda rollout: queue.pop(0)
    return scorer


def test_scorer_normalises_by_running_moments(reward_model_dir, rollout):
    """normalize: (raw - running mean) / running std, the moments including the current batch."""
    # [1, 2, 3, 6]: mean 3, std sqrt(3.5) = 1.8708287 -> [-1.0690450, -0.5345225, 0, 1.6035675];
    # then [7, 7]: mean 4.3333333, std sqrt(5.8888889) = 2.4267033 -> (7 - 4.3333333) / 2.4267033 = 1.0988845.
    # Metrics stay on the raw scores: mean 3, unbiased std sqrt(14 / 3) = 2.1602469.
    scorer = with_raw(make_scorer(reward_model_dir, normalize=True), [1.0, 2.0, 3.0, 6.0], [7.0, 7.0])
    scores, metrics = scorer.score(rollout)
    torch.testing.assert_close(scores, torch.tensor([-1.0690450, -0.5345225, 0.0, 1.6035675]))
    assert metrics["reward/model"] == pytest.approx(3.0)
    assert metrics["reward/model_std"] == pytest.approx(2.1602469)
    scores, _ = scorer.score(rollout)
    torch.testing.assert_close(scores, torch.tensor([1.0988845, 1.0988845]))


def test_scorer_clips_raw_scores(reward_model_dir, rollout):
    """clip 2 without normalize: [-3, 0.5, 4] -> [-2, 0.5, 2]; reward/model stays the raw mean 0.5."""
    scorer = with_raw(make_scorer(reward_model_dir, clip=2.0), [-3.0, 0.5, 4.0])
    scores, metrics = scorer.score(rollout)
    torch.testing.assert_close(scores, torch.tensor([-2.0, 0.5, 2.0]))
    assert metrics["reward/model"] == pytest.approx(0.5)


def test_scorer_clips_after_normalising(reward_model_dir, rollout):
    """normalize and clip 1.5: [1, 2, 3, 6] -> [-1.0690450, -0.5345225, 0, min(1.6035675, 1.5)]."""
    scorer = with_raw(make_scorer(reward_model_dir, normalize=True, clip=1.5), [1.0, 2.0, 3.0, 6.0])
    scores, _ = scorer.score(rollout)
    torch.testing.assert_close(scores, torch.tensor([-1.0690450, -0.5345225, 0.0, 1.5]))


def test_a_misspelt_reward_arg_is_refused_naming_the_key_and_the_args_taken():
    """`length_penalty` takes target_chars; its `**_` would silently drop `target_char`: refused before any model."""
    cfg = reward_cfg(("integer_format", 1.0, {}), ("length_penalty", 1.0, {"target_char": 5}))
    with pytest.raises(ConfigError, match=r"^reward.functions\[1\].args.target_char: reward function length_penalty takes "
                                          r"target_chars; did you mean reward.functions\[1\].args.target_chars\?$"):
        RewardSet(cfg)
    with pytest.raises(ConfigError, match=r"reward.functions\[0\].args.strict: reward function exact_match takes no args; remove it"):
        RewardSet(reward_cfg(("exact_match", 1.0, {"strict": True})))


def test_a_user_function_with_kwargs_takes_any_arg(user_rewards, tmp_path):
    """A catch-all named other than `_` (`**kwargs`) reads what it is given: no key is refused."""
    (tmp_path / "kw_rewards_for_tests.py").write_text("def anything(prompts, responses, ground_truths, **kwargs):\n"
                                                     "    return [float(kwargs['bonus'])] * len(responses)\n")
    scores, _ = score(reward_cfg(("kw_rewards_for_tests.anything", 1.0, {"bonus": 2})), ["a"], ["a"], [True])
    assert scores.tolist() == [2.0]


def test_a_misspelt_reward_arg_fails_validation_before_any_model_loads():
    cfg = compose_config(["reward.functions=[{name: length_penalty, args: {target_char: 5}}]"])
    with pytest.raises(ConfigError, match=r"reward.functions\[0\].args.target_char: reward function length_penalty takes target_chars"):
        validate(cfg)
