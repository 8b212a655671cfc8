"""Log-prob parity: the generator samples what the trainer would, checked before the first step and watched after.

Before the first step (`gate`) the generator samples a small probe batch (`checks.parity_prompts` prompts, one
response each, the training sampling settings) and the trainer scores the same tokens. Mean and max |Δ log p| and the
k3 KL are printed; a mean above `checks.max_logprob_gap` (by default 0.01 under float32, 0.1 under bfloat16 and
float16) refuses the run (exit 2) and names the usual causes. During training every step logs the same figures from
data it already has (`rlhf.step.learner.sample_train_gap`), and `GapWatch` warns when the mean jumps past
`checks.gap_jump_factor` times its running level; `checks.stop_on_gap=true` stops the run instead.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

from rlhf.errors import ConfigError
from rlhf.functional.kl import logprob_gap
from rlhf.generators.base import SamplingParams

log = logging.getLogger("rlhf")

DEFAULT_MAX_GAP = {"float32": 0.01, "bfloat16": 0.1, "float16": 0.1}  # mean |Δ log p| per token the gate accepts
PROBE_TOKENS = 16  # the probe's response budget (at most generator.max_new_tokens)
NOISE_SHARE = 0.1  # a step's gap under this share of the gate's threshold is numerical noise: never a jump
NEWEST_WEIGHT = 0.3  # weight of the newest step in the running level of the gap


class ParityError(ConfigError):
    """The generator's log-probabilities are too far from the trainer's for the run to start."""


class LogprobGapError(RuntimeError):
    """The generator's log-probabilities jumped away from the trainer's during training (`checks.stop_on_gap`)."""


def max_gap(spec) -> float:
    """The gate's threshold for the run ``spec`` (`rlhf.config.RunSpec`): `checks.max_logprob_gap`, or the default
    for `model.dtype`."""
    if spec.checks.max_logprob_gap is not None:
        return float(spec.checks.max_logprob_gap)
    return DEFAULT_MAX_GAP[spec.model.dtype]


def short_sampling(gen_cfg):
    """The run's sampling settings with at most PROBE_TOKENS new tokens (the probe's, and preflight's)."""
    return replace(SamplingParams.of(gen_cfg), max_new_tokens=min(PROBE_TOKENS, gen_cfg.max_new_tokens))


def probe(c, spec) -> dict[str, float]:
    """Sample the probe batch with the run's generator and score it with its policy; `logprob_gap`'s figures.

    The prompts are the first evaluation prompts (else the first training prompts: the prompt stream is not drawn
    from), and every torch RNG is put back afterwards, so the run samples what it would have without the probe."""
    examples = (c.eval_examples or c.collector.prompts.examples)[: spec.checks.parity_prompts]
    sampling = short_sampling(spec.generator.config)
    devices = [c.device.index or 0] if c.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        if c.collector.env is None:  # plain prompts need no scoring
            batch = c.collector.generator.generate([list(ex.token_ids) for ex in examples], sampling).to(c.device)
        else:  # an environment's episodes are played (and scored) to build the rows
            batch = c.collector.play(examples, 1, sampling, training=False).batch.to(c.device)
        train_logp, _ = c.learner.policy.rollout_logprobs(batch, spec.train.micro_batch_size)
    return logprob_gap(batch.gen_logp, train_logp, batch.loss_mask)


def gate(c, spec) -> dict[str, float] | None:
    """Before the first step of the run ``spec`` (`rlhf.config.RunSpec`) built as ``c``: `probe`, print its figures,
    and refuse the run (ParityError) when the mean gap is above the threshold. None when `checks.parity_prompts=0`."""
    if spec.checks.parity_prompts == 0:
        return None
    start = time.perf_counter()
    figures = probe(c, spec)
    limit = max_gap(spec)
    log.info(
        "log-prob parity (generator vs trainer, %d probe prompts): mean |Δ log p| %.3g, max %.3g, k3 KL %.3g "
        "(threshold %.3g, %.2f s)", spec.checks.parity_prompts, figures["mean"], figures["max"], figures["k3"], limit,
        time.perf_counter() - start,
    )
    if figures["mean"] > limit:
        raise ParityError(
            f"the generator's log-probabilities are far from the trainer's on the same tokens before any training: mean "
            f"|Δ log p| {figures['mean']:.3g} per token (max {figures['max']:.3g}, k3 KL {figures['k3']:.3g}) is above "
            f"checks.max_logprob_gap={limit:g} for model.dtype={spec.model.dtype}. Usual causes: the generator and "
            f"trainer run different dtypes or attention kernels; sampling settings that change the returned "
            f"log-probs (temperature, top_p/top_k renormalisation) differ from what the trainer assumes "
            f"(generator.temperature); the generator holds other weights than the policy (a stale or wrong push); the "
            f"generator's tokenizer differs from the policy's. Raise checks.max_logprob_gap if the gap is expected, "
            f"or skip the gate with checks.parity_prompts=0"
        )
    return figures


class GapWatch:
    """Follows `checks/logprob_gap_mean` step by step; warns (or, with `checks.stop_on_gap`, raises LogprobGapError)
    when a step's gap exceeds `checks.gap_jump_factor` times the running level of the steps before it.

    Gaps under `NOISE_SHARE` of the gate's threshold never count as a jump; a jumped step does not move the level."""

    def __init__(self, factor: float, floor: float, stop: bool) -> None:
        self.factor, self.floor, self.stop = factor, floor, stop
        self.level: float | None = None  # running (exponentially weighted) mean gap of the steps so far

    @classmethod
    def of(cls, spec) -> "GapWatch":
        """The watch `checks.*` of the run ``spec`` (`rlhf.config.RunSpec`) sets."""
        return cls(spec.checks.gap_jump_factor, NOISE_SHARE * max_gap(spec), spec.checks.stop_on_gap)

    def observe(self, gap: float) -> None:
        """Take one step's mean gap."""
        if self.level is not None and gap > self.floor and gap > self.factor * self.level:
            message = (
                f"checks/logprob_gap_mean jumped to {gap:.3g}, {gap / max(self.level, 1e-30):.0f}x its running level "
                f"{self.level:.3g} (checks.gap_jump_factor={self.factor:g}): the generator now samples from something "
                f"other than what the trainer scores (weights not delivered, numerics, a changed sampling setting)"
            )
            if self.stop:
                raise LogprobGapError(f"{message}; checks.stop_on_gap=true stopped the run")
            log.warning("%s; checks.stop_on_gap=true would stop the run", message)
            return
        self.level = gap if self.level is None else NEWEST_WEIGHT * gap + (1 - NEWEST_WEIGHT) * self.level
