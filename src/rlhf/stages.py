"""The stages of one RL step, shared by every schedule: generate, score, prepare, update, evaluate.

Schedules decide when these run; the RL math they call lives in `rlhf.functional` and `rlhf.algorithms`.
Every stage passes on one type, `rlhf.trajectory.Trajectories`.
"""

from __future__ import annotations

import math
import time
import zlib
from dataclasses import dataclass, replace

import torch

from rlhf.data.prompts import PromptExample
from rlhf.envs.loop import drop_failed_groups
from rlhf.envs.rows import episode_metrics, episode_rows, transcript
from rlhf.functional import masked_mean, masked_sum
from rlhf.functional.kl import logprob_gap
from rlhf.generators.base import SamplingParams
from rlhf.micro_batches import Budget, padded_tokens, place
from rlhf.models.dtypes import tensor_bytes
from rlhf.trajectory import Forward, Trajectories


@dataclass
class Scored:
    """Generated trajectories with their scores (``batch.scores``) and decoded texts."""

    batch: Trajectories  # on the CPU, with group ids and scores
    prompts: list[str]  # (B,) prompt texts, each repeated num_samples_per_prompt times in a row
    responses: list[str]  # (B,) decoded completions, special tokens removed
    metrics: dict[str, float]  # per-function reward means and the verifiable correct rate
    versions: torch.Tensor | None = None  # (B,) policy version that generated each row (async schedule), else None

    @property
    def scores(self) -> torch.Tensor:
        """(B,) summed reward after the non-stop penalty."""
        return self.batch.scores


def sampling_params(gen_cfg, greedy: bool = False) -> SamplingParams:
    """The sampling settings of `generator.*`."""
    return SamplingParams(gen_cfg.max_new_tokens, gen_cfg.temperature, gen_cfg.top_p, greedy)


def generate_and_score(
    c, examples: list[PromptExample], samples_per_prompt: int, sampling: SamplingParams, training: bool = True,
    generator=None,
) -> Scored:
    """Sample ``samples_per_prompt`` responses per prompt (grouped in a row), decode them, score them; with an
    environment (`env.name`), play ``samples_per_prompt`` episodes of each task instead (`play`). When training an
    algorithm whose advantage needs a greedy baseline (ReMax), one greedy response per prompt is generated and scored
    too (`with_greedy_baseline`). ``generator`` defaults to the run's."""
    generator = generator if generator is not None else c.generator
    if c.env is not None:
        return play(c, examples, samples_per_prompt, sampling, generator)
    repeated = repeat_prompts(examples, samples_per_prompt)
    batch = generator.generate([list(ex.token_ids) for ex in repeated], sampling)
    scored = score(c, repeated, with_groups(batch, samples_per_prompt), training)
    if training and c.algorithm.needs_greedy_baseline:
        scored = with_greedy_baseline(c, examples, scored, sampling, generator)
    return scored


