"""The stages of one RL step, shared by every schedule: generate, score, prepare, update, evaluate.

Schedules decide when these run; the RL math they call lives in `rlhf.functional` and the estimators.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from rlhf import functional as F
from rlhf.data.prompts import PromptExample
from rlhf.generators.base import Rollout, SamplingParams


@dataclass
class Scored:
    """A rollout with its decoded texts and scores."""

    rollout: Rollout
    prompts: list[str]  # (B,) prompt texts, each repeated num_samples_per_prompt times in a row
    responses: list[str]  # (B,) decoded responses, special tokens removed
    scores: torch.Tensor  # (B,) summed reward after the non-stop penalty
    metrics: dict[str, float]  # per-function reward means and the verifiable correct rate


@dataclass
class TrainBatch:
    """Everything the optimisation needs, row-aligned. Shapes: (B, Lr) unless noted."""

    rollout: Rollout
    old_logp: torch.Tensor  # policy logprobs before this step's update
    ref_logp: torch.Tensor | None  # reference logprobs; None when the KL is off
    advantages: torch.Tensor

    def __len__(self) -> int:
        return len(self.rollout)

    def select(self, index: torch.Tensor) -> "TrainBatch":
        rows = {f.name: getattr(self, f.name) for f in fields(self)}
        return TrainBatch(**{k: (v.select(index) if isinstance(v, Rollout) else None if v is None else v[index]) for k, v in rows.items()})


def sampling_params(gen_cfg, greedy: bool = False) -> SamplingParams:
    """The sampling settings of `generator.*`."""
    return SamplingParams(gen_cfg.max_new_tokens, gen_cfg.temperature, gen_cfg.top_p, greedy)


def generate_and_score(c, examples: list[PromptExample], samples_per_prompt: int, sampling: SamplingParams) -> Scored:
    """Sample ``samples_per_prompt`` responses per prompt (grouped in a row), decode them, score them."""
    repeated = [ex for ex in examples for _ in range(samples_per_prompt)]
    rollout = c.generator.generate([list(ex.token_ids) for ex in repeated], sampling)
    responses = c.tokenizer.batch_decode(rollout.response_ids, skip_special_tokens=True)
    prompts = [ex.text for ex in repeated]
    scores, metrics = c.rewards.score(prompts, responses, [ex.ground_truth for ex in repeated], rollout.stopped)
    return Scored(rollout.to("cpu"), prompts, responses, scores, metrics)


@torch.no_grad()
def chunked(fn, rollout: Rollout, chunk: int) -> list:
    """``fn`` applied to consecutive row slices of ``rollout``, results as a list."""
    return [fn(rollout.select(slice(start, start + chunk))) for start in range(0, len(rollout), chunk)]


def prepare(c, scored: Scored, temperature: float, micro_batch_size: int) -> tuple[TrainBatch, dict[str, float]]:
    """Old and reference logprobs, KL, shaped rewards and advantages for one rollout batch."""
    rollout = scored.rollout.to(c.device)
    mask = rollout.response_mask
    parts = chunked(lambda r: c.policy.logprobs(r, temperature, with_entropy=True), rollout, micro_batch_size)
    old_logp = torch.cat([p[0] for p in parts]).detach()
    entropy = torch.cat([p[1] for p in parts])
    ref_logp, kl = None, None
    if c.reference is not None:
        ref_logp = torch.cat(chunked(lambda r: c.reference.logprobs(r, temperature), rollout, micro_batch_size))
        kl = F.kl_per_token(old_logp, ref_logp, c.estimator_cfg.kl_estimator) * mask
    scores = scored.scores.to(c.device)
    rewards, non_score = c.estimator.shape_rewards(scores, kl, mask)
    advantages = c.estimator.advantages(rewards, mask)
    metrics = {
        "objective/scores": scores.mean().item(),
        "objective/rlhf_reward": rewards.mean().item(),
        "objective/non_score_reward": non_score.mean().item(),
        "objective/entropy": F.masked_sum(entropy, mask, dim=1).mean().item(),
        "val/sequence_lengths": rollout.response_lengths.mean().item(),
        "val/num_stop_token_ids": rollout.stopped.sum().item(),
        "val/stop_rate": rollout.stopped.float().mean().item(),
        "val/advantages_abs_mean": F.masked_mean(advantages.abs(), mask).item(),
        "val/generator_logprob_diff": F.masked_mean((rollout.logprobs - old_logp).abs(), mask).item(),
    }
    if kl is not None:
        metrics["objective/kl"] = F.masked_sum(kl, mask, dim=1).mean().item()
    return TrainBatch(rollout, old_logp, ref_logp, advantages), metrics


def update_policy(c, batch: TrainBatch, train_cfg, loss_agg: str, temperature: float, generator: torch.Generator) -> dict[str, float]:
    """`train.num_epochs` passes over the batch in shuffled mini batches, accumulating micro batches.

    Returns the averages over mini batches (`*_avg`) of the estimator's metrics and the gradient norm.
    """
    size = len(batch)
    mini = size // train_cfg.num_mini_batches
    sums: dict[str, float] = {}
    count = 0
    for _ in range(train_cfg.num_epochs):
        order = torch.randperm(size, generator=generator)
        for mini_rows in order.split(mini):
            mini_batch = batch.select(mini_rows)
            denominator = F.loss_denominator(mini_batch.rollout.response_mask, loss_agg)
            step_metrics: dict[str, float] = {}
            micro_rows = torch.arange(len(mini_batch)).split(train_cfg.micro_batch_size)
            for rows in micro_rows:
                micro = mini_batch.select(rows)
                logp, _ = c.policy.logprobs(micro.rollout, temperature)
                loss, metrics = c.estimator.policy_loss(
                    logp, micro.old_logp, micro.ref_logp, micro.advantages, micro.rollout.response_mask, denominator
                )
                c.policy.backward(loss)
                for key, value in metrics.items():
                    # losses are each micro batch's share of the mini-batch loss: sum them; other metrics: average
                    share = 1.0 if key.startswith("loss/") else 1.0 / len(micro_rows)
                    step_metrics[key] = step_metrics.get(key, 0.0) + float(value) * share
            step_metrics["policy/grad_norm"] = c.policy.optimizer_step()
            for key, value in step_metrics.items():
                sums[key] = sums.get(key, 0.0) + value
            count += 1
    return {f"{key}_avg": value / count for key, value in sums.items()}


def evaluate(c, examples: list[PromptExample], gen_cfg, eval_cfg) -> tuple[dict[str, float], Scored | None]:
    """Correct rate and score on ``examples``: greedy (if enabled) and sampled at the training temperature."""
    metrics: dict[str, float] = {}
    sampled = None
    runs = [("greedy", 1, True)] if eval_cfg.greedy else []
    if eval_cfg.num_samples > 0:
        runs.append(("sampled", eval_cfg.num_samples, False))
    for name, n, greedy in runs:
        scored = generate_and_score(c, examples, n, sampling_params(gen_cfg, greedy))
        metrics[f"eval/{name}_scores"] = scored.scores.mean().item()
        if "objective/verifiable_correct_rate" in scored.metrics:
            metrics[f"eval/{name}_correct_rate"] = scored.metrics["objective/verifiable_correct_rate"]
        metrics[f"eval/{name}_sequence_lengths"] = scored.rollout.response_lengths.mean().item()
        sampled = scored
    return metrics, sampled
