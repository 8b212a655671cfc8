"""What spans the environment and the rest of the run, checked before any model loads (the environment's node checks
its own keys, `rlhf.envs.base.EnvConfig`; its ids and files are checked by its factory)."""

from __future__ import annotations

from rlhf.errors import require

GROUP_FREE_ADVANTAGES = ("reinforce", "reinforce_pp", "rebn", "gae")  # estimators that take any number of rows per task (`env.chains=all`)


def check_env(cfg) -> None:
    """ConfigError when an environment meets a reward model, or when keys are set under `env` without one (the
    `env=none` node holds only its name: `+env.max_turns=3` there would be read by nothing)."""
    env = cfg.env
    if env.name is None:
        extra = [key for key in env if key != "name"]
        require(
            not extra,
            f"env.{extra[0] if extra else ''} is set but no environment is chosen (env=none: single-turn prompts), so "
            f"nothing would read it; choose one with env=<name> (its keys: docs/environments.md), or remove the key",
        )
        return
    require(
        not cfg.reward.path,
        f"reward.path={cfg.reward.path}: environment {env.name!r} scores its own episodes and no environment reads a "
        f"reward model; remove reward.path (or env=none to score single-turn responses with it)",
    )
    advantage = cfg.algorithm.advantage.name
    require(
        env.get("chains", "last") == "last" or advantage in GROUP_FREE_ADVANTAGES,
        f"env.chains=all trains a varying number of rows per task, which algorithm.advantage={advantage} cannot group; "
        f"use env.chains=last, or one of {', '.join(GROUP_FREE_ADVANTAGES)}",
    )
