"""PPO with a learned critic: per-token rewards (score at the last token, KL penalty per token) and GAE."""

from __future__ import annotations

import torch

from rlhf import functional as F
from rlhf.estimators.base import Forward, PolicyGradientEstimator, StepInputs, TrainBatch
from rlhf.registry import register


@register("estimator", "ppo")
class PPO(PolicyGradientEstimator):
    """Clipped policy loss on GAE advantages plus a clipped value loss weighted by `algorithm.vf_coef`."""

    needs_critic = True

    def build_batch(self, inputs: StepInputs) -> tuple[TrainBatch, dict[str, float]]:
        if inputs.values is None:
            raise ValueError("PPO needs critic values; the orchestrator passed none")
        self.kl_coef = self.kl_ctl.value  # the coefficient of this step
        cfg, mask = self.cfg, inputs.rollout.response_mask
        kl = self.kl(inputs)
        kl_rewards = -self.kl_coef * kl if kl is not None and cfg.kl_in_reward else torch.zeros_like(mask)
        rewards = F.token_level_rewards(inputs.scores, kl_rewards, mask)
        advantages, returns = F.gae_advantages(rewards, inputs.values, mask, cfg.gamma, cfg.lam)
        if cfg.whiten_advantages:
            advantages = F.masked_whiten(advantages, mask)
        metrics = {
            "objective/rlhf_reward": F.masked_sum(rewards, mask, dim=1).mean().item(),
            "objective/non_score_reward": F.masked_sum(kl_rewards, mask, dim=1).mean().item(),
            "val/values": F.masked_mean(inputs.values, mask).item(),
            "val/returns": F.masked_mean(returns, mask).item(),
            **self.kl_metrics(kl, mask, len(inputs.rollout)),
        }
        tensors = {"old_logp": inputs.old_logp, "advantages": advantages, "returns": returns, "old_values": inputs.values}
        if inputs.ref_logp is not None:
            tensors["ref_logp"] = inputs.ref_logp
        metrics |= self.add_is_weights(inputs, tensors)
        return TrainBatch(inputs.rollout, tensors), metrics

    def policy_loss(self, micro: TrainBatch, out: Forward, denominator: torch.Tensor):
        loss, _, metrics = PolicyGradientEstimator.loss(self, micro, out, denominator)
        return loss, metrics

    def value_loss(self, micro: TrainBatch, values: torch.Tensor, denominator: torch.Tensor):
        """``vf_coef`` * clipped value loss, reduced by `algorithm.loss_agg`. Shape: values (B, T)."""
        mask, t = micro.rollout.response_mask, micro.tensors
        per_token, clipped = F.clipped_value_loss(values, t["old_values"], t["returns"], self.cfg.cliprange_value)
        value_loss = F.aggregate_loss(per_token, mask, self.cfg.loss_agg, denominator)
        metrics = {"loss/value_avg": value_loss.detach(), "val/clipfrac_avg": F.masked_mean(clipped.float(), mask)}
        return self.cfg.vf_coef * value_loss, metrics

    def loss(self, micro: TrainBatch, out: Forward, denominator: torch.Tensor):
        if out.values is None:
            raise ValueError("PPO's loss needs the critic's values for the micro batch")
        policy_loss, metrics = self.policy_loss(micro, out, denominator)
        value_loss, value_metrics = self.value_loss(micro, out.values, denominator)
        return policy_loss, value_loss, metrics | value_metrics
