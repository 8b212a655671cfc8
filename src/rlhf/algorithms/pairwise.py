"""A pairwise preference algorithm composed from config: online DPO (or IPO) on pairs the reward ranks.

`algorithm.advantage` (e.g. `best_vs_worst`) picks the (chosen, rejected) pairs among each prompt's samples;
`algorithm.policy_loss` (`dpo`, `ipo`, with its temperature `beta`) is the loss on their summed logprobs against the
reference's.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from rlhf.algorithms.base import AdvantageInputs, Metrics
from rlhf.functional import kl_per_token, masked_mean, masked_sum
from rlhf.parts import Part
from rlhf.trajectory import Forward, Trajectories, group_size


class PairwisePreference:
    """Pairs whose two responses scored the same carry no preference and are left out of the loss.

    With `algorithm.reuse_training_logprobs`, the loss reads no pre-update logprobs (`needs_old_logprobs` false, so
    no separate forward computes them): `objective/kl` and `objective/entropy` come from the training forward (one
    pass fewer per step; the KL is then measured on weights that already moved during the step's earlier mini
    batches).
    """

    pairwise = True
    reads = ("name", "advantage", "policy_loss", "num_samples_per_prompt", "kl_estimator", "reuse_training_logprobs")  # `algorithm.*` keys read; others set are refused
    needs_greedy_baseline = False
    needs_reference = True
    needs_critic = False
    needs_teacher = False
    prepare_reads_old_logprobs = True  # `objective/kl` of the pre-update policy, when it reads them

    def __init__(self, cfg, pairs: Part, pair_loss: Part) -> None:
        """``pairs``, ``pair_loss``: the parts the nodes `algorithm.advantage` and `algorithm.policy_loss` choose."""
        self.cfg, self.pairs, self.pair_loss = cfg, pairs, pair_loss
        self.min_samples_per_prompt = max(2, int(pairs.trait("min_samples_per_prompt", 2)))
        self.kl_from_training = bool(cfg.reuse_training_logprobs)  # objective/kl and /entropy from the training forward
        self.needs_old_logprobs = not self.kl_from_training
        self.needs_entropy = self.kl_from_training

    def prepare(self, batch: Trajectories) -> tuple[Trajectories, dict[str, float]]:
        """The pairs as consecutive rows (chosen_0, rejected_0, chosen_1, ...), and the step's metrics."""
        mask = batch.loss_mask
        chosen, rejected = self.pairs(AdvantageInputs(batch.scores, mask, group_size(batch.group_id)))
        rows = torch.stack([chosen, rejected], dim=1).reshape(-1)
        margin = batch.scores[chosen] - batch.scores[rejected]
        metrics = {
            "objective/scores_margin": margin.mean().item(),
            "objective/rlhf_reward": batch.scores.mean().item(),
            "objective/non_score_reward": 0.0,
            "val/valid_pairs": (margin > 0).float().mean().item(),
        }
        if batch.old_logp is not None:
            kl = kl_per_token(batch.old_logp, batch.ref_logp, self.cfg.kl_estimator) * mask
            metrics["objective/kl"] = masked_sum(kl, mask, dim=1).mean().item()
        pairs = batch.select(rows)
        extras = dict(pairs.extras, pair_valid=(margin > 0).float().repeat_interleave(2))
        return replace(pairs, extras=extras, rows_per_unit=2), metrics

    def denominator(self, mini: Trajectories) -> torch.Tensor:
        """Valid pairs in the mini batch."""
        return (mini.extras["pair_valid"].sum() / 2).clamp(min=1)

    def micro_loss(
        self, model: str, micro: Trajectories, out: Forward, denominator: torch.Tensor
    ) -> tuple[torch.Tensor, Metrics]:
        """The policy's `policy_loss` (a pairwise algorithm trains no critic)."""
        return self.policy_loss(micro, out, denominator)

    def late_metrics(self, batch: Trajectories) -> dict[str, float]:
        """Nothing: its old logprobs never come from the training forward (`old_logprob_source`)."""
        return {}

    def end_step(self, metrics: dict[str, float], rows: int) -> None:
        """Nothing moves between steps."""

    def policy_loss(self, micro: Trajectories, out: Forward, denominator: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        """(the micro batch's share of the mini batch's pair loss, metrics)."""
        mask = micro.loss_mask
        seq_logp = masked_sum(out.logp, mask, dim=1)
        seq_ref = masked_sum(micro.ref_logp, mask, dim=1)
        valid = micro.extras["pair_valid"][0::2]
        losses, chosen_reward, rejected_reward = self.pair_loss(
            seq_logp[0::2], seq_logp[1::2], seq_ref[0::2], seq_ref[1::2]
        )
        loss = masked_sum(losses, valid) / denominator
        metrics = Metrics(
            sum={"objective/loss": loss.detach()},
            mean={
                "logps/chosen": masked_mean(seq_logp[0::2].detach(), valid),
                "logps/rejected": masked_mean(seq_logp[1::2].detach(), valid),
                "reward/chosen": masked_mean(chosen_reward, valid),
                "reward/rejected": masked_mean(rejected_reward, valid),
                "reward_margin": masked_mean(chosen_reward - rejected_reward, valid),
            },
        )
        if self.kl_from_training:
            kl = kl_per_token(out.logp.detach(), micro.ref_logp, self.cfg.kl_estimator) * mask
            metrics.add("objective/kl", masked_sum(kl, mask, dim=1).mean())
            if out.entropy is not None:
                metrics.add("objective/entropy", masked_sum(out.entropy.detach(), mask, dim=1).mean())
        return loss, metrics
