"""The stages of one RL step, shared by every schedule: generate, score, prepare, update, evaluate.

Schedules decide when these run; the RL math they call lives in `rlhf.functional` and the estimators.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rlhf import functional as F
from rlhf.data.prompts import PromptExample
from rlhf.estimators.base import Forward, StepInputs, TrainBatch
from rlhf.generators.base import Rollout, SamplingParams


@dataclass
class Scored:
    """A rollout with its decoded texts and scores."""

    rollout: Rollout
    prompts: list[str]  # (B,) prompt texts, each repeated num_samples_per_prompt times in a row
    responses: list[str]  # (B,) decoded responses, special tokens removed
    scores: torch.Tensor  # (B,) summed reward after the non-stop penalty
    metrics: dict[str, float]  # per-function reward means and the verifiable correct rate


def sampling_params(gen_cfg, greedy: bool = False) -> SamplingParams:
    """The sampling settings of `generator.*`."""
    return SamplingParams(gen_cfg.max_new_tokens, gen_cfg.temperature, gen_cfg.top_p, greedy)


def generate_and_score(
    c, examples: list[PromptExample], samples_per_prompt: int, sampling: SamplingParams, training: bool = True
) -> Scored:
    """Sample ``samples_per_prompt`` responses per prompt (grouped in a row), decode them, score them."""
    repeated = [ex for ex in examples for _ in range(samples_per_prompt)]
    rollout = c.generator.generate([list(ex.token_ids) for ex in repeated], sampling)
    responses = c.tokenizer.batch_decode(rollout.response_ids, skip_special_tokens=True)
    prompts = [ex.text for ex in repeated]
    scores, metrics = c.rewards.score(prompts, responses, [ex.ground_truth for ex in repeated], rollout, training)
    return Scored(rollout.to("cpu"), prompts, responses, scores, metrics)


@torch.no_grad()
def chunked(fn, rollout: Rollout, chunk: int) -> list:
    """``fn`` applied to consecutive row slices of ``rollout``, results as a list."""
    return [fn(part) for part in rollout.chunks(chunk)]


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
        parts = chunked(lambda r: c.policy.logprobs(r, temperature, with_entropy=True), rollout, micro_batch_size)
        old_logp = torch.cat([p[0] for p in parts]).detach()
        metrics["objective/entropy"] = F.masked_sum(torch.cat([p[1] for p in parts]), mask, dim=1).mean().item()
        metrics["val/generator_logprob_diff"] = F.masked_mean((rollout.logprobs - old_logp).abs(), mask).item()
    if c.reference is not None:
        ref_logp = torch.cat(chunked(lambda r: c.reference.logprobs(r, temperature), rollout, micro_batch_size))
    if c.critic is not None:
        values = torch.cat(chunked(c.critic.values, rollout, micro_batch_size)).detach()
    inputs = StepInputs(rollout, scored.scores.to(c.device), old_logp, ref_logp, values, samples_per_prompt)
    batch, estimator_metrics = c.estimator.build_batch(inputs)
    return batch, metrics | estimator_metrics


def _is_share(key: str) -> bool:
    """Loss metrics are each micro batch's share of the mini-batch loss (summed); others are averaged."""
    return key.startswith("loss/") or key == "objective/loss"


def update_policy(c, batch: TrainBatch, train_cfg, temperature: float, guard) -> dict[str, float]:
    """`train.num_epochs` passes over the batch in shuffled mini batches, accumulating micro batches.

    Micro-batch sizes count samples; for pairwise estimators (DPO) a mini batch holds whole pairs. A mini
    batch with a non-finite loss or gradient changes no weight; ``guard`` counts it and stops the run after
    too many in a row. Returns the estimator's metrics averaged over mini batches, and gradient norms.
    """
    units = batch.num_units
    mini_units = units // train_cfg.num_mini_batches
    micro_units = min(mini_units, max(1, train_cfg.micro_batch_size // batch.rows_per_unit))
    critic = c.critic
    sums: dict[str, float] = {}
    count = 0
    for _ in range(train_cfg.num_epochs):
        for mini_ids in torch.randperm(units, generator=c.shuffle).split(mini_units):
            mini = batch.select_units(mini_ids)
            denominator = c.estimator.denominator(mini)
            step: dict[str, float] = {}
            finite = True
            micro_ids = torch.arange(mini.num_units).split(micro_units)
            for ids in micro_ids:
                micro = mini.select_units(ids)
                logp, entropy = c.policy.logprobs(micro.rollout, temperature, with_entropy=c.estimator.needs_entropy)
                values = critic.values(micro.rollout) if critic is not None else None
                policy_loss, value_loss, metrics = c.estimator.loss(micro, Forward(logp, entropy, values), denominator)
                losses = [policy_loss] + ([value_loss] if value_loss is not None else [])
                if not all(torch.isfinite(loss).item() for loss in losses):
                    finite = False
                    break  # no backward: a NaN must not reach the gradients
                c.policy.backward(policy_loss)
                if value_loss is not None:
                    critic.backward(value_loss)
                for key, value in metrics.items():
                    step[key] = step.get(key, 0.0) + float(value) * (1.0 if _is_share(key) else 1.0 / len(micro_ids))
            if finite:  # both models step only if every gradient is finite
                trained = [("policy", c.policy)] + ([("critic", critic)] if critic is not None else [])
                for name, model in trained:
                    step[f"{name}/grad_norm"] = model.clip_gradients()
                finite = all(math.isfinite(step[f"{name}/grad_norm"]) for name, _ in trained)
                for _, model in trained:
                    model.step() if finite else model.zero_grad()
                guard.record(not finite, "gradient")
            else:
                c.policy.zero_grad()
                if critic is not None:
                    critic.zero_grad()
                guard.record(True, "loss")
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
