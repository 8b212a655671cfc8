"""The loop every schedule shares: run a step, log, sample texts, evaluate and checkpoint on schedule, stop on a signal.

A schedule supplies only ``step_fn(step) -> (metrics, scored)``; what happens between steps is the same for all.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager, nullcontext
from typing import Callable

import torch

from rlhf import checkpoint, dynamic_sampling, stages
from rlhf.data.prompts import epochs_done
from rlhf.schedules.common import RunState

log = logging.getLogger("rlhf")


@contextmanager
def timed(times: dict[str, float], name: str):
    """Adds the seconds the block took to ``times['time/<name>']``."""
    start = time.perf_counter()
    yield
    times[f"time/{name}"] = times.get(f"time/{name}", 0.0) + time.perf_counter() - start


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


def run_steps(
    c, cfg, sizes, tracker, state: RunState, stop, step_fn: Callable[[int], tuple[dict, stages.Scored]],
    stream_states: Callable[[int], dict] | None = None, guard=None,
) -> RunState:
    """Train from ``state.step`` to `train.num_steps` with ``step_fn``, evaluating and checkpointing on schedule.

    Schedules that draw and score prompts ahead of training pass ``stream_states(step)``: the prompt stream's and
    the reward statistics' states as of the end of ``step`` ({"prompts", "rewards"}), for checkpoints and the epoch
    count; and ``guard``, a lock that evaluation holds so its seeded sampling never interleaves with theirs.
    Stops early, after saving a checkpoint, when ``stop.requested`` is set (SIGTERM/SIGINT).
    """
    train = cfg.train
    guard = guard if guard is not None else nullcontext()
    if state.step == 0:
        with guard:
            state.first_eval = run_eval(c, cfg, tracker, 0)
    for step in range(state.step + 1, train.num_steps + 1):
        metrics, scored = step_fn(step)
        state.step = step
        states = stream_states(step) if stream_states is not None else None
        metrics |= {
            "episode": step * sizes.samples_per_step,
            "epoch": epochs_done(states["prompts"]) if states is not None else c.prompts.epochs_done,
            "lr": c.policy.lr,
            "train/skipped_steps": state.guard.total,
            "time/total": tracker.elapsed(),
        }
        tracker.log(step, metrics)
        tracker.console(step, train.num_steps, metrics)  # the bar every step, a line every logging.log_every
        if cfg.logging.sample_every and step % cfg.logging.sample_every == 0:
            n = cfg.logging.num_sample_texts
            tracker.samples(step, scored.prompts[:n], scored.responses[:n], scored.scores[:n].tolist())
        if (sizes.eval_every and step % sizes.eval_every == 0) or step == train.num_steps:
            with guard:
                state.last_eval = run_eval(c, cfg, tracker, step)
        every = cfg.checkpoint.every
        if stop.requested or (every and step % every == 0) or (every and step == train.num_steps):
            checkpoint.save(c, tracker.checkpoint_root, step, state.to_dict(), cfg.checkpoint.keep_last, states)
        if stop.requested:
            log.warning("%s received: stopped after step %d with a checkpoint; continue with resume=auto", stop.requested, step)
            state.preempted = True
            break
    return state


def learn(c, cfg, scored: stages.Scored, state: RunState, times: dict[str, float]) -> dict[str, float]:
    """Score-to-update half of a step: logprobs, values and the algorithm's batch, then the optimiser steps."""
    train = cfg.train
    with timed(times, "logprobs"):
        batch, metrics = stages.prepare(c, scored, cfg.generator.temperature, train.micro_batch_size)
    with timed(times, "training"):
        metrics |= stages.update_policy(c, batch, train, cfg.generator.temperature, state.guard)
    return metrics


def generate(c, cfg, times: dict[str, float]) -> stages.Scored:
    """Draw the step's prompts, sample and score their responses (`algorithm.filter_groups`: see `dynamic_sampling`)."""
    with timed(times, "generation"):
        examples = c.prompts.next_batch(cfg.train.prompts_per_step)
        return dynamic_sampling.generate_groups(c, cfg.algorithm, examples, c.prompts.next_batch, stages.sampling_params(cfg.generator))
