"""The synchronous schedule: every stage of a step runs in turn, generation always on the newest weights."""

from __future__ import annotations

from rlhf.parts import PartConfig
from rlhf.registry import register
from rlhf.run.state import RunState
from rlhf.schedules.loop import collect_next, one_step, push_to_generator, run_steps


def train_step(c, state: RunState):
    """One synchronous RL step: collect, update, push weights. Returns (metrics, scored)."""
    return one_step(lambda times: collect_next(c, times), c.learner, state.guard, lambda: push_to_generator(c))


@register("schedule", "sync")
def run(c, cfg, sizes, tracker, state: RunState, stop) -> RunState:
    """Train from ``state.step`` to `train.num_steps`, one synchronous step at a time."""
    return run_steps(c, cfg, sizes, tracker, state, stop, lambda step: train_step(c, state))


run.config = PartConfig  # no keys beyond `schedule.name`
