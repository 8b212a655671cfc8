"""Driver-side handles of the Ray workers: each role looks to the schedules like its local component.

Every remote call waits at most `cluster.timeout_s` (worker start-up and model load: `cluster.setup_timeout_s`).
While it waits, the driver pings the ranks it waits on every few seconds; the ping runs in a thread of its own in
the worker (the `heartbeat` concurrency group), so a busy rank answers and a frozen one (stopped, swapping) does not.
A rank that raises, dies, does not answer, or leaves its pings unanswered for `cluster.heartbeat_timeout_s` fails
the run at once with a `WorkerError` naming the role, the rank and the error; the other ranks are not waited for.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from rlhf.generators.base import SamplingParams
from rlhf.trajectory import Trajectories, concat


class WorkerError(RuntimeError):
    """A Ray worker failed, died or timed out; the message names its role and rank."""


def even_slices(n: int, parts: int) -> list[slice]:
    """``parts`` contiguous slices covering range(n), sizes differing by at most one (some may be empty)."""
    sizes = [n // parts + (1 if i < n % parts else 0) for i in range(parts)]
    starts = [sum(sizes[:i]) for i in range(parts)]
    return [slice(start, start + size) for start, size in zip(starts, sizes)]


HEARTBEAT_GROUP = "heartbeat"  # the workers' concurrency group (one thread) in which `RoleWorker.heartbeat` runs
MAX_PING_INTERVAL_S = 5.0  # the driver pings at least this often while it waits (more often for short timeouts)


class Heartbeat:
    """The pings of one wait: ``silent_rank`` pings the ranks still working and names one whose ping has gone
    unanswered for ``timeout_s``. Only ranks in ``group.started`` (they have answered once) are judged: a rank still
    starting is the call's own timeout's business."""

    def __init__(self, group: ActorGroup, timeout_s: float) -> None:
        self.group, self.timeout_s = group, timeout_s
        self.interval_s = min(MAX_PING_INTERVAL_S, timeout_s / 3) if timeout_s > 0 else MAX_PING_INTERVAL_S
        self.pings: dict[int, tuple] = {}  # rank -> (its unanswered ping's ObjectRef, when it was sent)

    def silent_rank(self, ranks) -> int | None:
        """Ping each of ``ranks`` that has no ping outstanding; the first rank silent for ``timeout_s``, or None."""
        import ray

        if self.timeout_s <= 0:
            return None
        now = time.monotonic()
        for rank in ranks:
            if rank in self.pings:
                ref, sent = self.pings[rank]
                if not ray.wait([ref], timeout=0)[0]:
                    if rank in self.group.started and now - sent >= self.timeout_s:
                        return rank
                    continue
                self.group.started.add(rank)
            ping = self.group.actors[rank].heartbeat.options(concurrency_group=HEARTBEAT_GROUP).remote()
            self.pings[rank] = (ping, now)
        return None


class ActorGroup:
    """The Ray actors of one role, rank i at index i."""

    def __init__(self, role: str, actors: list, timeout_s: float, heartbeat_timeout_s: float = 0.0) -> None:
        self.role, self.actors, self.timeout_s = role, actors, timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s  # `cluster.heartbeat_timeout_s`; 0 = no heartbeat
        self.started: set[int] = set()  # ranks that have answered a call or a ping: their silence means a freeze

    def __len__(self) -> int:
        return len(self.actors)

    def wait(self, refs: dict, what: str, timeout_s: float | None = None) -> dict:
        """{rank: result} of ``refs`` ({rank: ObjectRef}); raises WorkerError on the first failure or the timeout.
        ``timeout_s`` overrides the group's `cluster.timeout_s` (start-up and set-up pass `cluster.setup_timeout_s`)."""
        import ray

        pending = {ref: rank for rank, ref in refs.items()}
        results = {}
        limit, key = (self.timeout_s, "cluster.timeout_s") if timeout_s is None else (timeout_s, "cluster.setup_timeout_s")
        deadline = time.monotonic() + limit
        heartbeat = Heartbeat(self, self.heartbeat_timeout_s)
        while pending:
            left = deadline - time.monotonic()
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, min(left, heartbeat.interval_s)))
            if not ready and time.monotonic() >= deadline:
                raise WorkerError(
                    f"{self.role} rank(s) {sorted(pending.values())} did not finish {what} within {limit:g} s ({key})"
                )
            if not ready and (silent := heartbeat.silent_rank(sorted(pending.values()))) is not None:
                raise WorkerError(
                    f"{self.role} rank {silent}: no heartbeat for {self.heartbeat_timeout_s:g} s during {what} "
                    "(cluster.heartbeat_timeout_s): its process is frozen (stopped, swapping or stuck), not just busy"
                )
            for ref in ready:
                rank = pending.pop(ref)
                results[rank] = self.result(ref, rank, what)
        return results

    def result(self, ref, rank: int, what: str):
        """``ref``'s value (rank ``rank``'s answer to ``what``), or a WorkerError saying how the rank failed."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        try:
            value = ray.get(ref)
        except RayTaskError as err:
            raise WorkerError(f"{self.role} rank {rank} failed in {what}: {type(err.cause).__name__}: {err.cause}\n{err}") from None
        except RayActorError as err:
            raise WorkerError(f"{self.role} rank {rank} died during {what} (its process exited or was killed): {err}") from None
        except GetTimeoutError:
            raise WorkerError(f"{self.role} rank {rank} timed out in {what}") from None
        self.started.add(rank)
        return value

    def call(self, method, per_rank: dict[int, tuple], what: str | None = None, put: bool = False) -> dict:
        """``component.method(*args)`` on each rank in ``per_rank`` ({rank: args}), or ``method(component, *args)``
        for a function; {rank: result}."""
        entry = "run_and_put" if put else "run"
        refs = {rank: getattr(self.actors[rank], entry).remote(method, *args) for rank, args in per_rank.items()}
        return self.wait(refs, what or getattr(method, "__name__", str(method)))

    def call_all(self, method: str, *args) -> list:
        """The same call on every rank; results by rank."""
        results = self.call(method, {rank: args for rank in range(len(self))})
        return [results[rank] for rank in range(len(self))]

    def call_split(self, method, n: int, part, *args, every_rank: bool) -> list:
        """``method(part(slice), *args)`` on consecutive near-even slices of ``n`` items, one per rank; results in
        order. ``every_rank`` keeps ranks with an empty slice in the call (ranks that share collectives)."""
        slices = even_slices(n, len(self))
        if not every_rank:
            slices = [sl for sl in slices if sl.stop > sl.start]
        results = self.call(method, {rank: (part(sl), *args) for rank, sl in enumerate(slices)})
        return [results[rank] for rank in range(len(slices))]


class RemoteTrainer:
    """A trained model (policy or critic) sharded over a group of training ranks, standing in for the local
    `TorchPolicy` / `TorchCritic`. Calls that split rows or mini-batch units over the ranks are defined here (rows
    divide evenly, so every rank runs the same number of forwards and collectives); `shares` runs a function of the
    Learner's on every rank's share; any other method runs on every rank (ranks share collectives) and answers with
    rank 0's result, so a method added to the trainer needs no copy here."""

    def __init__(self, group: ActorGroup) -> None:
        self.group = group

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)
        return lambda *args: self.group.call_all(method, *args)[0]

    def _split_rows(self, batch: Trajectories, method: str, *args) -> list:
        return self.group.call_split(method, len(batch), batch.select, *args, every_rank=True)

    def rollout_logprobs(self, batch: Trajectories, chunk: int, with_entropy: bool = False):
        parts = self._split_rows(batch, "rollout_logprobs", chunk, with_entropy)
        entropy = torch.cat([p[1] for p in parts]) if with_entropy else None
        return torch.cat([p[0] for p in parts]), entropy

    def base_logprobs(self, batch: Trajectories, chunk: int) -> torch.Tensor:
        """A LoRA policy's base-model logprobs (B, T), adapters off: the reference (`rlhf.models.lora.AdaptersOff`)."""
        return torch.cat(self._split_rows(batch, "base_logprobs", chunk))

    def rollout_values(self, batch: Trajectories, chunk: int) -> torch.Tensor:
        return torch.cat(self._split_rows(batch, "rollout_values", chunk))

    def shares(self, fn, mini: Trajectories, *args) -> list:
        """``fn(model, share, *args)`` on every rank, each with its near-even share of ``mini``'s units (consecutive,
        so rank order is row order); results by rank. The ranks run it in step: their collectives meet inside it."""
        units = torch.arange(mini.num_units)
        return self.group.call_split(fn, mini.num_units, lambda sl: mini.select_units(units[sl]), *args, every_rank=True)

    def state_dict(self, adapted_only: bool = False):
        """A Ray object reference to the weights the generators load (gathered from the shards by rank 0; with
        ``adapted_only``, a LoRA policy's adapted layers only: `TorchPolicy.state_dict`)."""
        results = self.group.call("state_dict", {rank: (adapted_only,) for rank in range(len(self.group))}, put=True)
        return results[0][0]

    @property
    def lr(self) -> float:
        return self.group.call("lr", {0: ()})[0]


