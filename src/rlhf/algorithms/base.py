"""How algorithm parts register, what an advantage estimator is given, and what the `Learner` calls on an algorithm
(`Algorithm`: prepare a batch, a micro batch's loss with `Metrics` that declare their reductions, end the step).

An algorithm is composed from config (`algorithm.advantage`, `algorithm.policy_loss`, plus one KL term, one
entropy term and one loss aggregation): see `rlhf.algorithms.policy_gradient` and `rlhf.algorithms.pairwise`.

- An advantage estimator (kind ``advantage``) is ``fn(inputs: AdvantageInputs, cfg) -> (advantages (B, T), returns
  (B, T) or None)``.
- A policy loss (kind ``policy_loss``) is ``fn(logp (B, T), batch: Trajectories, cfg) -> PolicyLoss``.
- A pairwise algorithm (online DPO) has kinds of its own, chosen at the same nodes: a pair selector (kind
  ``pair_selector``, at `algorithm.advantage`) is ``fn(inputs: AdvantageInputs, cfg) -> (chosen (P,), rejected (P,))``
  row indices of preference pairs; a pairwise loss (kind ``pairwise_loss``, at `algorithm.policy_loss`) is
  ``fn(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, cfg)`` on summed sequence logprobs (P,) ->
  (loss (P,), chosen reward (P,), rejected reward (P,)). One of your own named by import path declares its kind
  (``my_loss.kind = "pairwise_loss"``).

``cfg`` is the part's own config: its node (`algorithm.advantage`, `algorithm.policy_loss`) typed by the config class
the part registers with (``config=``, a `rlhf.parts.PartConfig` dataclass beside the part), so a key the chosen part
does not declare is refused before anything loads (`rlhf.parts.choose`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable, Literal, Protocol

import torch

from rlhf.functional import GroupSizes, masked_sum, token_level_rewards
from rlhf.parts import PartConfig
from rlhf.registry import register
from rlhf.trajectory import Forward, Trajectories

Reduce = Literal["mean", "sum"]


class Metrics(dict):
    """A micro batch's metrics, name -> value (a 0-d tensor or a number), each with how it reduces over the micro
    batches of a mini batch and over the ranks: ``"sum"`` for a share of the mini-batch loss (the shares add up to
    it), ``"mean"`` for the rest. Indexed as a plain dict; ``reduce[name]`` holds the declaration."""

    def __init__(self, sum: dict | None = None, mean: dict | None = None) -> None:  # noqa: A002 (the reduction's name)
        super().__init__()
        self.reduce: dict[str, Reduce] = {}
        for name, value in (sum or {}).items():
            self.add(name, value, "sum")
        for name, value in (mean or {}).items():
            self.add(name, value, "mean")

    def add(self, name: str, value, reduce: Reduce = "mean") -> None:
        """Set metric ``name`` to ``value``, reduced by ``reduce``."""
        if reduce not in ("mean", "sum"):
            raise ValueError(f"metric {name!r}: reduce={reduce!r}; a metric reduces by 'mean' or 'sum'")
        self[name], self.reduce[name] = value, reduce

    @classmethod
    def declared(cls, values: dict, reduce: dict[str, Reduce]) -> "Metrics":
        """``values`` (name -> value), each reduced as ``reduce[name]`` says."""
        metrics = cls()
        for name, value in values.items():
            metrics.add(name, value, reduce[name])
        return metrics

    def __reduce__(self):  # pickles with its declarations (the Ray backend returns a rank's metrics to the driver)
        return (Metrics.declared, (dict(self), dict(self.reduce)))


def reduction(metrics: dict, name: str) -> Reduce:
    """How metric ``name`` of ``metrics`` reduces: its declaration in a `Metrics`; ``"mean"`` in a plain dict."""
    return getattr(metrics, "reduce", {}).get(name, "mean")


class OldLogprobs(str, Enum):
    """Where a step's pre-update logprobs come from (`old_logprob_source`)."""

    PASS = "a forward of their own before training"  # `Learner.prepare`
    TRAINING = "the training forward's, detached (one optimiser step per batch: it runs on the pre-update weights)"
    NONE = "none (the loss reads none; the metrics come from the training forward)"  # pairwise, reuse_training_logprobs


