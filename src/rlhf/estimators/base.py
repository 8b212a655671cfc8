"""The estimator interface: a scored rollout -> a training batch -> a loss per micro batch.

A factory registered as kind ``estimator`` is called as ``factory(cfg=<algorithm config>, gen_cfg=<generator
config>)`` and returns an object with the attributes and methods of `Estimator`. Critic-free policy-gradient
estimators differ only in `sequence_advantages`: subclass `PolicyGradientEstimator` and override it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from rlhf import functional as F
from rlhf.generators.base import Rollout


@dataclass
class StepInputs:
    """What the orchestrator computed for one rollout batch. Shapes: (B, T) with T = response length."""

    rollout: Rollout
    scores: torch.Tensor  # (B,) summed reward after the non-stop penalty
    old_logp: torch.Tensor | None  # policy logprobs before the update; None when the estimator does not ask
    ref_logp: torch.Tensor | None  # reference logprobs; None without a reference
    values: torch.Tensor | None  # critic values before the update; None without a critic
    num_samples_per_prompt: int  # samples of one prompt are contiguous rows


@dataclass
class TrainBatch:
    """Row-aligned training tensors. Rows are grouped in units of ``rows_per_unit`` (2 for DPO pairs),
    and mini/micro batches are cut in whole units."""

    rollout: Rollout
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # each (B, ...) aligned with the rollout
    rows_per_unit: int = 1

    @property
    def num_units(self) -> int:
        return len(self.rollout) // self.rows_per_unit

    def select_units(self, units: torch.Tensor) -> "TrainBatch":
        """The rows of the given units, in order."""
        rows = (units.unsqueeze(1) * self.rows_per_unit + torch.arange(self.rows_per_unit)).reshape(-1)
        rows = rows.to(self.rollout.response_ids.device)
        return TrainBatch(self.rollout.select(rows), {k: v[rows] for k, v in self.tensors.items()}, self.rows_per_unit)


@dataclass
class Forward:
    """The trained models' outputs on a micro batch, with gradients. Shapes: (B, T)."""

    logp: torch.Tensor
    entropy: torch.Tensor | None = None  # present when the estimator asks for it
    values: torch.Tensor | None = None  # present when there is a critic


