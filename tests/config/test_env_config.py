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
