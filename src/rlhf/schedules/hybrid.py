"""The hybrid-engine schedule: generator and trainer share devices and take turns.

Each step generates with the generator awake, puts it to sleep (vLLM sleep mode on GPU frees its weights and KV
cache; elsewhere the weights are freed) so training has the memory, then wakes it with the new weights. With
`schedule.offload_optimizer`, the optimiser state waits on the CPU while the generator runs.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from rlhf.errors import ConfigError
from rlhf.parts import PartConfig
from rlhf.registry import register
from rlhf.run.state import RunState
from rlhf.schedules.loop import Loop, collect_next, one_step, run_steps, timed
from rlhf.step.collector import Collector
from rlhf.step.learner import Learner

MIB = float(1 << 20)


@dataclass
class HybridConfig(PartConfig):
    """Generator and trainer share the devices and take turns: the generator sleeps while training. With
    generator=vllm set generator.enable_sleep=true; on Ray colocate the generator with the policy."""

    offload_optimizer: bool = False  # move the optimiser state off the accelerator while the generator runs


@contextmanager
def generator_asleep(collector: Collector, learner: Learner, offload: bool, metrics: dict[str, float], times: dict[str, float]):
    """The update's surroundings: the generator asleep (what it freed in ``metrics``), the optimiser state on the
    device (``offload``: back on the CPU afterwards), the allocator's cached blocks released for the waking
    generator."""
    with timed(times, "generator_sleep"):
        collector.generator.sleep()
    metrics["memory/generator_freed_mb"] = collector.generator.freed_bytes / MIB
    if offload:
        with timed(times, "optimizer_reload"):
            for _, model in learner.trained:
                model.reload_optimizer()
    yield
    with timed(times, "optimizer_offload"):
        for _, model in learner.trained:
            if offload:
                model.offload_optimizer()
            model.release_cached_memory()  # cached blocks of activations (and offloaded state), for the waking generator


def wake(collector: Collector, learner: Learner) -> dict[str, float]:
    """Wake the generator with the policy's whole new weights (asleep, it holds none), through the Collector, which
    counts the push (the policy version an agent endpoint reports) and its size (`perf/weight_sync_mb`)."""
    return collector.load_weights(learner.policy.state_dict())


def hybrid_step(collector: Collector, learner: Learner, loop: Loop):
    """Generate (optimiser state offloaded if asked), sleep the generator, train, wake it with the new weights."""
    offload = loop.schedule.offload_optimizer
    return one_step(
        lambda times: collect_next(collector, times), learner, loop.state.guard, lambda: wake(collector, learner),
        around_update=lambda metrics, times: generator_asleep(collector, learner, offload, metrics, times),
    )


@register("schedule", "hybrid")
def run(collector: Collector, learner: Learner, loop: Loop) -> RunState:
    """Train from ``loop.state.step`` to `train.num_steps`, generator and trainer taking turns on the same devices."""
    offload = loop.schedule.offload_optimizer
    if not callable(getattr(collector.generator, "sleep", None)):
        raise ConfigError(
            f"schedule=hybrid needs a generator that can sleep; generator.name={loop.spec.generator.name} has no sleep() "
            f"(see rlhf.generators.base.SleepingGenerator), use schedule=sync"
        )
    if offload:
        for _, model in learner.trained:
            model.offload_optimizer()  # a resumed run's state starts on the device
            model.release_cached_memory()
    try:
        return run_steps(collector, learner, loop, lambda step: hybrid_step(collector, learner, loop))
    finally:
        if offload:
            for _, model in learner.trained:
                model.reload_optimizer()  # checkpoints and exports expect the state where training keeps it


run.config = HybridConfig  # its keys (`schedule.*`)
run.offloads_while_generating = lambda config: config.offload_optimizer  # what the memory plan asks
run.sleeps_generator = True  # the generator sleeps while the policy trains, on the same devices
