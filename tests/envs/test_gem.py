"""The GEM adapter on the real GuessTheNumber game: rewards checked by hand against the secret read after reset."""

from __future__ import annotations

from dataclasses import fields

import random
import sys

import numpy as np
import pytest

from rlhf import registry
from rlhf.envs.base import EnvConfig
from rlhf.envs.gem import GemConfig, GemMaker
from rlhf.errors import ConfigError

GUESS = "game:GuessTheNumber-v0-easy"  # 1..10, 4 guesses


def env_cfg(**overrides):
    return GemConfig(**{"name": "gem", "id": GUESS, "template": "no", "max_tokens": 256, **overrides})


@pytest.fixture(scope="module")
def maker() -> GemMaker:
    """Built once: the first `import gem` takes about 2 s."""
    return GemMaker(cfg=env_cfg(), tokenizer=None, rewards=None)


def started(maker, seed: int = 7):
    """A fresh episode after reset(seed), and its secret number."""
    env = maker.make(None)
    env.reset(seed)
    return env, env.env.unwrapped.game_number


def wrong(secret: int, k: int = 0) -> int:
    """The k-th number of 1..10 that is not the secret."""
    return [n for n in range(1, 11) if n != secret][k]


def test_registered_with_its_keys(maker):
    assert registry.resolve("env", "gem") is GemMaker
    assert GemMaker.config is GemConfig
    assert {f.name for f in fields(GemConfig)} - {f.name for f in fields(EnvConfig)} == {"id", "wrappers"}  # eval_size: every env without a dataset
    assert maker.uses_dataset is False and maker.eval_size == 32


def test_reset_gives_the_instructions(maker):
    observation, info = maker.make(None).reset(7)
    assert observation.startswith("You are playing Guess The Number.")
    assert "between 1 and 10 (inclusive) within 4 turns" in observation and "\\boxed{" in observation
    assert info == {"suffix": "Enter your next guess."}


def test_correct_guess_wins(maker):
    env, secret = started(maker)
    observation, reward, terminated, truncated, info = env.step(f"My guess is \\boxed{{{secret}}}")
    assert observation == f"Congratulations! You guessed the correct number {secret} in 1 turns."
    assert (reward, terminated, truncated, info["success"]) == (1.0, True, False, True)


def test_wrong_guess_gives_a_hint_and_goes_on(maker):
    env, secret = started(maker)
    guess = wrong(secret)
    observation, reward, terminated, truncated, info = env.step(f"\\boxed{{{guess}}}")
    hint = "lower" if guess > secret else "higher"
    assert observation == f"At turn 1, you guessed {guess}, and the target number is {hint} than {guess}."
    assert (reward, terminated, truncated) == (0.0, False, False) and "success" not in info


def test_malformed_action_ends_with_the_format_penalty(maker):
    env, _ = started(maker)
    observation, reward, terminated, truncated, info = env.step("five")
    assert observation == "At turn 1, you did not provide a valid guess."
    assert (reward, terminated, truncated, info["success"]) == (-0.1, True, False, False)


def test_fourth_wrong_guess_earns_partial_credit_not_success(maker):
    env, secret = started(maker)
    for k in range(3):
        assert env.step(f"\\boxed{{{wrong(secret, k)}}}")[2] is False
    last = wrong(secret, 3)
    observation, reward, terminated, truncated, info = env.step(f"\\boxed{{{last}}}")
    assert observation == "You have reached the maximum number of turns."
    assert reward == pytest.approx(1 - abs(last - secret) / 9)
    assert (terminated, truncated, info["success"]) == (True, True, False)


def test_a_seed_fixes_the_task_and_leaves_the_global_generators_alone(maker):
    """Episodes of one seed share the secret however their calls interleave; the run's draws are untouched."""
    python_state, numpy_draw = random.getstate(), np.random.get_state()[1].copy()
    secrets = {seed: started(maker, seed)[1] for seed in range(12)}
    assert len(set(secrets.values())) > 1
    first, second = maker.make(None), maker.make(None)
    first.reset(3)
    second.reset(4)
    assert first.env.unwrapped.game_number == secrets[3] and second.env.unwrapped.game_number == secrets[4]
    assert started(maker, 2**32 + 5)[1] == secrets[5]  # seeds wrap into NumPy's range
    assert random.getstate() == python_state and (np.random.get_state()[1] == numpy_draw).all()


def test_wrappers_are_applied_in_order(maker):
    """`concat` repeats the history (the instructions) before each new observation and adds GEM's hint."""
    env = GemMaker(cfg=env_cfg(wrappers="concat"), tokenizer=None).make(None)
    env.reset(7)
    observation = env.step("\\boxed{11}")[0]
    assert observation.startswith("You are playing Guess The Number.")
    assert observation.endswith("which is outside the range specified.\nEnter your next guess.")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"id": "game:GuessTheNumber-v0-eazy"}, r"env.id='game:GuessTheNumber-v0-eazy' is not a GEM environment; "
         r"e.g. game:GuessTheNumber-v0-easy.*gem.print_envs\(\)"),
        ({"id": None}, r"env.id is required; e.g. .*game:"),
        ({"wrappers": "concat, nope"}, r"env.wrappers names unknown GEM wrappers \['nope'\]; choose from .*concat"),
        ({"eval_size": 0}, r"env.eval_size=0 must be >= 1"),
    ],
)
def test_bad_config_names_the_key(maker, overrides, message):
    with pytest.raises(ConfigError, match=message):
        GemMaker(cfg=env_cfg(**overrides), tokenizer=None)


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "gem", None)  # what `import gem` sees when the package is not installed
    with pytest.raises(ConfigError, match="pip install gem-llm requests"):
        GemMaker(cfg=env_cfg(), tokenizer=None)
