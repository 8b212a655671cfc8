"""A policy-gradient algorithm composed from config: an advantage estimator, a policy loss, one KL term, one
entropy term and one loss aggregation (plus the critic's value loss when the advantage needs a critic).

`algorithm=grpo|rloo|reinforce|ppo` are presets of this one class; `algorithm/policy_loss=gspo` swaps a part.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from rlhf.algorithms.base import AdvantageInputs, Metrics
from rlhf.functional import (
    aggregate_loss,
    clipped_value_loss,
    kl_per_token,
    loss_denominator,
    masked_mean,
    masked_sum,
    reverse_kl,
    teacher_signal,
)
from rlhf.algorithms.rollout_corrections import correction_metrics, kept_mask
from rlhf.errors import ConfigError
from rlhf.functional import FixedKLController
from rlhf.parts import Part
from rlhf.trajectory import Forward, Trajectories, group_size


class PolicyGradient:
    """Advantages per token from `algorithm.advantage`, minimised through `algorithm.policy_loss`.

    Loss of a mini batch = aggregate(policy loss [* rollout-correction weights]) + kl_coef * aggregate(KL to the reference)
    [when the KL is a loss] - entropy_coef * aggregate(entropy); the critic's is vf_coef * aggregate(value loss),
    vf_coef and its clip range being keys of the advantage that trains the critic (gae).
    """

    pairwise = False
    needs_old_logprobs = True

    def __init__(
        self, cfg, advantage: Part, surrogate: Part, max_new_tokens: int, correction: Part | None = None,
        kl_controller: Part | None = None,
    ) -> None:
        """``advantage``, ``surrogate``, ``correction``, ``kl_controller``: the parts the nodes `algorithm.advantage`,
        `algorithm.policy_loss`, `algorithm.rollout_correction` (None: off) and `algorithm.kl_ctl` (None: a fixed
        `algorithm.beta`) choose; ``max_new_tokens`` is `loss_agg_norm`'s default."""
        self.cfg, self.advantage, self.surrogate, self.correction = cfg, advantage, surrogate, correction
        self.needs_critic = bool(advantage.trait("needs_critic", False))
        self.min_samples_per_prompt = int(advantage.trait("min_samples_per_prompt", 1))
        self.needs_greedy_baseline = bool(advantage.trait("needs_greedy_baseline", False))
        self.needs_reference = cfg.beta > 0
        self.needs_teacher = bool(advantage.trait("needs_teacher", False)) or cfg.distill_coef != 0
        self.needs_entropy = cfg.entropy_coef != 0
        if kl_controller is not None and kl_controller.trait("needs_beta", False) and cfg.beta <= 0:
            raise ConfigError(
                f"algorithm.kl_ctl={kl_controller.name} starts from algorithm.beta and multiplies it, so beta="
                f"{cfg.beta} would stay there; set algorithm.beta > 0"
            )
        self.kl_ctl = kl_controller(cfg.beta) if kl_controller is not None else FixedKLController(cfg.beta)
        self.kl_coef = self.kl_ctl.value  # set again at the start of every step by prepare
        self.loss_agg_norm = float(cfg.loss_agg_norm if cfg.loss_agg_norm is not None else max_new_tokens)

    def state_dict(self) -> dict[str, float]:
        """The KL coefficient (it moves under the adaptive controller)."""
        return {"kl_coef": self.kl_ctl.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.kl_ctl.value = state["kl_coef"]

    @property
    def prepare_reads_old_logprobs(self) -> bool:
        """Whether `prepare` needs the pre-update logprobs (a KL penalty in the reward, a rollout correction that
        takes the tokens it rejects out of the loss mask, which the denominators read, a teacher's signal), so they cannot come from the
        training forward afterwards (`rlhf.algorithms.base.old_logprob_source`). Any other correction weighs each token in
        the loss itself, from the training forward's logprobs detached, when the batch has no old ones."""
        drops = self.correction is not None and getattr(self.correction.config, "drop_rejected", False)
        return (self.cfg.kl_in_reward and self.needs_reference) or drops or self.needs_teacher

    def prepare(self, batch: Trajectories) -> tuple[Trajectories, dict[str, float]]:
        """Advantages (and returns) for a scored batch with ref logprobs (and values) and, unless the training
        forward supplies them later, old logprobs; the step's metrics."""
        self.kl_coef = self.kl_ctl.value  # the coefficient of this step, in the reward and in the loss alike
        mask = batch.loss_mask
        kl = self.rollout_kl(batch)
        signal, metrics = self.teacher_signal(batch)
        inputs = AdvantageInputs(
            batch.scores, mask, group_size(batch.group_id), kl, self.kl_coef, self.cfg.kl_in_reward, batch.values,
            batch.turn_rewards, batch.extras.get("baseline_scores"), signal,
        )
        advantages, returns = self.advantage(inputs)
        if signal is not None and self.cfg.distill_coef != 0:  # the teacher's term on top of any estimator's advantages
            advantages = advantages + self.cfg.distill_coef * signal
        metrics |= {
            "objective/rlhf_reward": inputs.sequence_rewards().mean().item(),
            "objective/non_score_reward": inputs.non_score_rewards().mean().item(),
        }
        if returns is not None:
            metrics["val/values"] = masked_mean(batch.values, mask).item()
            metrics["val/returns"] = masked_mean(returns, mask).item()
        extras = dict(batch.extras)
        if batch.old_logp is not None:  # else the loss weighs the tokens (`policy_loss`) and the metrics come later
            corrected = self.correction(batch.old_logp, batch.gen_logp, mask) if self.correction is not None else None
            metrics |= self.old_logprob_metrics(batch, corrected)
            if corrected is not None:
                extras["is_weights"] = corrected[0]
                # rejected tokens leave every term (drop_rejected)
                mask = kept_mask(corrected[0], mask, self.correction.config)
        return replace(batch, advantages=advantages, returns=returns, extras=extras, loss_mask=mask), metrics

    def teacher_signal(self, batch: Trajectories) -> tuple[torch.Tensor | None, dict[str, float]]:
        """The teacher's per-token signal against the student's pre-update logprobs (`rlhf.functional.distill`) and
        the `distill/*` metrics, when the batch carries the teacher's logprobs (``extras['teacher_logp']``); else
        (None, {}). The student's are the trainer's, computed as the teacher's are, not the generator's (off by float
        rounding): a teacher that is the student gives 0 exactly, and no update."""
        teacher_logp = batch.extras.get("teacher_logp")
        if teacher_logp is None:
            return None, {}
        mask = batch.loss_mask
        metrics = {
            "distill/reverse_kl": reverse_kl(teacher_logp, batch.old_logp, mask).item(),
            "distill/teacher_logprob": masked_mean(teacher_logp, mask).item(),
        }
        return teacher_signal(teacher_logp, batch.old_logp, mask), metrics

    def rollout_kl(self, batch: Trajectories) -> torch.Tensor | None:
        """KL of the pre-update policy to the reference per action token (0 elsewhere); None without a reference or
        before the old logprobs are known. Shape: (B, T)."""
        if batch.ref_logp is None or batch.old_logp is None:
            return None
        kl = kl_per_token(batch.old_logp, batch.ref_logp, self.cfg.kl_estimator)
        return torch.where(batch.loss_mask.bool(), kl, torch.zeros_like(kl))

    def old_logprob_metrics(self, batch: Trajectories, corrected: tuple | None = None) -> dict[str, float]:
        """From a batch with old logprobs: `objective/kl` and the coefficient (with ref logprobs), and the rollout
        correction's `rollout_corr/*` over the batch's mask (``corrected``: its (weights, flagged) on this batch when
        already computed)."""
        metrics = {}
        if self.correction is not None:
            if corrected is None:
                corrected = self.correction(batch.old_logp, batch.gen_logp, batch.loss_mask)
            weights, flagged = corrected
            metrics |= correction_metrics(weights, flagged, batch.old_logp, batch.gen_logp, batch.loss_mask)
        kl = self.rollout_kl(batch)
        if kl is None:
            return metrics
        return metrics | {"objective/kl": masked_sum(kl, batch.loss_mask, dim=1).mean().item(), "objective/kl_coef": self.kl_coef}

    def late_metrics(self, batch: Trajectories) -> dict[str, float]:
        """`old_logprob_metrics` of a batch whose old logprobs came from the training forward."""
        return self.old_logprob_metrics(batch)

    def end_step(self, metrics: dict[str, float], rows: int) -> None:
        """The KL controller moves for the next step by the step's `objective/kl` (measured with a reference)."""
        if "objective/kl" in metrics:
            self.kl_ctl.update(metrics["objective/kl"], rows)

    def denominator(self, mini: Trajectories) -> torch.Tensor:
        """What a mini batch's loss is divided by, so micro-batch losses add up to the mini-batch loss."""
        return loss_denominator(mini.loss_mask, self.cfg.loss_agg, self.loss_agg_norm)

    def aggregate(self, per_token: torch.Tensor, micro: Trajectories, denominator: torch.Tensor) -> torch.Tensor:
        return aggregate_loss(per_token, micro.loss_mask, self.cfg.loss_agg, denominator)

    def micro_loss(
        self, model: str, micro: Trajectories, out: Forward, denominator: torch.Tensor
    ) -> tuple[torch.Tensor, Metrics]:
        """The policy's `policy_loss`, the critic's `value_loss`."""
        if model == "policy":
            return self.policy_loss(micro, out, denominator)
        return self.value_loss(micro, out, denominator)

    def policy_loss(self, micro: Trajectories, out: Forward, denominator: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        """(the micro batch's share of the mini-batch policy loss, metrics); the `loss/...` metrics are shares too."""
        cfg, mask = self.cfg, micro.loss_mask
        surrogate = self.surrogate(out.logp, micro)
        weights = micro.extras.get("is_weights")
        if weights is None and self.correction is not None:  # old logprobs from this forward (`prepare_reads_old_logprobs`)
            weights = self.correction(micro.old_logp, micro.gen_logp, mask)[0]
        per_token = surrogate.loss * weights if weights is not None else surrogate.loss
        pg_loss = self.aggregate(per_token, micro, denominator)
        loss = pg_loss
        log_ratio = surrogate.log_ratio.detach()
        metrics = Metrics(
            sum={"loss/policy_avg": pg_loss.detach()},
            mean={
                "policy/approxkl_avg": masked_mean(0.5 * log_ratio**2, mask),
                "policy/clipfrac_avg": masked_mean(surrogate.clipped.float(), mask),
                "val/ratio": masked_mean(log_ratio.exp(), mask),
            },
        )
        if micro.ref_logp is not None and cfg.beta > 0 and not cfg.kl_in_reward:
            kl_loss = self.aggregate(kl_per_token(out.logp, micro.ref_logp, cfg.kl_estimator), micro, denominator)
            loss = loss + self.kl_coef * kl_loss  # beta (or the adaptive coefficient) enters the loss here
            metrics.add("loss/kl_avg", kl_loss.detach(), "sum")
        if out.entropy is not None and cfg.entropy_coef != 0:
            entropy = self.aggregate(out.entropy, micro, denominator)
            loss = loss - cfg.entropy_coef * entropy
            metrics.add("loss/entropy_avg", entropy.detach(), "sum")
        return loss, metrics

    def value_loss(self, micro: Trajectories, out: Forward, denominator: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        """(vf_coef * the micro batch's share of the clipped value loss, metrics), for the critic."""
        if out.values is None:
            raise ValueError("the value loss needs the critic's values for the micro batch; Forward.values is None")
        mask = micro.loss_mask
        critic = self.advantage.config  # the advantage that trains a critic configures its loss (gae: vf_coef, cliprange_value)
        per_token, clipped = clipped_value_loss(out.values, micro.values, micro.returns, critic.cliprange_value)
        value_loss = self.aggregate(per_token, micro, denominator)
        metrics = Metrics(sum={"loss/value_avg": value_loss.detach()}, mean={"val/clipfrac_avg": masked_mean(clipped.float(), mask)})
        return critic.vf_coef * value_loss, metrics
