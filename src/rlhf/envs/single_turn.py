"""`env.name=single_turn`: the run's prompts and rule reward functions as a one-step environment.

Each episode's task is a dataset row (``uses_dataset = True``): ``reset`` returns its prompt text, ``step(action)``
scores the action with every function of `reward.functions` (weighted sum, as in single-turn runs) and ends the
episode. The step's info holds each function's score (``info["rewards"]``) and, when some function is a verifier,
``info["success"]``: every verifier scored it above 0.

A reward model (`reward.path`) is not supported: it scores token sequences, not a step's text. The non-stop penalty
is not applied here either (a step does not know whether the action stopped); the agent loop decides what a
truncated episode earns.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhf.data.prompts import PromptExample
from rlhf.envs.base import EnvConfig
from rlhf.errors import ConfigError
from rlhf.registry import register
from rlhf.rewards.combine import RewardSet, checked_scores


class SingleTurnEpisode:
    """One prompt, one scored action."""

    def __init__(self, functions: list, task: PromptExample) -> None:
        self.functions = functions  # RewardSet.functions: (name, weight, args, fn)
        self.task = task

    def reset(self, seed: int) -> tuple[str, dict]:
        """The prompt text; ``seed`` is unused (the task is the dataset row)."""
        return self.task.text, {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        """("", weighted sum of the functions' scores of ``action``, terminated, not truncated, info)."""
        scores, total, verified = {}, 0.0, []
        for name, weight, args, fn in self.functions:
            values = fn(prompts=[self.task.text], responses=[action], ground_truths=[self.task.ground_truth], **args)
            scores[name] = float(checked_scores(f"reward function {name!r}", values, 1)[0])  # a number, finite
            total += weight * scores[name]
            if getattr(fn, "is_verifier", False):
                verified.append(scores[name] > 0)
        info: dict = {"rewards": scores}
        if verified:
            info["success"] = all(verified)
        return "", total, True, False, info


@dataclass
class SingleTurnConfig(EnvConfig):
    max_turns: int = 1  # one action per episode


@register("env", "single_turn")
class SingleTurnMaker:
    """Makes a `SingleTurnEpisode` per dataset row, scored by the run's rule reward functions."""

    config = SingleTurnConfig
    uses_dataset = True

    def __init__(self, *, cfg, tokenizer, rewards: RewardSet) -> None:
        if rewards.cfg.path is not None:
            raise ConfigError(
                f"reward.path={rewards.cfg.path!r}: env.name=single_turn scores with reward.functions only, not a "
                "reward model; set reward.path=null (or env=none to score single-turn prompts with the model)"
            )
        if not rewards.functions:
            raise ConfigError("env.name=single_turn scores with reward.functions, and it is empty; add rule functions")
        self.functions = rewards.functions

    def make(self, task: PromptExample | None) -> SingleTurnEpisode:
        """A fresh episode of the dataset row ``task``."""
        if task is None:
            raise ValueError("single_turn episodes need a dataset row (uses_dataset = True)")
        return SingleTurnEpisode(self.functions, task)
