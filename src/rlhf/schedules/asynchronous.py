"""The asynchronous schedule: a background thread generates batch k+1 while the trainer trains on batch k.

Versions count optimiser updates pushed to the generator: version v is the policy after v training steps.
Step k trains the policy at version k-1 on a batch generated at version v; its staleness is k-1-v. The producer
starts batch j only once the generator holds version >= j-1-`schedule.max_staleness`, so no trained batch is ever
staler than that bound (0 makes the schedule on-policy again, with no overlap). The trainer publishes its weights
without waiting; they load between generate calls, so each batch comes from exactly one version.

`algorithm.rollout_correction` corrects for the gap (stale weights, and vLLM's numerics against the trainer's), e.g.
token_tis weights each token's loss by min(pi_trainer / pi_generator, `algorithm.rollout_correction.clip`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from rlhf.checks.weight_sync import VerifiedGenerator
from rlhf.errors import require
from rlhf.generators.base import SamplingParams
from rlhf.parts import PartConfig
from rlhf.registry import register
from rlhf.errors import StopNow
from rlhf.run.state import RunState
from rlhf.schedules.loop import Loop, one_step, push_to_generator, run_steps, timed
from rlhf.step.collector import Collector, collecting_state
from rlhf.step.learner import Learner
from rlhf.step.scored import Scored
from rlhf.trajectory import Trajectories

log = logging.getLogger("rlhf")

THREAD_NAME = "rlhf-rollout-producer"


@dataclass
class AsyncConfig(PartConfig):
    """Generation of batch k+1 overlaps training on batch k (a background thread; separate engines on Ray). Pair it
    with algorithm/rollout_correction=token_tis (or seq_tis, icepop, geo_reject) for the generator/trainer gap."""

    max_staleness: int = 1  # policy versions a trained batch may lag the policy that trains on it (0 = on-policy, no overlap)

    def check(self, at: str) -> None:
        require(self.max_staleness >= 0, f"{at}.max_staleness={self.max_staleness} must be >= 0")


class VersionedGenerator:
    """A generator behind a lock that takes new weights between generate calls, never during one.

    The trainer *publishes* weights and goes on training; they are loaded before the next generate call (the
    producer's or an evaluation's), so the trainer never waits for a generation to finish. ``version`` is the
    policy version the generator holds, ``published`` the newest one handed over.
    """

    def __init__(self, inner, version: int) -> None:
        self.inner, self.version, self.published = inner, version, version
        self.lock = threading.RLock()  # held by a generate call and the weight load before it (and by evaluation)
        self.changed = threading.Condition()  # guards the published weights; notified on every publish
        self._pending = None

    def _load_pending(self) -> None:
        with self.changed:
            pending, version, self._pending = self._pending, self.published, None
        if pending is not None:
            # a verified generator names the step of the push it loads (a newer one may have superseded some)
            self.inner.update_weights(pending, **({"version": version} if isinstance(self.inner, VerifiedGenerator) else {}))
            self.version = version

    def current(self) -> int:
        """Load the newest published weights now; the version the generator then holds."""
        with self.lock:
            self._load_pending()
            return self.version

    def generate_versioned(self, prompts: list[list[int]], sampling: SamplingParams) -> tuple[Trajectories, int]:
        """Trajectories from the newest published weights, and their version (one version for the whole batch)."""
        with self.lock:
            self._load_pending()
            return self.inner.generate(prompts, sampling), self.version

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> Trajectories:
        return self.generate_versioned(prompts, sampling)[0]

    @contextmanager
    def pinned(self):
        """(generator, version) held on one version across several generate calls (a batch of multi-turn episodes)."""
        with self.lock:
            self._load_pending()
            yield self.inner, self.version

    def update_weights(self, state_dict, version: int | None = None) -> None:
        """Publish new weights as ``version`` (default: the next one); they load before the next generate call.

        A dict of tensors is copied first: the trainer updates its weights in place while the copy waits.
        (A Ray object reference is immutable and passes as is.)
        """
        if isinstance(state_dict, dict):
            state_dict = {name: tensor.detach().clone() for name, tensor in state_dict.items()}
        with self.changed:
            self._pending = state_dict
            self.published = self.published + 1 if version is None else version
            self.changed.notify_all()


@dataclass
class Produced:
    """One generated and scored batch, with what the trainer needs to know about it."""

    index: int  # the training step that will consume it
    scored: Scored  # with `versions`, the policy version that generated each row
    generation_s: float  # seconds spent generating and scoring it


class RolloutProducer:
    """Draws prompts, generates and scores batches ``first..last`` in a thread, at most `max_staleness` versions ahead.

    Records the prompt stream's position, the reward statistics and the global RNGs before each draw, so a
    checkpoint can rewind past batches drawn, sampled and scored ahead of training.
    """

    def __init__(self, collector: Collector, first: int, last: int, max_staleness: int) -> None:
        self.collector, self.generator = collector, collector.generator  # a Collector sampling through a VersionedGenerator
        self.first, self.last = first, last
        self.max_staleness = max_staleness
        self.ready: queue.Queue[Produced] = queue.Queue()
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self.positions: dict[int, dict] = {}  # batch index -> {"prompts", "rewards", "rng"} states before it was drawn
        self.positions_lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)

    def _wait_for_version(self, needed: int) -> bool:
        """Block until weights of version >= ``needed`` are published; False if asked to stop meanwhile."""
        with self.generator.changed:
            while self.generator.published < needed and not self.stopping.is_set():
                self.generator.changed.wait(timeout=0.1)
        return not self.stopping.is_set()

    def _run(self) -> None:
        try:
            for index in range(self.first, self.last + 1):
                if not self._wait_for_version(index - 1 - self.max_staleness):
                    return
                start = time.perf_counter()
                with self.positions_lock:
                    self.positions[index] = self._states()
                    examples = self.collector.prompts.next_batch(self.collector.prompts_per_step)
                scored, version = self._produce(examples)
                scored.versions = torch.full((len(scored.batch),), version, dtype=torch.long)
                self.ready.put(Produced(index, scored, time.perf_counter() - start))
        except BaseException as err:  # handed to the trainer thread, which re-raises it
            self.error = err

    def _produce(self, examples) -> tuple[Scored, int]:
        """One scored batch of ``examples`` (and of resampled prompts, `algorithm.filter_groups`) and the policy version
        that generated all of it."""
        with self.generator.pinned() as (generator, version):  # one version for every generate call of the batch
            return self.collector.collect(examples, draw=self._draw, generator=generator), version

    def _draw(self, size: int) -> list:
        """``size`` more prompts for a resampling round, drawn under the lock that records stream positions."""
        with self.positions_lock:
            return self.collector.prompts.next_batch(size)

    def _states(self) -> dict:
        # the RNGs too: the producer samples from the global generators while the trainer may be saving them
        return collecting_state(self.collector)

    def take(self, index: int) -> Produced:
        """The batch for training step ``index``; re-raises the producer's error if it failed.

        The first call starts the thread: the evaluation before the first step needs the generator anyway, and
        producing during it would only make it wait.
        """
        if self.thread.ident is None:
            self.thread.start()
        while True:
            try:
                produced = self.ready.get(timeout=0.1)
                break
            except queue.Empty:
                if not self.thread.is_alive() and self.ready.empty():
                    if self.error is not None:  # handed over once: a traceback holding the producer would hold the engine
                        error, self.error = self.error, None
                        raise error
                    raise RuntimeError(f"the rollout producer stopped before batch {index}")
        if produced.index != index:
            raise RuntimeError(f"rollout producer out of order: expected batch {index}, got {produced.index}")
        with self.positions_lock:  # what a checkpoint before this batch would have needed is no longer asked for
            for old in [i for i in self.positions if i < index]:
                del self.positions[old]
        return produced

    def states_after(self, step: int) -> dict:
        """The prompt stream's, reward statistics' and RNGs' states as if nothing after batch ``step`` had been drawn,
        sampled or scored (for a checkpoint or the epoch count after ``step``). Batches up to ``step`` are all scored
        by now, and the producer records a batch's states before touching any, so the lock makes this consistent."""
        with self.positions_lock:
            return self.positions.get(step + 1) or self._states()

    def close(self, timeout: float = 60.0) -> None:
        """Stop after the current generate call and join the thread."""
        stop_thread(self.stopping, self.thread, timeout, "the rollout producer")


