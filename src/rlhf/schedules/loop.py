"""The loop every schedule shares: run a step, log, sample texts, evaluate and checkpoint on schedule, stop on a signal.

`one_step` is the RL step, written once: the Collector's batch, the Learner's update, the weights pushed. A schedule
sees a `Collector`, a `Learner` and the `Loop` (the run's settings, tracker, state and stop signals), and supplies
only ``step_fn(step) -> (metrics, scored)``, built on `one_step` with its own collect, push and what wraps the
update; what happens between steps is the same for all.
"""

from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import torch

from rlhf.config.spec import RunSpec
from rlhf.errors import StopRequested, user_exits_named
from rlhf.run import checkpoint
from rlhf.data.prompts import epochs_done
from rlhf.distributed.remote import WorkerError
from rlhf.data.prompts import PromptExample
from rlhf.run.state import RunState
from rlhf.seeding import rng_states, set_rng_states
from rlhf.step.collector import Collector
from rlhf.step.learner import Learner
from rlhf.step.scored import Scored, group_rows

log = logging.getLogger("rlhf")


@contextmanager
def timed(times: dict[str, float], name: str):
    """Adds the seconds the block took to ``times['time/<name>']``."""
    start = time.perf_counter()
    yield
    times[f"time/{name}"] = times.get(f"time/{name}", 0.0) + time.perf_counter() - start


@dataclass
class Loop:
    """What happens between steps, the same for every schedule: the resolved run (``spec``: its typed `train`, `eval`,
    `logging`, `checkpoint` and `seed`, the schedule's own keys, the derived sizes), where it logs and saves, the
    held-out prompts it evaluates on, its state (``state``, updated step by step) and the stop signals."""

    spec: RunSpec  # the resolved run (`rlhf.config.validate`)
    tracker: Any  # Tracker: metrics, sample texts, the checkpoint folder
    eval_examples: list[PromptExample]
    state: RunState
    stop: Any  # StopSignals: `.requested` names the signal once one arrived

    @property
    def schedule(self):
        """The schedule's own keys (`schedule.*`), typed by its config class."""
        return self.spec.schedule.config

    @property
    def sizes(self):
        """The run's derived sizes (`DerivedSizes`: samples per step, eval_every, ...)."""
        return self.spec.sizes


def run_eval(collector: Collector, learner: Learner, loop: Loop, step: int) -> dict[str, float]:
    """Evaluate on a private RNG stream (seeded by seed and step), so evaluating never changes training."""
    spec, tracker = loop.spec, loop.tracker
    devices = list(range(torch.cuda.device_count())) if learner.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(spec.seed * 1_000_003 + step)
        metrics, results = collector.evaluate(loop.eval_examples, spec.eval)
    if metrics:
        tracker.log(step, metrics)
        log.info("eval @ step %d: %s", step, ", ".join(f"{k} {v:.3f}" for k, v in metrics.items()))
    n = spec.logging.num_sample_texts
    for mode, scored in results.items():
        tracker.samples(step, scored.prompts[:n], scored.responses[:n], scored.scores[:n].tolist(), tag=f"eval_samples/{mode}")
        if spec.eval.save_generations:
            tracker.generations(step, mode, scored)
    return metrics


