"""The stages of one RL step, shared by every schedule: generate, score, prepare, update, evaluate.

Schedules decide when these run; the RL math they call lives in `rlhf.functional` and the estimators.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rlhf import functional as F
from rlhf.data.prompts import PromptExample
from rlhf.estimators.base import StepInputs, TrainBatch
from rlhf.generators.base import Rollout, SamplingParams


@dataclass
class Scored:
    """A rollout with its decoded texts and scores."""

    rollout: Rollout
    prompts: list[str]  # (B,) prompt texts, each repeated num_samples_per_prompt times in a row
    responses: list[str]  # (B,) decoded responses, special tokens removed
    scores: torch.Tensor  # (B,) summed reward after the non-stop penalty
    metrics: dict[str, float]  # per-function reward means and the verifiable correct rate
    versions: torch.Tensor | None = None  # (B,) policy version that generated each row (async schedule), else None


def sampling_params(gen_cfg, greedy: bool = False) -> SamplingParams:
    """The sampling settings of `generator.*`."""
    return SamplingParams(gen_cfg.max_new_tokens, gen_cfg.temperature, gen_cfg.top_p, greedy)


def generate_and_score(
    c, examples: list[PromptExample], samples_per_prompt: int, sampling: SamplingParams, training: bool = True
) -> Scored:
    """Sample ``samples_per_prompt`` responses per prompt (grouped in a row), decode them, score them."""
    repeated = repeat_prompts(examples, samples_per_prompt)
    rollout = c.generator.generate([list(ex.token_ids) for ex in repeated], sampling)
    return score(c, repeated, rollout, training)


def repeat_prompts(examples: list[PromptExample], samples_per_prompt: int) -> list[PromptExample]:
    """Each prompt ``samples_per_prompt`` times in a row (a group)."""
    return [ex for ex in examples for _ in range(samples_per_prompt)]


def score(c, repeated: list[PromptExample], rollout: Rollout, training: bool = True) -> Scored:
    """Decode and score a rollout of the prompts ``repeated`` (one row each)."""
    responses = c.tokenizer.batch_decode(rollout.response_ids, skip_special_tokens=True)
    prompts = [ex.text for ex in repeated]
    scores, metrics = c.rewards.score(prompts, responses, [ex.ground_truth for ex in repeated], rollout, training)
    return Scored(rollout.to("cpu"), prompts, responses, scores, metrics)


def prepare(c, scored: Scored, temperature: float, micro_batch_size: int, samples_per_prompt: int) -> tuple[TrainBatch, dict[str, float]]:
    """Pre-update policy logprobs, reference logprobs and critic values, then the estimator's batch."""
    rollout = scored.rollout.to(c.device)
    mask = rollout.response_mask
    metrics = {
        "objective/scores": scored.scores.mean().item(),
        "val/sequence_lengths": rollout.response_lengths.mean().item(),
        "val/num_stop_token_ids": rollout.stopped.sum().item(),
        "val/stop_rate": rollout.stopped.float().mean().item(),
    }
    old_logp = ref_logp = values = None
    if c.estimator.needs_old_logprobs:
        old_logp, entropy = c.policy.rollout_logprobs(rollout, temperature, micro_batch_size, with_entropy=True)
        metrics["objective/entropy"] = F.masked_sum(entropy, mask, dim=1).mean().item()
        metrics["val/generator_logprob_diff"] = F.masked_mean((rollout.logprobs - old_logp).abs(), mask).item()
    if c.reference is not None:
        ref_logp = c.reference.rollout_logprobs(rollout, temperature, micro_batch_size)
    if c.critic is not None:
        values = c.critic.rollout_values(rollout, micro_batch_size)
    inputs = StepInputs(rollout, scored.scores.to(c.device), old_logp, ref_logp, values, samples_per_prompt)
    batch, estimator_metrics = c.estimator.build_batch(inputs)
    return batch, metrics | estimator_metrics


def trained_models(c) -> list[tuple[str, object]]:
    """(name, model) of every model the run trains: the policy, and the critic when there is one."""
    return [("policy", c.policy)] + ([("critic", c.critic)] if c.critic is not None else [])


def update_policy(c, batch: TrainBatch, train_cfg, temperature: float, guard) -> dict[str, float]:
    """`train.num_epochs` passes over the batch in shuffled mini batches, accumulating micro batches.

    Micro-batch sizes count samples; for pairwise estimators (DPO) a mini batch holds whole pairs. A non-finite
    loss in any trained model drops every model's gradients for that mini batch; a non-finite gradient norm skips
    that model's update. Either way ``guard`` counts the mini batch and stops the run after too many in a row.
    Returns the estimator's metrics averaged over mini batches, and gradient norms.
    """
    units = batch.num_units
    mini_units = units // train_cfg.num_mini_batches
    micro_units = min(mini_units, max(1, train_cfg.micro_batch_size // batch.rows_per_unit))
    trained = trained_models(c)
    sums: dict[str, float] = {}
    count = 0
    for _ in range(train_cfg.num_epochs):
        for mini_ids in torch.randperm(units, generator=c.shuffle).split(mini_units):
            mini = batch.select_units(mini_ids)
            denominator = c.estimator.denominator(mini)
            results = [model.accumulate(c.estimator, mini, denominator, micro_units, temperature) for _, model in trained]
            if not all(finite for finite, _ in results):
                for _, model in trained:
                    model.zero_grad()
                guard.record(True, "loss")
                continue
            step = {key: value for _, metrics in results for key, value in metrics.items()}
            for name, model in trained:
                step[f"{name}/grad_norm"] = model.optimizer_step()
            finite = all(math.isfinite(step[f"{name}/grad_norm"]) for name, _ in trained)
            guard.record(not finite, "gradient")
            if finite:
                for key, value in step.items():
                    sums[key] = sums.get(key, 0.0) + value
                count += 1
    return {key: value / count for key, value in sums.items()} if count else {}


def evaluate(c, examples: list[PromptExample], gen_cfg, eval_cfg) -> tuple[dict[str, float], dict[str, Scored]]:
    """Metrics and scored completions on ``examples``: greedy (if enabled) and sampled at the training temperature."""
    if eval_cfg.max_prompts is not None:
        examples = examples[: eval_cfg.max_prompts]
    metrics: dict[str, float] = {}
    results: dict[str, Scored] = {}
    runs = [("greedy", 1, True)] if eval_cfg.greedy else []
    if eval_cfg.num_samples > 0:
        runs.append(("sampled", eval_cfg.num_samples, False))
    for name, n, greedy in runs:
        scored = generate_and_score(c, examples, n, sampling_params(gen_cfg, greedy), training=False)
        metrics[f"eval/{name}_scores"] = scored.scores.mean().item()
        if "objective/verifiable_correct_rate" in scored.metrics:
            metrics[f"eval/{name}_correct_rate"] = scored.metrics["objective/verifiable_correct_rate"]
        if "reward/model" in scored.metrics:
            metrics[f"eval/{name}_reward_model"] = scored.metrics["reward/model"]
        metrics[f"eval/{name}_sequence_lengths"] = scored.rollout.response_lengths.mean().item()
        results[name] = scored
    return metrics, results