class RemoteReplicas:
    """Independent replicas of an inference role (reference, teacher, reward): rows are split between them, no
    collectives."""

    def __init__(self, group: ActorGroup) -> None:
        self.group = group

    def rollout_logprobs(self, batch: Trajectories, chunk: int) -> torch.Tensor:
        """The reference's (or the teacher's) logprobs (B, T)."""
        return torch.cat(self.group.call_split("rollout_logprobs", len(batch), batch.select, chunk, every_rank=False))

    def raw_scores(self, batch: Trajectories) -> torch.Tensor:
        """The reward model's raw scores (B,)."""
        return torch.cat(self.group.call_split("raw_scores", len(batch), batch.select, every_rank=False))


class RemoteGenerator:
    """Generation engines, prompts split between them; weights arrive through the Ray object store."""

    def __init__(self, group: ActorGroup, pad_id: int) -> None:
        self.group, self.pad_id = group, pad_id

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> Trajectories:
        parts = self.group.call_split("generate", len(prompts), prompts.__getitem__, sampling, every_rank=False)
        return concat(parts, self.pad_id)

    def continue_rows(self, requests: list, sampling: SamplingParams, steps: int) -> list:
        """schedule=stream: each row to the engine of rank key % engines, so it finds its KV cache there again."""
        ranks = len(self.group)
        shares = {rank: [i for i, request in enumerate(requests) if request[0] % ranks == rank] for rank in range(ranks)}
        shares = {rank: rows for rank, rows in shares.items() if rows}
        results = self.group.call("continue_rows", {rank: ([requests[i] for i in rows], sampling, steps) for rank, rows in shares.items()})
        answers: list = [None] * len(requests)
        for rank, rows in shares.items():
            for i, answer in zip(rows, results[rank]):
                answers[i] = answer
        return answers

    def update_weights(self, state) -> None:
        """``state``: a weights dict or a Ray reference to one (each engine fetches it from the object store).
        A sleeping engine wakes with these weights."""
        self.group.call_all("update_weights", state)

    def sleep(self) -> None:
        self.group.call_all("sleep")

    @property
    def freed_bytes(self) -> int:
        """What the engines' last sleep released, summed."""
        return sum(self.group.call_all("freed_bytes"))

    @property
    def asleep(self) -> bool:
        """Whether any engine is asleep (holding no weights)."""
        return any(self.group.call_all("asleep"))

    def weight_fingerprints(self) -> list[dict[str, float]]:
        """Every engine's fingerprints of what it holds (`rlhf.checks.weight_sync`), rank by rank."""
        return [held for rank in self.group.call_all("weight_fingerprints") for held in rank]

    def expected_fingerprint(self, state) -> dict[str, float]:
        """What the engines should hold after ``state`` (a weights dict or a Ray reference to one): computed by rank
        0, where the weights land, so the driver never fetches them."""
        return self.group.call("expected_fingerprint", {0: (state,)})[0]