def run_steps(
    collector: Collector, learner: Learner, loop: Loop, step_fn: Callable[[int], tuple[dict, Scored]],
    stream_states: Callable[[int], dict] | None = None, guard=None,
) -> RunState:
    """Train from ``loop.state.step`` to `train.num_steps` with ``step_fn``, evaluating and checkpointing on schedule.

    ``collector`` is the one the schedule collects with (evaluation samples through it too). Schedules that draw,
    sample and score prompts ahead of training pass ``stream_states(step)``: the Collector's state and the global
    RNGs' as of the end of ``step`` (`collecting_state`: {"prompts", "rewards", "rng"}), for checkpoints and the
    epoch count; and ``guard``, a lock that evaluation holds so its seeded sampling never interleaves with theirs.
    Stops early, after saving a checkpoint, when ``loop.stop.requested`` is set (SIGTERM/SIGINT). Agents the step
    waits on then are abandoned at once (`StopRequested`): the last complete step is saved instead of the one they
    played.

    A step that raises ends the run, but first the last complete step is saved (`save_on_failure`) when the trained
    models are known to be as it left them: the error came before step k's update began (generation, scoring: a
    user reward function or environment), so step k-1 is saved with the Collector's and the Learner's states and
    the RNGs put back as step k found them (`StepStart`); or it came after step k returned (logging, evaluation),
    so step k is saved as a regular checkpoint would have. An error during the update (the optimiser may have
    stepped for part of the batch), in a checkpoint save itself, or from a Ray worker saves nothing.
    """
    state, stop, root = loop.state, loop.stop, loop.tracker.checkpoint_root
    last, every = loop.spec.train.num_steps, loop.spec.checkpoint.every
    guard = guard if guard is not None else nullcontext()
    keep_last = loop.spec.checkpoint.keep_last
    save = lambda step, streams: checkpoint.save(collector, learner, root, step, state.to_dict(), keep_last, streams)
    if state.step == 0:
        try:
            with guard, user_exits_named():  # the first evaluation runs the user's reward functions before any step
                state.first_eval = run_eval(collector, learner, loop, 0)
        except StopRequested as stopped:  # agents abandoned at a stop signal: nothing to save yet
            log.warning("%s before the first step: stopped, nothing to save; continue with resume=auto", stopped)
            state.preempted = True
            return state
    for step in range(state.step + 1, last + 1):
        before = StepStart.record(collector, learner)
        updates = learner.updates  # an update begun in this step may have changed the models
        try:
            with user_exits_named():
                metrics, scored = step_fn(step)
        except Exception as err:  # a sys.exit in user code arrives as a UserExit; a second stop signal passes
            if learner.updates != updates:
                log.error("step %d failed during its update: the models are mid-update, so nothing more is saved", step)
                raise
            before.rewind(learner)
            streams = stream_states(step - 1) if stream_states is not None else before.collected
            if isinstance(err, StopRequested):  # agents abandoned at a stop signal, before the update
                save_interrupted(save, root, step - 1, streams, err)
                state.preempted = True
                break
            save_on_failure(save, root, step - 1, streams, err)
            raise
        state.step = step
        states = stream_states(step) if stream_states is not None else None
        try:
            with user_exits_named():
                record_step(collector, learner, loop, metrics, scored, states, guard)
                checkpoint.check_room(root, step)  # a disk filling up stops the run while it can save
        except StopRequested:  # the evaluation's agents were abandoned; the step is complete and saved below
            pass
        except Exception as err:
            save_on_failure(save, root, step, states, err)
            raise
        if stop.requested or (every and step % every == 0) or (every and step == last):
            save(step, states)
            if not stop.requested and step < last:  # the save took its room: is there one more?
                checkpoint.check_room(root, step, saved=True)
        if stop.requested:
            log.warning("%s received: stopped after step %d with a checkpoint; continue with resume=auto", stop.requested, step)
            state.preempted = True
            break
    return state


def record_step(
    collector: Collector, learner: Learner, loop: Loop, metrics: dict, scored: Scored, states: dict | None, guard,
) -> None:
    """Log step ``loop.state.step``'s metrics and sample texts, and evaluate when the schedule says so."""
    spec, tracker, state = loop.spec, loop.tracker, loop.state
    step, train = state.step, spec.train
    metrics |= {
        "episode": step * loop.sizes.samples_per_step,
        "epoch": epochs_done(states["prompts"]) if states is not None else collector.prompts.epochs_done,
        "lr": learner.policy.lr,
        "train/skipped_steps": state.guard.total,
        "time/total": tracker.elapsed(),
    }
    tracker.log(step, metrics)
    tracker.prompts(step, collector.prompts.ids_of(trained_prompts(scored)))
    tracker.console(step, train.num_steps, metrics)  # the bar every step, a line every logging.log_every
    if spec.logging.sample_every and step % spec.logging.sample_every == 0:
        n = spec.logging.num_sample_texts
        tracker.samples(step, scored.prompts[:n], scored.responses[:n], scored.scores[:n].tolist())
    eval_every = loop.sizes.eval_every
    if (eval_every and step % eval_every == 0) or step == train.num_steps:
        with guard:
            state.last_eval = run_eval(collector, learner, loop, step)