def old_logprob_source(algorithm, train_cfg) -> OldLogprobs:
    """Where ``algorithm``'s pre-update logprobs come from under `train.*`, decided once for the run.

    They are taken from the training forward (detached) when `algorithm.reuse_training_logprobs` is set, the step makes
    one optimiser step (`train.num_epochs` = `train.num_mini_batches` = 1: the training forward then runs on exactly the
    pre-update weights) and the algorithm prepares its batch without them (``prepare_reads_old_logprobs`` false); an
    algorithm that reads none (``needs_old_logprobs`` false) takes none; otherwise a forward of their own computes
    them.
    """
    if not algorithm.needs_old_logprobs:
        return OldLogprobs.NONE
    reusable = (
        bool(algorithm.cfg.reuse_training_logprobs)
        and not algorithm.prepare_reads_old_logprobs
        and train_cfg.num_epochs == 1
        and train_cfg.num_mini_batches == 1
    )
    return OldLogprobs.TRAINING if reusable else OldLogprobs.PASS


class Algorithm(Protocol):
    """What the `Learner` calls on an algorithm, and only this. A step: `prepare` the scored batch once, then for each
    mini batch its `denominator` and `micro_loss` on each micro batch of each trained model, `late_metrics` when the
    pre-update logprobs came from the training forward, and `end_step` once the step's metrics are known."""

    pairwise: bool  # units are (chosen, rejected) pairs of rows
    needs_old_logprobs: bool  # the loss or its metrics read the pre-update logprobs (`old_logprob_source`)
    prepare_reads_old_logprobs: bool  # `prepare` reads them, so they cannot come from the training forward
    needs_entropy: bool  # the policy's training forward computes the entropy with gradients

    def prepare(self, batch: Trajectories) -> tuple[Trajectories, dict[str, float]]:
        """The training batch (advantages, returns, pairs, ...) from a scored batch with its reference logprobs (and
        values, teacher logprobs, and old logprobs unless they come from the training forward), and its metrics."""

    def denominator(self, mini: Trajectories) -> torch.Tensor:
        """What a mini batch's loss is divided by, so that its micro batches' losses add up to it."""

    def micro_loss(
        self, model: str, micro: Trajectories, out: Forward, denominator: torch.Tensor
    ) -> tuple[torch.Tensor, Metrics]:
        """(the micro batch's share of the mini-batch loss of ``model`` ("policy" or "critic"), its `Metrics`)."""

    def late_metrics(self, batch: Trajectories) -> dict[str, float]:
        """The metrics `prepare` computes from old logprobs, for a batch whose old logprobs came from the training
        forward (`OldLogprobs.TRAINING`)."""

    def end_step(self, metrics: dict[str, float], rows: int) -> None:
        """The step is over (``metrics``: all of it, over ``rows`` rows): move what moves between steps (the adaptive
        KL coefficient)."""


def register_advantage(
    name: str, *, config: type = PartConfig, needs_critic: bool = False, min_samples_per_prompt: int = 1,
    needs_greedy_baseline: bool = False, needs_teacher: bool = False,
) -> Callable:
    """Decorator: register an advantage estimator under ``name`` with its config class and traits
    (``needs_greedy_baseline``: each step also generates and scores one greedy response per prompt, given as
    ``AdvantageInputs.baselines``; ``needs_teacher``: it reads ``AdvantageInputs.teacher_signal``)."""

    def add(fn: Callable) -> Callable:
        fn.config, fn.needs_critic = config, needs_critic
        fn.min_samples_per_prompt = min_samples_per_prompt
        fn.needs_greedy_baseline, fn.needs_teacher = needs_greedy_baseline, needs_teacher
        return register("advantage", name)(fn)

    return add