def stop_thread(stopping: threading.Event, thread: threading.Thread, timeout: float, name: str) -> None:
    """Ask a producer ``thread`` to stop (``stopping``) and join it; warn, naming it, if it is still in a generate call
    after ``timeout`` seconds. A thread never started needs nothing."""
    stopping.set()
    if thread.ident is None:
        return
    thread.join(timeout)
    if thread.is_alive():
        log.warning("%s did not stop within %.0f s (a generate call is still running)", name, timeout)


@contextmanager
def producing(collector: Collector, version: int, make_producer):
    """A producer, ``make_producer(versioned)``, fills batches ahead of training inside the block, through
    ``versioned``: ``collector`` sampling with its generator behind a `VersionedGenerator` (holding policy
    ``version``); the run's Collector keeps its own generator. Afterwards the producer is stopped: waited for up to a
    minute, or not at all when a second stop signal ends the run (`StopNow`)."""
    versioned = collector.using(VersionedGenerator(collector.generator, version=version))
    wait = 60.0
    producer = make_producer(versioned)
    try:
        yield producer
    except StopNow:
        wait = 0.0  # stopping now
        raise
    finally:
        producer.close(timeout=wait)


def staleness_metrics(versions: torch.Tensor, trainer_version: int, bound: int) -> dict[str, float]:
    """Staleness of a trained batch: policy versions between each sample's generator and the trainer.

    Shape: versions (B,). Raises if any sample breaks the bound (a scheduling bug, never expected).
    """
    staleness = trainer_version - versions
    if staleness.min().item() < 0 or staleness.max().item() > bound:  # Python ints: any bound, however large
        raise RuntimeError(f"staleness {staleness.tolist()} outside [0, schedule.max_staleness={bound}]")
    return {
        "async/staleness_mean": staleness.float().mean().item(),
        "async/staleness_max": staleness.max().item(),
        "async/policy_version": float(trainer_version),
    }


