"""Online DPO: sample several responses per prompt, rank them by reward, train DPO on (best, worst)."""

from __future__ import annotations

import torch

from rlhf import functional as F
from rlhf.estimators.base import Forward, PolicyOnlyLoss, StepInputs, TrainBatch
from rlhf.registry import register


def best_and_worst(scores: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices of each prompt's highest- and lowest-scored sample (first on ties). Shape: (B,) -> (P,), (P,)."""
    grouped = scores.view(-1, group_size)
    offsets = torch.arange(grouped.shape[0], device=scores.device) * group_size
    return offsets + grouped.argmax(dim=1), offsets + grouped.argmin(dim=1)


@register("estimator", "online_dpo")
class OnlineDPO(PolicyOnlyLoss):
    """DPO (sigmoid) or IPO loss with coefficient `algorithm.beta` on pairs ranked by the reward.

    Pairs whose two responses scored the same carry no preference and are left out of the loss.
    With `algorithm.reuse_training_logprobs`, no separate pre-update forward runs: `objective/kl` and
    `objective/entropy` come from the training forward (one pass fewer per step; the KL is then measured
    on weights that already moved during the step's earlier mini batches).
    """

    pairwise = True
    min_samples_per_prompt = 2
    needs_reference = True
    needs_critic = False

    def __init__(self, cfg, gen_cfg=None) -> None:
        if cfg.beta <= 0:
            raise ValueError(f"online DPO needs algorithm.beta > 0 (the DPO temperature), got {cfg.beta}")
        self.cfg = cfg
        self.group_size = int(cfg.num_samples_per_prompt)
        self.needs_old_logprobs = not cfg.reuse_training_logprobs
        self.needs_entropy = bool(cfg.reuse_training_logprobs)

    def build_batch(self, inputs: StepInputs) -> tuple[TrainBatch, dict[str, float]]:
        chosen, rejected = best_and_worst(inputs.scores, self.group_size)
        rows = torch.stack([chosen, rejected], dim=1).reshape(-1)  # chosen_0, rejected_0, chosen_1, ...
        margin = inputs.scores[chosen] - inputs.scores[rejected]
        mask = inputs.rollout.response_mask
        tensors = {
            "ref_logp": inputs.ref_logp[rows],
            "pair_valid": (margin > 0).float().repeat_interleave(2),
        }
        metrics = {
            "objective/scores_margin": margin.mean().item(),
            "objective/rlhf_reward": inputs.scores.mean().item(),
            "objective/non_score_reward": 0.0,
            "val/valid_pairs": (margin > 0).float().mean().item(),
        }
        if inputs.old_logp is not None:
            kl = F.kl_per_token(inputs.old_logp, inputs.ref_logp, self.cfg.kl_estimator) * mask
            metrics["objective/kl"] = F.masked_sum(kl, mask, dim=1).mean().item()
        return TrainBatch(inputs.rollout.select(rows), tensors, rows_per_unit=2), metrics

    def denominator(self, mini_batch: TrainBatch) -> torch.Tensor:
        """Valid pairs in the mini batch."""
        return (mini_batch.tensors["pair_valid"].sum() / 2).clamp(min=1)

    def loss(self, micro: TrainBatch, out: Forward, denominator: torch.Tensor):
        mask = micro.rollout.response_mask
        seq_logp = F.masked_sum(out.logp, mask, dim=1)
        seq_ref = F.masked_sum(micro.tensors["ref_logp"], mask, dim=1)
        valid = micro.tensors["pair_valid"][0::2]
        losses, chosen_reward, rejected_reward = F.dpo_loss(
            seq_logp[0::2], seq_logp[1::2], seq_ref[0::2], seq_ref[1::2], self.cfg.beta, self.cfg.dpo_loss_type
        )
        loss = F.masked_sum(losses, valid) / denominator
        metrics = {
            "objective/loss": loss.detach(),
            "logps/chosen": F.masked_mean(seq_logp[0::2].detach(), valid),
            "logps/rejected": F.masked_mean(seq_logp[1::2].detach(), valid),
            "reward/chosen": F.masked_mean(chosen_reward, valid),
            "reward/rejected": F.masked_mean(rejected_reward, valid),
            "reward_margin": F.masked_mean(chosen_reward - rejected_reward, valid),
        }
        if self.cfg.reuse_training_logprobs:
            kl = F.kl_per_token(out.logp.detach(), micro.tensors["ref_logp"], self.cfg.kl_estimator) * mask
            metrics["objective/kl"] = F.masked_sum(kl, mask, dim=1).mean()
            if out.entropy is not None:
                metrics["objective/entropy"] = F.masked_sum(out.entropy.detach(), mask, dim=1).mean()
        return loss, None, metrics
