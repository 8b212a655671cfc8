"""The synchronous schedule: every stage of a step runs in turn, generation always on the newest weights."""

from __future__ import annotations

from rlhf import stages
from rlhf.registry import register
from rlhf.schedules.common import RunState
from rlhf.schedules.loop import generate, learn, run_steps, timed


def train_step(c, cfg, state: RunState) -> tuple[dict[str, float], stages.Scored]:
    """One synchronous RL step: generate, score, prepare, update, push weights. Returns its metrics."""
    times: dict[str, float] = {}
    with timed(times, "step"):
        scored = generate(c, cfg, times)
        metrics = learn(c, cfg, scored, state, times)
        with timed(times, "weight_sync"):
            metrics |= stages.push_weights(c)
    return metrics | scored.metrics | times, scored


@register("schedule", "sync")
def run(c, cfg, sizes, tracker, state: RunState, stop) -> RunState:
    """Train from ``state.step`` to `train.num_steps`, one synchronous step at a time."""
    return run_steps(c, cfg, sizes, tracker, state, stop, lambda step: train_step(c, cfg, state))
