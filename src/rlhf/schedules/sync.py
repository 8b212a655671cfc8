"""The synchronous schedule: every stage of a step runs in turn, generation always on the newest weights."""

from __future__ import annotations

from rlhf.parts import PartConfig
from rlhf.registry import register
from rlhf.run.state import RunState
from rlhf.schedules.loop import Loop, collect_next, one_step, push_to_generator, run_steps
from rlhf.step.collector import Collector
from rlhf.step.learner import Learner


def train_step(collector: Collector, learner: Learner, guard):
    """One synchronous RL step: collect, update (``guard``: the run's `NonFiniteGuard`), push weights. Returns
    (metrics, scored)."""
    return one_step(lambda times: collect_next(collector, times), learner, guard, lambda: push_to_generator(collector, learner))


@register("schedule", "sync")
def run(collector: Collector, learner: Learner, loop: Loop) -> RunState:
    """Train from ``loop.state.step`` to `train.num_steps`, one synchronous step at a time."""
    return run_steps(collector, learner, loop, lambda step: train_step(collector, learner, loop.state.guard))


run.config = PartConfig  # no keys beyond `schedule.name`