def register_policy_loss(name: str, *, config: type = PartConfig, needs_critic: bool = False) -> Callable:
    """Decorator: register a policy loss under ``name`` with its config class and traits (``needs_critic``: it reads
    ``batch.values``, so the advantage estimator must train a critic)."""

    def add(fn: Callable) -> Callable:
        fn.config, fn.needs_critic = config, needs_critic
        return register("policy_loss", name)(fn)

    return add


def register_pair_selector(name: str, *, config: type = PartConfig, min_samples_per_prompt: int = 2) -> Callable:
    """Decorator: register a pair selector under ``name`` with its config class (``min_samples_per_prompt``: at least
    2, the two sides of a pair)."""

    def add(fn: Callable) -> Callable:
        fn.config, fn.kind, fn.min_samples_per_prompt = config, "pair_selector", max(2, min_samples_per_prompt)
        return register("pair_selector", name)(fn)

    return add


def register_pairwise_loss(name: str, *, config: type = PartConfig) -> Callable:
    """Decorator: register a pairwise loss under ``name`` with its config class."""

    def add(fn: Callable) -> Callable:
        fn.config, fn.kind = config, "pairwise_loss"
        return register("pairwise_loss", name)(fn)

    return add


@dataclass
class PolicyLoss:
    """A policy loss per token and what it reports. Shapes: (B, T)."""

    loss: torch.Tensor  # to be minimised, per token
    clipped: torch.Tensor  # bool: tokens whose loss came from a clipped branch
    log_ratio: torch.Tensor  # log of the importance ratio the loss used (detached where the loss detaches it)


@dataclass
class AdvantageInputs:
    """One step's rewards as an advantage estimator sees them. Shapes: (B,) per row, (B, T) per window token."""

    scores: torch.Tensor  # (B,) reward after the non-stop penalty
    mask: torch.Tensor  # (B, T) the loss mask
    group_size: GroupSizes  # rows per group (an int), or each group's size (a (P,) tensor) when they differ; a group's rows are contiguous
    kl: torch.Tensor | None = None  # (B, T) KL of the pre-update policy to the reference (0 outside the mask)
    kl_coef: float = 0.0  # this step's KL coefficient
    kl_in_reward: bool = False  # the KL is a reward penalty (else a loss term, and the rewards are the scores)
    values: torch.Tensor | None = None  # (B, T) the critic's values (estimators with needs_critic)
    turn_rewards: torch.Tensor | None = None  # (B, T) multi-turn: each turn's reward at its last action token
    baselines: torch.Tensor | None = None  # (B,) the score of the prompt's greedy response (estimators with needs_greedy_baseline)
    teacher_signal: torch.Tensor | None = None  # (B, T) -(logp_behaviour - logp_teacher) per action token (a run with a teacher)

    def non_score_rewards(self) -> torch.Tensor:
        """The KL penalty of each row, -kl_coef * summed KL (0 when the KL is not in the reward). Shape: (B,)."""
        if self.kl is None or not self.kl_in_reward:
            return torch.zeros_like(self.scores)
        return -self.kl_coef * masked_sum(self.kl, self.mask, dim=1)

    def sequence_rewards(self) -> torch.Tensor:
        """Score plus the KL penalty, one per row. Shape: (B,)."""
        if self.kl is None or not self.kl_in_reward:
            return self.scores
        return self.scores + self.non_score_rewards()

    def token_rewards(self) -> torch.Tensor:
        """The KL penalty at every token plus the rewards: the score at each row's last action token, or with
        ``turn_rewards`` each turn's reward at its own last token. Shape: (B, T)."""
        penalty = -self.kl_coef * self.kl if self.kl is not None and self.kl_in_reward else torch.zeros_like(self.mask)
        if self.turn_rewards is not None:
            return penalty * self.mask + self.turn_rewards
        return token_level_rewards(self.scores, penalty, self.mask)