def async_step(learner: Learner, loop: Loop, producer: RolloutProducer, step: int) -> tuple[dict[str, float], Scored]:
    """Train on the batch the producer made for ``step``, then push the weights as version ``step``."""
    return one_step(
        lambda times: take(producer, step, loop.schedule.max_staleness, times), learner, loop.state.guard,
        lambda: push_to_generator(producer.collector, learner, version=step),
    )


def take(producer: RolloutProducer, step: int, max_staleness: int, times: dict[str, float]) -> Scored:
    """The producer's batch for ``step`` (the wait in `time/wait_for_rollout`, its making in `time/generation`), with
    its staleness metrics."""
    with timed(times, "wait_for_rollout"):
        produced = producer.take(step)
    times["time/generation"] = produced.generation_s
    scored = produced.scored
    metrics = staleness_metrics(scored.versions, step - 1, max_staleness) | scored.metrics
    return replace(scored, metrics=metrics, trainer_version=step - 1)


@register("schedule", "async")
def run(collector: Collector, learner: Learner, loop: Loop) -> RunState:
    """Train from ``loop.state.step`` to `train.num_steps` with generation one batch (or up to max_staleness) ahead."""
    if loop.spec.cluster.backend == "local":
        log.warning("schedule=async on the local backend: generation and training share this process and its devices, "
                    "so they overlap little; cluster=ray_local (or ray) gives the generator its own devices")
    first, last, bound = loop.state.step + 1, loop.spec.train.num_steps, loop.schedule.max_staleness
    with producing(collector, loop.state.step, lambda versioned: RolloutProducer(versioned, first, last, bound)) as producer:
        return run_steps(
            producer.collector, learner, loop, lambda step: async_step(learner, loop, producer, step),
            stream_states=producer.states_after, guard=producer.generator.lock,
        )


run.config = AsyncConfig  # its keys (`schedule.*`)
run.overlaps_generation = True  # the producer generates while the policy trains
