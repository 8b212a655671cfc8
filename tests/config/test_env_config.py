"""The `env` section: bad values, keys no environment reads, and environments that cannot be built are refused
before any model loads, naming the key and the fix."""

from __future__ import annotations

import pytest

from rlhf.config import ConfigError, compose_config, validate


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["env=arith_retry", "env.max_turns=0"], r"env.max_turns=0 must be >= 1"),
        (["env=arith_retry", "env.num_parallel=0"], r"env.num_parallel=0 must be >= 1"),
        (["env=arith_retry", "env.max_tokens=1"], r"env.max_tokens=1 must be >= 2"),
        (["env=arith_retry", "env.step_timeout_s=0"], r"env.step_timeout_s=0.0 must be > 0"),
        (["env=arith_retry", "env.failed_retries=-1"], r"env.failed_retries=-1 must be >= 0"),
        (["env=arith_retry", "env.max_failed_share=0"], r"env.max_failed_share=0.0 must be in \(0, 1\]"),
        (["env=arith_retry", "env.max_failed_share=1.5"], r"env.max_failed_share=1.5 must be in \(0, 1\]"),
        (["env=arith_retry", "env.reward_reduce=mean"], r"env.reward_reduce='mean'; choose one of sum, last"),
        (["env=arith_retry", "env.template=llama"], r"env.template='llama'; choose one of no, qwen3_game"),
        (["env.max_turns=3"], r"env has no `name`; choose one with env=<name> \(agent_func, arith_retry, gem, openai_agent, single_turn\)"),
        (["env=arith_retry", "env.id=game:GuessTheNumber-v0"], r"env.id is not a key of env arith_retry \(its config ArithRetryConfig "
         r"has .*\); it is a key of env=gem"),
        (["env=gem", "env.path=agent.py"], r"env.path is not a key of env gem .* key of env=agent_func"),
        (["env=gem", "env.max_tokens=many"], r"env.max_tokens: Value 'many' of type 'str' could not be converted to Integer \(env gem, config GemConfig\)"),
        (["env=gem", "reward.path=models/rm"], r"reward.path=models/rm: environment 'gem' scores its own episodes"),
        (["env.name=nosuchenv"], r"unknown env 'nosuchenv' \(config key `env.name`\). Registered: agent_func, arith_retry, gem, openai_agent, single_turn"),
    ],
)
def test_bad_env_settings_are_refused_before_anything_loads(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose_config(overrides))


@pytest.mark.parametrize("env", ["arith_retry", "gem", "single_turn"])
def test_each_env_group_composes_and_validates(env):
    validate(compose_config([f"env={env}"]))


USER_ENV = '''
from dataclasses import dataclass

from rlhf.envs.base import EnvConfig
from rlhf.parts import PartConfig


@dataclass
class CountdownConfig(EnvConfig):
    start: int = 3  # the number counted down from


class Countdown:
    config = CountdownConfig
    uses_dataset = False

    def __init__(self, *, cfg, tokenizer, rewards):
        self.start = cfg.start


class Misdeclared(Countdown):
    config = PartConfig  # a config class without the keys every environment is read with
'''


@pytest.fixture
def user_env(tmp_path, monkeypatch):
    """A module of the user's on the path, as PYTHONPATH=. puts one: `user_envs.Countdown`, with a key of its own."""
    (tmp_path / "user_envs.py").write_text(USER_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "user_envs.Countdown"


def test_an_environment_named_by_import_path_gets_the_shared_keys_and_its_own(user_env):
    """Before, its node was `env=none`'s (`name` alone) and reading `env.max_tokens` failed at run time (exit 6)."""
    from rlhf.envs.base import env_config

    cfg = compose_config([f"env.name={user_env}", "+env.start=5", "+env.max_turns=2"])
    validate(cfg)
    env = env_config(cfg)
    assert type(env).__name__ == "CountdownConfig"
    assert (env.start, env.max_turns, env.max_tokens, env.num_parallel, env.template) == (5, 2, 256, 32, "no")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["+env.strat=5"], r"env.strat is not a key of env user_envs.Countdown \(its config CountdownConfig has name, "
         r"template, .*, eval_size, start\); did you mean env.start\?"),
        (["+env.start=many"], r"env.start: Value 'many' of type 'str' could not be converted to Integer \(env "
         r"user_envs.Countdown, config CountdownConfig\)"),
        (["+env.max_turns=0"], r"env.max_turns=0 must be >= 1"),
    ],
)
def test_an_environment_named_by_import_path_is_typed_and_checked_by_its_class(user_env, overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose_config([f"env.name={user_env}", *overrides]))


def test_a_key_of_ones_own_environment_set_without_plus_names_the_plus_override(user_env):
    """Before, the message told the user to choose `env=user_envs.Countdown`, a group option that does not exist."""
    from rlhf.config.compose import check_command_line

    with pytest.raises(ConfigError, match=r"env.start: env.name=user_envs.Countdown names a part of your own, whose "
                                          r"node holds only the keys written; add this one with \+env.start=5"):
        check_command_line([f"env.name={user_env}", "env.start=5"])


def test_an_environment_config_class_must_extend_env_config(user_env):
    with pytest.raises(ConfigError, match=r"env.name=user_envs.Misdeclared: its config class PartConfig does not extend "
                                          r"rlhf.envs.base.EnvConfig"):
        validate(compose_config(["env.name=user_envs.Misdeclared"]))
