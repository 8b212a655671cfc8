"""The synchronous schedule: every stage of a step runs in turn, generation always on the newest weights."""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager

import torch

from rlhf import stages
from rlhf.registry import register

log = logging.getLogger("rlhf")


@contextmanager
def timed(times: dict[str, float], name: str):
    start = time.perf_counter()
    yield
    times[f"time/{name}"] = time.perf_counter() - start


def run_eval(c, cfg, tracker, step: int) -> dict[str, float]:
    metrics, scored = stages.evaluate(c, c.eval_examples, cfg.generator, cfg.eval)
    if metrics:
        tracker.log(step, metrics)
        log.info("eval @ step %d: %s", step, ", ".join(f"{k} {v:.3f}" for k, v in metrics.items()))
    if scored is not None:
        n = cfg.logging.num_sample_texts
        tracker.samples(step, scored.prompts[:n], scored.responses[:n], scored.scores[:n].tolist(), tag="eval_samples")
    return metrics


@register("schedule", "sync")
def run(c, cfg, sizes, tracker) -> dict[str, dict[str, float]]:
    """Train for `train.num_steps` steps; returns the first and last eval metrics and the last step's metrics."""
    train, algo = cfg.train, cfg.algorithm
    sampling = stages.sampling_params(cfg.generator)
    shuffle = torch.Generator().manual_seed(cfg.seed)
    first_eval = run_eval(c, cfg, tracker, 0)
    metrics: dict[str, float] = {}
    for step in range(1, train.num_steps + 1):
        times: dict[str, float] = {}
        with timed(times, "step"):
            with timed(times, "generation"):
                examples = c.prompts.next_batch(train.prompts_per_step)
                scored = stages.generate_and_score(c, examples, algo.num_samples_per_prompt, sampling)
            with timed(times, "logprobs"):
                batch, metrics = stages.prepare(
                    c, scored, cfg.generator.temperature, train.micro_batch_size, algo.num_samples_per_prompt
                )
            with timed(times, "training"):
                metrics |= stages.update_policy(c, batch, train, cfg.generator.temperature, shuffle)
            with timed(times, "weight_sync"):
                c.generator.update_weights(c.policy.state_dict())
        metrics |= scored.metrics | times
        metrics |= {
            "episode": step * sizes.samples_per_step,
            "epoch": c.prompts.epochs_done,
            "lr": c.policy.lr,
            "time/total": tracker.elapsed(),
        }
        tracker.log(step, metrics)
        if step % cfg.logging.log_every == 0 or step == train.num_steps:
            tracker.console(step, train.num_steps, metrics)
        if cfg.logging.sample_every and step % cfg.logging.sample_every == 0:
            n = cfg.logging.num_sample_texts
            tracker.samples(step, scored.prompts[:n], scored.responses[:n], scored.scores[:n].tolist())
        if cfg.eval.every and step % cfg.eval.every == 0 and step != train.num_steps:
            run_eval(c, cfg, tracker, step)
    last_eval = run_eval(c, cfg, tracker, train.num_steps)
    return {"first_eval": first_eval, "last_eval": last_eval, "last_step": metrics}
