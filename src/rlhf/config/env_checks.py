"""Checks of the `env` section that need no model: ranges and choices (the environment's own ids and files are
checked by its factory, still before any model loads)."""

from __future__ import annotations

from rlhf.envs.rows import REDUCTIONS
from rlhf.envs.templates import TEMPLATES
from rlhf.errors import require


def check_env(cfg) -> None:
    """ConfigError naming the first bad `env.*` value (nothing to check without an environment)."""
    env = cfg.env
    if env.name is None:
        return
    for key in ("num_parallel", "max_turns", "max_concurrency", "eval_size"):
        require(env[key] >= 1, f"env.{key}={env[key]} must be >= 1")
    require(env.max_tokens >= 2, f"env.max_tokens={env.max_tokens} must be >= 2 (a prompt token and an action token)")
    require(env.step_timeout_s > 0, f"env.step_timeout_s={env.step_timeout_s} must be > 0")
    require(env.reward_reduce in REDUCTIONS, f"env.reward_reduce={env.reward_reduce!r}; choose one of {', '.join(REDUCTIONS)}")
    require(
        not cfg.reward.path,
        f"reward.path={cfg.reward.path}: environment {env.name!r} scores its own episodes and no environment reads a "
        f"reward model; remove reward.path (or env=none to score single-turn responses with it)",
    )
    require(env.template in TEMPLATES, f"env.template={env.template!r}; choose one of {', '.join(TEMPLATES)}")