def trained_prompts(scored: Scored) -> list[str]:
    """The prompt of each group ``scored`` trains on, in batch order (one per prompt, not per sample)."""
    return [scored.prompts[rows[0]] for rows in group_rows(scored.batch.group_id)]


@dataclass
class StepStart:
    """What a step changes before its update begins, as the previous step left it: the Collector's state (the
    prompt stream, the reward statistics), the Learner's (the algorithm's state, the mini-batch order) and every
    global RNG."""

    collected: dict
    trained: dict
    rng: dict

    @classmethod
    def record(cls, collector: Collector, learner: Learner) -> "StepStart":
        return cls(collected=collector.state_dict(), trained=learner.state_dict(), rng=rng_states())

    def rewind(self, learner: Learner) -> None:
        """Put back the Learner's state and the RNGs (the Collector's state passes to the save instead)."""
        learner.load_state_dict(self.trained)
        set_rng_states(self.rng)


def save_interrupted(save, root, step: int, streams: dict | None, stopped: StopRequested) -> None:
    """A stop signal abandoned the step after ``step``: ``save(step, streams)`` (unless saved already, or none is
    done)."""
    if step == 0:
        log.warning("%s in the first step: stopped, nothing to save; continue with resume=auto", stopped)
        return
    saved = [p for p in checkpoint.complete_checkpoints(root) if p.name == f"step_{step:08d}"]
    path = saved[0] if saved else save(step, streams)
    log.warning("%s: stopped with the last complete step %d saved in %s; continue with resume=auto", stopped, step, path)


def save_on_failure(save, root, step: int, streams: dict | None, err: Exception) -> None:
    """After ``err`` ended the run, ``save(step, streams)`` (the models as step ``step`` left them) and say where.

    Never raises: a failed emergency save is logged and the original error goes on."""
    if isinstance(err, WorkerError):
        log.error("no checkpoint saved on failure: after a worker failure the trained models may not be intact")
        return
    if step == 0:
        log.error("no checkpoint saved on failure: the run failed in its first step, before any step completed")
        return
    saved = [p for p in checkpoint.complete_checkpoints(root) if p.name == f"step_{step:08d}"]
    if saved:
        log.error("the last complete step %d is saved in %s; fix the error, then continue with resume=auto", step, saved[0])
        return
    try:
        path = save(step, streams)
    except Exception as save_err:
        log.error(
            "the checkpoint of the last complete step %d could not be saved either: %s: %s",
            step, type(save_err).__name__, save_err,
        )
        return
    log.error(
        "the run failed (%s: %s); saved the last complete step %d to %s; fix the error, then continue with resume=auto",
        type(err).__name__, err, step, path,
    )


def one_step(
    collect: Callable[[dict[str, float]], Scored], learner, guard, push: Callable[[], dict[str, float]],
    around_update: Callable[[dict[str, float], dict[str, float]], AbstractContextManager] | None = None,
) -> tuple[dict[str, float], Scored]:
    """One RL step: ``collect(times)`` a scored batch, `Learner.update` on it (inside ``around_update(metrics,
    times)`` when given: the hybrid schedule's sleep and wake), then ``push()`` the new weights to the generator.
    Returns the step's metrics (the update's, the batch's, `time/*`) and the batch."""
    times: dict[str, float] = {}
    metrics: dict[str, float] = {}
    with timed(times, "step"):
        scored = collect(times)
        with around_update(metrics, times) if around_update is not None else nullcontext():
            metrics |= learner.update(scored, guard)
        with timed(times, "weight_sync"):
            metrics |= push()
    return metrics | scored.metrics | times, scored


def collect_next(collector: Collector, times: dict[str, float]) -> Scored:
    """The step's batch from ``collector``, drawn, sampled and scored now (sync and hybrid schedules)."""
    with timed(times, "generation"):
        return collector.collect()


def push_to_generator(collector: Collector, learner: Learner, version: int | None = None) -> dict[str, float]:
    """The Learner's new weights into the Collector's generator (as ``version``: the async schedules')."""
    return collector.load_weights(learner.weights(), version)
