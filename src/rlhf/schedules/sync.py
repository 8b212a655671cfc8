"""The synchronous schedule: every stage of a step runs in turn, generation always on the newest weights."""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager

import torch

from rlhf import checkpoint, stages
from rlhf.registry import register
from rlhf.schedules.common import RunState

log = logging.getLogger("rlhf")


@contextmanager
def timed(times: dict[str, float], name: str):
    start = time.perf_counter()
    yield
    times[f"time/{name}"] = time.perf_counter() - start


def run_eval(c, cfg, tracker, step: int) -> dict[str, float]:
    """Evaluate on a private RNG stream (seeded by seed and step), so evaluating never changes training."""
    devices = list(range(torch.cuda.device_count())) if c.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(cfg.seed * 1_000_003 + step)
        metrics, results = stages.evaluate(c, c.eval_examples, cfg.generator, cfg.eval)
    if metrics:
        tracker.log(step, metrics)
        log.info("eval @ step %d: %s", step, ", ".join(f"{k} {v:.3f}" for k, v in metrics.items()))
    n = cfg.logging.num_sample_texts
    for mode, scored in results.items():
        tracker.samples(step, scored.prompts[:n], scored.responses[:n], scored.scores[:n].tolist(), tag=f"eval_samples/{mode}")
        if cfg.eval.save_generations:
            tracker.generations(step, mode, scored)
    return metrics


def train_step(c, cfg, state: RunState) -> tuple[dict[str, float], stages.Scored]:
    """One synchronous RL step: generate, score, prepare, update, push weights. Returns its metrics."""
    train, algo = cfg.train, cfg.algorithm
    times: dict[str, float] = {}
    with timed(times, "step"):
        with timed(times, "generation"):
            examples = c.prompts.next_batch(train.prompts_per_step)
            scored = stages.generate_and_score(c, examples, algo.num_samples_per_prompt, stages.sampling_params(cfg.generator))
        with timed(times, "logprobs"):
            batch, metrics = stages.prepare(c, scored, cfg.generator.temperature, train.micro_batch_size, algo.num_samples_per_prompt)
        with timed(times, "training"):
            metrics |= stages.update_policy(c, batch, train, cfg.generator.temperature, state.guard)
        with timed(times, "weight_sync"):
            c.generator.update_weights(c.policy.state_dict())
    return metrics | scored.metrics | times, scored


@register("schedule", "sync")
def run(c, cfg, sizes, tracker, state: RunState, stop) -> RunState:
    """Train from ``state.step`` to `train.num_steps`, evaluating and checkpointing on schedule.

    Stops early, after saving a checkpoint, when ``stop.requested`` is set (SIGTERM/SIGINT).
    """
    train = cfg.train
    if state.step == 0:
        state.first_eval = run_eval(c, cfg, tracker, 0)
    for step in range(state.step + 1, train.num_steps + 1):
        metrics, scored = train_step(c, cfg, state)
        state.step = step
        metrics |= {
            "episode": step * sizes.samples_per_step,
            "epoch": c.prompts.epochs_done,
            "lr": c.policy.lr,
            "train/skipped_steps": state.guard.total,
            "time/total": tracker.elapsed(),
        }
        tracker.log(step, metrics)
        if step % cfg.logging.log_every == 0 or step == train.num_steps:
            tracker.console(step, train.num_steps, metrics)
        if cfg.logging.sample_every and step % cfg.logging.sample_every == 0:
            n = cfg.logging.num_sample_texts
            tracker.samples(step, scored.prompts[:n], scored.responses[:n], scored.scores[:n].tolist())
        if (sizes.eval_every and step % sizes.eval_every == 0) or step == train.num_steps:
            state.last_eval = run_eval(c, cfg, tracker, step)
        every = cfg.checkpoint.every
        if stop.requested or (every and step % every == 0) or (every and step == train.num_steps):
            checkpoint.save(c, tracker.checkpoint_root, step, state.to_dict(), cfg.checkpoint.keep_last)
        if stop.requested:
            log.warning("%s received: stopped after step %d with a checkpoint; continue with resume=auto", stop.requested, step)
            state.preempted = True
            break
    return state
