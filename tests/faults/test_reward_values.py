"""Rewards that are not numbers, not finite, or absurdly large stop the step with an error naming the source, the row
and the value, before any statistic or loss sees them."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from rlhf import exits
from rlhf.config.schema import RewardConfig, RewardFunctionConfig
from rlhf.errors import RewardValueError
from rlhf.rewards.combine import MAX_ABS_SCORE, RewardSet, function_label
from rlhf.rewards.model import RewardModelScorer
from rlhf.rewards.rules import integer_format
from rlhf.trajectory import from_completions

BAD_SCORES = {  # id: (value the user function returns for row 1, text the error must show)
    "none": (None, "None (NoneType): not a number"),
    "string": ("1.0", "'1.0' (str): not a number"),
    "nan": (math.nan, "nan (float): not finite"),
    "inf": (-math.inf, "-inf (float): not finite"),
    "overflow": (1e38, "1e+38 (float): too large"),
    "int_past_float": (10**400, "1" + "0" * 56 + "... (int): too large"),  # float() of it raised an unnamed OverflowError
}


def rollout(rows: int):
    """One-token trajectories, every row stopped (RewardSet reads only `stopped` without a model)."""
    ones = torch.ones(rows, 1, dtype=torch.long)
    return from_completions(ones, ones, ones, torch.ones(rows, 1), torch.zeros(rows, 1), torch.ones(rows, dtype=torch.bool))


def reward_set(*functions: tuple[str, float], **options) -> RewardSet:
    """A RewardSet over (import path or registered name, weight) pairs."""
    names = [RewardFunctionConfig(name=name, weight=weight) for name, weight in functions]
    return RewardSet(OmegaConf.structured(RewardConfig(functions=names, **options)))


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A user module `bad_rewards` whose `row_one(value)` returns [0.0, value, 0.0]; returns its setter."""
    (tmp_path / "bad_rewards.py").write_text(
        "VALUE = None\n\n"
        "def row_one(prompts, responses, ground_truths, **_):\n"
        "    return [0.0, VALUE, 0.0]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import bad_rewards

    def set_value(value):
        bad_rewards.VALUE = value
        return "bad_rewards.row_one"

    yield set_value
    sys.modules.pop("bad_rewards", None)


@pytest.mark.parametrize("case", BAD_SCORES, ids=list(BAD_SCORES))
def test_a_bad_score_names_the_function_the_row_and_the_value(user_module, case):
    """None, a string, NaN, inf and 1e38 from a user function: RewardValueError naming the function, row 1 and the
    value, with the fix."""
    value, shown = BAD_SCORES[case]
    rewards = reward_set((user_module(value), 1.0))
    with pytest.raises(RewardValueError) as caught:
        rewards.score(["p"] * 3, ["a", "b", "c"], [None] * 3, rollout(3))
    message = str(caught.value)
    assert message.startswith(f"reward function 'bad_rewards.row_one' scored row 1 {shown}; ")
    assert f"|score| <= {MAX_ABS_SCORE:g}" in message and "Fix the scoring" in message


def test_good_scores_of_every_numeric_kind_pass(user_module):
    """bool, int, numpy and 0-d torch numbers, and a score of exactly MAX_ABS_SCORE, are accepted as before."""
    kinds = ((True, 1.0), (3, 3.0), (np.float32(0.5), 0.5), (torch.tensor(-2.0), -2.0), (MAX_ABS_SCORE, MAX_ABS_SCORE))
    for value, expected in kinds:
        rewards = reward_set((user_module(value), 1.0))
        scores, _ = rewards.score(["p"] * 3, ["a", "b", "c"], [None] * 3, rollout(3))
        assert scores.tolist() == [0.0, expected, 0.0]


def test_a_weighted_sum_that_grows_too_large_is_refused(user_module):
    """Each score within bounds, the weighted sum beyond it: the error names the summed sources and their weights."""
    rewards = reward_set((user_module(MAX_ABS_SCORE), 1.0), ("integer_format", 1.0))
    with pytest.raises(RewardValueError, match=r"weighted sum of reward bad_rewards.row_one \(weight 1\), integer_format "
                       r"\(weight 1\) scored row 1 1000001.0 \(float\): too large"):
        rewards.score(["p"] * 3, ["a", "7", "c"], [None] * 3, rollout(3))


class NaNModel:
    """A reward model whose raw scores hold NaN in row 2 (a broken model, or one run in float16 that overflowed)."""

    def __call__(self, batch):
        return torch.tensor([0.5, -0.5, math.nan])


def test_a_reward_model_nan_stops_before_the_running_statistics(tmp_path):
    """A NaN from the reward model names reward.path and row 2, and leaves the checkpointed moments untouched."""
    cfg = OmegaConf.structured(RewardConfig(path=str(tmp_path), normalize=True))
    scorer = RewardModelScorer(cfg, "float32", torch.device("cpu"), 4, remote_scores=NaNModel())
    with pytest.raises(RewardValueError, match=f"reward model reward.path={tmp_path} scored row 2 nan"):
        scorer.score(rollout(3))
    assert scorer.moments.state_dict() == {"count": 0, "mean": 0.0, "var": 1.0}


def test_the_run_reports_the_error_as_one_paragraph(user_module):
    """What `rlhf.train.main` prints for it (exit 6): the error's type and full message, not a NaN later."""
    rewards = reward_set((user_module(None), 1.0))
    with pytest.raises(RewardValueError) as caught:
        rewards.score(["p"] * 3, ["a", "b", "c"], [None] * 3, rollout(3))
    paragraph = exits.describe_failure(caught.value)
    assert paragraph.startswith("the run raised RewardValueError: reward function 'bad_rewards.row_one'")
    assert "row 1 None" in paragraph


def test_a_registered_function_is_named_with_its_module():
    """A built-in name is followed by where its code lives, so the reader can open it; an import path is not repeated."""
    where = "rlhf.rewards.rules.integer_format"
    assert function_label("integer_format", integer_format) == f"reward function 'integer_format' ({where})"
    assert function_label(where, integer_format) == f"reward function '{where}'"


def test_the_cli_run_exits_6_naming_the_function_and_the_value(tmp_path):
    """`python -m rlhf.train` with a user reward returning 1e38 for row 2: exit 6 at step 0, one paragraph naming it."""
    (tmp_path / "huge_reward.py").write_text(
        "def huge(prompts, responses, ground_truths, **_):\n"
        "    return [1e38 if row == 2 else 0.0 for row, _ in enumerate(responses)]\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf.train", "reward.functions=[{name: huge_reward.huge}]", "train.num_steps=1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == exits.RUN_RAISED, log[-3000:]
    assert "RewardValueError: reward function 'huge_reward.huge' scored row 2 1e+38 (float): too large" in log
    assert "Traceback" not in log


WHOLE_RETURNS = {  # id: (what the user function returns instead of a list, text the error must show)
    "none": ("None", "returned NoneType None, not one score per response; return a list of 3 floats"),
    "float": ("0.5", "returned float 0.5, not one score per response"),
    "string": ("'1 0 1'", "returned str '1 0 1', not one score per response"),
    "dict": ("{'a': 1.0}", "returned dict {'a': 1.0}, not one score per response"),
    "0-d array": ("__import__('numpy').array(0.5)", "returned ndarray array\\(0.5\\), not one score per response"),
}


@pytest.mark.parametrize("case", WHOLE_RETURNS, ids=list(WHOLE_RETURNS))
def test_a_return_that_is_not_a_list_of_scores_names_the_function(tmp_path, monkeypatch, case):
    """Before, None or a float failed with `'NoneType' object is not iterable`, naming no function."""
    returned, shown = WHOLE_RETURNS[case]
    (tmp_path / f"whole_{case}.py").write_text(f"def score(prompts, responses, ground_truths, **_):\n    return {returned}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rewards = reward_set((f"whole_{case}.score", 1.0))
    with pytest.raises(RewardValueError, match=rf"^reward function 'whole_{case}.score' {shown}"):
        rewards.score(["p"] * 3, ["a", "b", "c"], [None] * 3, rollout(3))
    sys.modules.pop(f"whole_{case}", None)


def test_an_async_reward_function_is_named_and_its_coroutine_closed(tmp_path, monkeypatch, recwarn):
    """An `async def` returns a coroutine, never awaited: the error says to make it a plain def, and no 'never
    awaited' warning follows (the coroutine is closed)."""
    (tmp_path / "async_reward.py").write_text("async def score(prompts, responses, ground_truths, **_):\n    return [1.0]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rewards = reward_set(("async_reward.score", 1.0))
    with pytest.raises(RewardValueError, match=r"^reward function 'async_reward.score' returned a coroutine: it is an `async def`"):
        rewards.score(["p"], ["a"], [None], rollout(1))
    sys.modules.pop("async_reward", None)
    assert not [w for w in recwarn if "never awaited" in str(w.message)]


@pytest.mark.parametrize("returned", ["[1.0, 0.0, 1.0]", "(1.0, 0.0, 1.0)", "__import__('numpy').array([1.0, 0.0, 1.0])",
                                      "(float(r == 'a') for r in 'aba')", "__import__('torch').tensor([1.0, 0.0, 1.0])"],
                         ids=["list", "tuple", "numpy", "generator", "tensor"])
def test_every_kind_of_sequence_of_scores_passes(tmp_path, monkeypatch, returned):
    """What the return check must keep accepting: a list, a tuple, a numpy array, a generator, a tensor."""
    (tmp_path / "good_return.py").write_text(f"def score(prompts, responses, ground_truths, **_):\n    return {returned}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rewards = reward_set(("good_return.score", 1.0))
    scores, _ = rewards.score(["p"] * 3, ["a", "b", "c"], [None] * 3, rollout(3))
    assert scores.tolist() == [1.0, 0.0, 1.0]
    sys.modules.pop("good_return", None)


def test_the_single_turn_environment_names_a_function_that_returns_no_list(tmp_path, monkeypatch):
    """env=single_turn scores each action with the reward functions: a None there is the same named error (before,
    `object of type 'NoneType' has no len()`, naming nothing)."""
    from rlhf.data.prompts import PromptExample
    from rlhf.envs.single_turn import SingleTurnEpisode

    (tmp_path / "none_reward.py").write_text("def score(prompts, responses, ground_truths, **_):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    episode = SingleTurnEpisode(reward_set(("none_reward.score", 1.0)).functions, PromptExample("1+1=", (1,), "2"))
    with pytest.raises(RewardValueError, match=r"^reward function 'none_reward.score' returned NoneType None"):
        episode.step("2")
    sys.modules.pop("none_reward", None)
