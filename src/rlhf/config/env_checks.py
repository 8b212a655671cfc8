"""What spans the environment and the rest of the run, checked before any model loads (the environment's node checks
its own keys, `rlhf.envs.base.EnvConfig`; its ids and files are checked by its factory)."""

from __future__ import annotations

from rlhf.errors import require

GROUP_FREE_ADVANTAGES = ("reinforce", "reinforce_pp", "rebn", "gae")  # estimators that take any number of rows per task (`env.chains=all`)


def check_env(cfg) -> None:
    """ConfigError when an environment meets a reward model (nothing to check without an environment)."""
    env = cfg.env
    if env.name is None:
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