class Estimator(Protocol):
    pairwise: bool  # class attribute: trains on (chosen, rejected) pairs, one per prompt (batch sizes count pairs)
    min_samples_per_prompt: int  # class attribute: the smallest algorithm.num_samples_per_prompt that works
    needs_reference: bool  # reference logprobs are used (KL or DPO)
    needs_critic: bool  # a value model is trained alongside the policy
    needs_old_logprobs: bool  # the orchestrator computes pre-update policy logprobs and entropy
    needs_entropy: bool  # `Forward.entropy` must be computed in the training forward

    def build_batch(self, inputs: StepInputs) -> tuple[TrainBatch, dict[str, float]]:
        """Advantages (or pairs) and the step's objective metrics."""

    def denominator(self, mini_batch: TrainBatch) -> torch.Tensor:
        """What a mini batch's loss is divided by, so micro-batch losses add up to the mini-batch loss."""

    def loss(
        self, micro: TrainBatch, out: Forward, denominator: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
        """(policy loss, value loss or None, metrics) of one micro batch: its share of the mini-batch loss.

        Metrics named `loss/...` or `objective/loss` are shares too (summed over micro batches); the others
        are averaged.
        """

    def policy_loss(self, micro: TrainBatch, out: Forward, denominator: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(policy loss, metrics) alone, for a policy trained apart from its critic."""

    def value_loss(self, micro: TrainBatch, values: torch.Tensor, denominator: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(weighted value loss, metrics) alone, for a critic trained apart from its policy (estimators with a critic)."""


def make_kl_controller(cfg):
    """The fixed or adaptive KL coefficient of `algorithm.kl_ctl`."""
    if cfg.kl_ctl == "adaptive":
        return F.AdaptiveKLController(cfg.beta, cfg.target_kl, cfg.kl_horizon)
    return F.FixedKLController(cfg.beta)


class PolicyOnlyLoss:
    """`policy_loss` for estimators whose `loss` has no value part."""

    def policy_loss(self, micro: TrainBatch, out: Forward, denominator: torch.Tensor):
        loss, _, metrics = self.loss(micro, out, denominator)
        return loss, metrics


class PolicyGradientEstimator(PolicyOnlyLoss):
    """Clipped policy-gradient loss with optional KL (in the reward or as a loss) and entropy bonus;
    sequence-level advantages come from the subclass."""

    pairwise = False
    min_samples_per_prompt = 1
    needs_critic = False
    needs_old_logprobs = True

    def __init__(self, cfg, gen_cfg=None) -> None:
        self.cfg = cfg
        self.group_size = int(cfg.num_samples_per_prompt)
        self.needs_reference = cfg.beta > 0
        self.needs_entropy = cfg.entropy_coef != 0
        self.kl_ctl = make_kl_controller(cfg)
        self.kl_coef = self.kl_ctl.value  # set again at the start of every step by build_batch
        norm = cfg.loss_agg_norm if cfg.loss_agg_norm is not None else (gen_cfg.max_new_tokens if gen_cfg else 1.0)
        self.loss_agg_norm = float(norm)

    def sequence_advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """Advantage of each sequence. Shape: (B,) -> (B,)."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, float]:
        """The KL coefficient (it moves under the adaptive controller)."""
        return {"kl_coef": self.kl_ctl.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.kl_ctl.value = state["kl_coef"]

    def kl(self, inputs: StepInputs) -> torch.Tensor | None:
        """Per-token KL of the pre-update policy to the reference (B, T), 0 outside the mask; None without a reference."""
        if inputs.ref_logp is None or inputs.old_logp is None:
            return None
        kl = F.kl_per_token(inputs.old_logp, inputs.ref_logp, self.cfg.kl_estimator)
        return torch.where(inputs.rollout.response_mask.bool(), kl, torch.zeros_like(kl))

    def shape_rewards(self, scores: torch.Tensor, kl: torch.Tensor | None, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores plus -beta * summed KL when the KL lives in the reward. Shape: (B,), (B, T) -> (B,), (B,)."""
        if kl is None or not self.cfg.kl_in_reward:
            return scores, torch.zeros_like(scores)
        non_score = -self.kl_coef * F.masked_sum(kl, mask, dim=1)
        return scores + non_score, non_score

    def kl_metrics(self, kl: torch.Tensor | None, mask: torch.Tensor, n_samples: int) -> dict[str, float]:
        """`objective/kl` (per-sequence sum, batch mean) and the coefficient this step uses (`self.kl_coef`, fixed
        for the step); then feeds the measured KL to the controller, which moves the coefficient for the next step."""
        if kl is None:
            return {}
        metrics = {"objective/kl": F.masked_sum(kl, mask, dim=1).mean().item(), "objective/kl_coef": self.kl_coef}
        self.kl_ctl.update(metrics["objective/kl"], n_samples)
        return metrics

    def build_batch(self, inputs: StepInputs) -> tuple[TrainBatch, dict[str, float]]:
        self.kl_coef = self.kl_ctl.value  # the coefficient of this step, in the reward and in the loss alike
        mask = inputs.rollout.response_mask
        kl = self.kl(inputs)
        rewards, non_score = self.shape_rewards(inputs.scores, kl, mask)
        advantages = F.to_token_level(self.sequence_advantages(rewards), mask)
        metrics = {
            "objective/rlhf_reward": rewards.mean().item(),
            "objective/non_score_reward": non_score.mean().item(),
            **self.kl_metrics(kl, mask, len(inputs.rollout)),
        }
        tensors = {"old_logp": inputs.old_logp, "advantages": advantages}
        if inputs.ref_logp is not None:
            tensors["ref_logp"] = inputs.ref_logp
        metrics |= self.add_is_weights(inputs, tensors)
        return TrainBatch(inputs.rollout, tensors), metrics

    def add_is_weights(self, inputs: StepInputs, tensors: dict[str, torch.Tensor]) -> dict[str, float]:
        """With `algorithm.tis_clip`, the truncated importance weights of the generator/trainer gap as
        ``tensors["is_weights"]`` (B, T); returns their metrics (`val/is_weight_mean`, `val/is_clipfrac`)."""
        if self.cfg.tis_clip is None:
            return {}
        mask = inputs.rollout.response_mask
        weights, clipped = F.truncated_is_weights(inputs.old_logp, inputs.rollout.logprobs, mask, self.cfg.tis_clip)
        tensors["is_weights"] = weights
        return {"val/is_weight_mean": F.masked_mean(weights, mask).item(), "val/is_clipfrac": F.masked_mean(clipped.float(), mask).item()}

    def denominator(self, mini_batch: TrainBatch) -> torch.Tensor:
        return F.loss_denominator(mini_batch.rollout.response_mask, self.cfg.loss_agg, self.loss_agg_norm)

    def loss(self, micro: TrainBatch, out: Forward, denominator: torch.Tensor):
        """Clipped surrogate (+ beta * KL when KL is a loss, - entropy_coef * entropy), reduced by `algorithm.loss_agg`."""
        cfg, t = self.cfg, micro.tensors
        mask = micro.rollout.response_mask
        per_token, clipped, log_ratio = F.clipped_policy_loss(
            out.logp, t["old_logp"], t["advantages"], cfg.clip_eps_low, cfg.clip_eps_high, cfg.dual_clip_c
        )
        if "is_weights" in t:
            per_token = per_token * t["is_weights"]
        pg_loss = F.aggregate_loss(per_token, mask, cfg.loss_agg, denominator)
        loss = pg_loss
        metrics = {
            "loss/policy_avg": pg_loss.detach(),
            "policy/approxkl_avg": F.masked_mean(0.5 * log_ratio.detach() ** 2, mask),
            "policy/clipfrac_avg": F.masked_mean(clipped.float(), mask),
            "val/ratio": F.masked_mean(log_ratio.detach().exp(), mask),
        }
        if "ref_logp" in t and cfg.beta > 0 and not cfg.kl_in_reward:
            kl_loss = F.aggregate_loss(F.kl_per_token(out.logp, t["ref_logp"], cfg.kl_estimator), mask, cfg.loss_agg, denominator)
            loss = loss + self.kl_coef * kl_loss
            metrics["loss/kl_avg"] = kl_loss.detach()
        if out.entropy is not None and cfg.entropy_coef != 0:
            entropy = F.aggregate_loss(out.entropy, mask, cfg.loss_agg, denominator)
            loss = loss - cfg.entropy_coef * entropy
            metrics["loss/entropy_avg"] = entropy.detach()
        return loss, None, metrics