def with_greedy_baseline(c, examples: list[PromptExample], scored: Scored, sampling: SamplingParams, generator) -> Scored:
    """``scored`` with each row's baseline, the score of its prompt's greedy response (ReMax), as
    ``batch.extras['baseline_scores']`` (B,); its cost is logged as `time/greedy_baseline`."""
    start = time.perf_counter()
    greedy = generator.generate([list(ex.token_ids) for ex in examples], replace(sampling, greedy=True))
    baseline = score(c, examples, with_groups(greedy, 1), training=False).scores
    per_row = baseline.repeat_interleave(len(scored.batch) // len(examples))
    batch = replace(scored.batch, extras=dict(scored.batch.extras, baseline_scores=per_row))
    metrics = scored.metrics | {
        "objective/greedy_baseline_scores": baseline.mean().item(),
        "time/greedy_baseline": time.perf_counter() - start,
    }
    return replace(scored, batch=batch, metrics=metrics)


def play(c, examples: list[PromptExample], group_size: int, sampling: SamplingParams, generator) -> Scored:
    """``group_size`` episodes of each task with ``generator``, as trajectory rows scored by the environment.

    Groups with a failed episode are dropped (their baseline would be biased) and counted; a batch in which every
    episode failed stops the run, naming the first error.
    """
    runner = c.env
    tasks = examples if runner.maker.uses_dataset else [None] * len(examples)
    episodes = runner.run(generator, tasks, [task_seed(ex, runner.maker, c.prompts.seed) for ex in examples], group_size, sampling)
    kept, failed = drop_failed_groups(episodes)
    if not kept:
        first = next(ep.error for ep in episodes if ep.failed)
        raise RuntimeError(f"every episode of the batch failed in environment {runner.cfg.name!r}; the first: {first}")
    batch = episode_rows(kept, runner.cfg.reward_reduce, int(c.tokenizer.pad_token_id))
    return Scored(batch, [ep.turns[0].observation for ep in kept], [transcript(ep) for ep in kept], episode_metrics(kept, failed))


def task_seed(example: PromptExample, maker, run_seed: int) -> int:
    """An episode's reset seed: the task instance itself for environments without a dataset (its ground truth),
    else fixed by the prompt text and the run's seed."""
    if not maker.uses_dataset:
        return int(example.ground_truth)
    return (zlib.crc32(example.text.encode()) + 7919 * run_seed) % 2**31


def repeat_prompts(examples: list[PromptExample], samples_per_prompt: int) -> list[PromptExample]:
    """Each prompt ``samples_per_prompt`` times in a row (a group)."""
    return [ex for ex in examples for _ in range(samples_per_prompt)]


def with_groups(batch: Trajectories, samples_per_prompt: int) -> Trajectories:
    """The rows' group ids: each run of ``samples_per_prompt`` consecutive rows shares a prompt."""
    groups = torch.arange(len(batch) // samples_per_prompt, device=batch.group_id.device)
    return replace(batch, group_id=groups.repeat_interleave(samples_per_prompt))


def score(c, repeated: list[PromptExample], batch: Trajectories, training: bool = True) -> Scored:
    """Decode and score trajectories of the prompts ``repeated`` (one row each)."""
    responses = c.tokenizer.batch_decode(batch.window_ids, skip_special_tokens=True)
    prompts = [ex.text for ex in repeated]
    scores, metrics = c.rewards.score(prompts, responses, [ex.ground_truth for ex in repeated], batch, training)
    return Scored(replace(batch, scores=scores).to("cpu"), prompts, responses, metrics)


def prepare(
    c, scored: Scored, temperature: float, micro: int | Budget, old_from_training: bool = False
) -> tuple[Trajectories, dict[str, float]]:
    """Pre-update policy logprobs, reference logprobs and critic values, then the algorithm's training batch; forwards
    in micro batches of ``micro`` rows (or a `Budget`). ``old_from_training`` (see `old_logprobs_from_training`)
    skips the pre-update policy pass: `update_policy` takes those logprobs from its own forward."""
    batch = scored.batch.to(c.device)
    metrics = {
        "objective/scores": batch.scores.mean().item(),
        "val/sequence_lengths": batch.action_lengths.mean().item(),
        "val/num_stop_token_ids": batch.stopped.sum().item(),
        "val/stop_rate": batch.stopped.float().mean().item(),
    }
    if c.algorithm.needs_old_logprobs and not old_from_training:
        old_logp, entropy = c.policy.rollout_logprobs(batch, temperature, micro, with_entropy=True)
        batch = replace(batch, old_logp=old_logp)
        metrics |= old_logprob_metrics(c, batch, entropy)
    if c.reference is not None:
        batch = replace(batch, ref_logp=c.reference.rollout_logprobs(batch, temperature, micro))
    if c.critic is not None:
        batch = replace(batch, values=c.critic.rollout_values(batch, micro))
    batch, algorithm_metrics = c.algorithm.build_batch(batch)
    return batch, metrics | algorithm_metrics


def old_logprobs_from_training(c, train_cfg) -> bool:
    """Whether the pre-update logprobs can come from the training forward itself (detached) instead of a pass of
    their own: the step makes one optimiser step (`train.num_epochs` = `train.num_mini_batches` = 1), so the
    training forward runs on exactly the pre-update weights, and the algorithm builds its batch without them
    (`PolicyGradient.batch_reads_old_logprobs`). `algorithm.reuse_training_logprobs=false` turns it off."""
    algorithm = c.algorithm
    return (
        not algorithm.pairwise
        and algorithm.needs_old_logprobs
        and bool(algorithm.cfg.reuse_training_logprobs)
        and not algorithm.batch_reads_old_logprobs
        and train_cfg.num_epochs == 1
        and train_cfg.num_mini_batches == 1
    )


def old_logprob_metrics(c, batch: Trajectories, entropy: torch.Tensor) -> dict[str, float]:
    """What the pre-update logprobs tell (``batch.old_logp``, with their entropy (B, T)): `objective/entropy` and the
    generator-trainer gap, which `c.gap_watch` observes."""
    mask = batch.loss_mask
    metrics = {"objective/entropy": masked_sum(entropy, mask, dim=1).mean().item()}
    metrics |= sample_train_gap(batch.gen_logp, batch.old_logp, mask)
    if c.gap_watch is not None:
        c.gap_watch.observe(metrics["checks/logprob_gap_mean"])
    return metrics


def sample_train_gap(gen_logp: torch.Tensor, train_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the generator's logprobs are from the trainer's on the same tokens (seed 004's names, and the
    parity figures of `rlhf.parity`: mean and largest |gen - train| per token, k3 KL).

    Shapes: (B, T) each. v1 = mean(gen - train), v2 = mean((gen - train)^2) / 2, over action tokens.
    """
    diff = gen_logp - train_logp
    gap = logprob_gap(gen_logp, train_logp, mask)
    return {
        "val/generator_logprob_diff": gap["mean"],
        "checks/logprob_gap_mean": gap["mean"],
        "checks/logprob_gap_max": gap["max"],
        "checks/logprob_gap_k3": gap["k3"],
        "train/kl_sample_train_v1": masked_mean(diff, mask).item(),
        "train/kl_sample_train_v2": 0.5 * masked_mean(diff.square(), mask).item(),
    }


def push_weights(c, version: int | None = None) -> dict[str, float]:
    """Hand the policy's new weights to the generator: only the tensors a step changes (every weight under full
    fine-tuning; a LoRA policy's adapted layers, merged). Returns `perf/weight_sync_mb`, the size of that push, when
    the weights pass through this process (the Ray backend sends them through the object store instead)."""
    weights = c.policy.state_dict(adapted_only=True)
    c.generator.update_weights(weights, **({} if version is None else {"version": version}))
    if not isinstance(weights, dict):
        return {}
    return {"perf/weight_sync_mb": tensor_bytes(weights.values()) / 2**20}


def trained_models(c) -> list[tuple[str, object]]:
    """(name, model) of every model the run trains: the policy, and the critic when there is one."""
    return [("policy", c.policy)] + ([("critic", c.critic)] if c.critic is not None else [])


def update_policy(c, batch: Trajectories, train_cfg, temperature: float, guard) -> dict[str, float]:
    """`train.num_epochs` passes over the batch in shuffled mini batches, accumulating micro batches.

    Micro batches hold at most `train.micro_batch_size` samples and `train.max_tokens_per_micro_batch` tokens
    (`rlhf.micro_batches`); for pairwise algorithms (DPO) they hold whole pairs. A non-finite loss in any trained
    model drops every model's gradients for that mini batch; a non-finite gradient norm skips that model's update.
    Either way ``guard`` counts the mini batch and stops the run after too many in a row. When ``batch.old_logp`` is
    None (`prepare` with ``old_from_training``), the policy's forward supplies them and the metrics they feed.
    Returns the algorithm's metrics averaged over mini batches, gradient norms, and `perf/total_num_tokens` (real
    tokens of the batch) and `perf/padding_fraction` (the share of padding in what the training forwards' token-wise
    layers computed, packed or not as the policy runs them: `micro_batches.padded_tokens`).
    """
    units = batch.num_units
    mini_units = max(1, units // train_cfg.num_mini_batches)  # an environment batch may have lost failed groups
    micro_units = min(mini_units, max(1, train_cfg.micro_batch_size // batch.rows_per_unit))
    micro = Budget(micro_units * batch.rows_per_unit, train_cfg.max_tokens_per_micro_batch)
    trained = trained_models(c)
    loss_fns = {"policy": "policy_loss", "critic": "value_loss"}  # the algorithm's loss for each trained model
    from_training = batch.old_logp is None and c.algorithm.needs_old_logprobs
    with_entropy = c.algorithm.needs_entropy  # with from_training the policy records the entropy outside the graph
    sums: dict[str, float] = {}
    late: dict[str, float] = {}
    count = 0
    computed = real = 0  # tokens the training forwards run on and the real ones among them, as one process cuts them
    for _ in range(train_cfg.num_epochs):
        for mini_ids in torch.randperm(units, generator=c.shuffle).split(mini_units):
            mini = batch.select_units(mini_ids)
            mini_computed, mini_real = padded_tokens(mini, micro, c.policy_packs)
            computed, real = computed + mini_computed, real + mini_real
            denominator = c.algorithm.denominator(mini)
            results = [
                model.accumulate(
                    getattr(c.algorithm, loss_fns[name]), mini, denominator, micro, temperature, with_entropy,
                    from_training and name == "policy",
                )
                for name, model in trained
            ]
            if not all(finite for finite, _, _ in results):
                for _, model in trained:
                    model.zero_grad()
                guard.record(True, "loss")
                continue
            if from_training:
                late = logprobs_from_training(c, batch, batch.rows_of(mini_ids), results[0][2])
            step = {key: value for _, metrics, _ in results for key, value in metrics.items()}
            for name, model in trained:
                step[f"{name}/grad_norm"] = model.optimizer_step()
            finite = all(math.isfinite(step[f"{name}/grad_norm"]) for name, _ in trained)
            guard.record(not finite, "gradient")
            if finite:
                for key, value in step.items():
                    sums[key] = sums.get(key, 0.0) + value
                count += 1
    if not count:
        return late
    perf = {"perf/total_num_tokens": float(batch.attention_mask.sum()), "perf/padding_fraction": 1 - real / max(computed, 1)}
    return {key: value / count for key, value in sums.items()} | late | perf


def logprobs_from_training(c, batch: Trajectories, rows: torch.Tensor, forward: Forward) -> dict[str, float]:
    """The metrics of the pre-update logprobs, from the training forward's (``forward``: detached, rows ``rows`` of
    ``batch`` in that order), exactly as `prepare` computes them from a pass of their own."""
    width = batch.loss_mask.shape[1]
    device = batch.loss_mask.device
    old_logp, entropy = (place([t.to(device)], [rows], width) for t in (forward.logp, forward.entropy))
    filled = replace(batch, old_logp=old_logp)
    return old_logprob_metrics(c, filled, entropy) | c.algorithm.old_logprob_metrics(filled)


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
        for key in ("success_rate", "first_turn_success_rate", "later_turn_success_rate", "episode_return", "num_turns_per_episode"):
            if f"env/{key}" in scored.metrics:
                metrics[f"eval/{name}_{key}"] = scored.metrics[f"env/{key}"]
        if "reward/model" in scored.metrics:
            metrics[f"eval/{name}_reward_model"] = scored.metrics["reward/model"]
        metrics[f"eval/{name}_sequence_lengths"] = scored.batch.action_lengths.mean().item()
        results[name] = scored
    return metrics, results
