"""The streaming schedule: the generator never waits for a batch to finish, and new weights reach it mid-response.

A producer thread keeps up to `schedule.in_flight` rows decoding at all times (`rlhf.step.inflight`): every
`schedule.chunk_tokens` tokens, finished rows leave, new prompts' groups join in their place, and weights the trainer
pushed since load, so an unfinished response goes on under the new policy. Every token records the version that
sampled it. A group is scored the moment its last row ends and waits, scored, for its step; the unscored-share
breaker (`reward.max_unscored_share`) reads the step's groups together, as the sync schedule reads its batch.

Groups are trained in the order they were drawn: step k trains the next `train.prompts_per_step` groups. The trainer
waits only for those; meanwhile the generator fills every free slot with the groups of later steps. The producer
starts a group only while it is at most `schedule.max_staleness` steps ahead of the weights it holds, so no trained
token is staler than that (0: on-policy). Drawing order fixes what each step trains, so a resumed run trains the
prompts an uninterrupted one would, in the same steps: a checkpoint records the groups drawn and not yet trained
(`PromptStream.replay`), and they are drawn again, from scratch, on resume.

Multi-turn environments (`env=...`) stream by the turn: the producer plays up to a step's groups at a time, and pushed
weights load before every turn's generate call, so an episode goes on under the newest policy from its next turn;
each action's tokens carry the version that sampled them. A turn itself is not interrupted.

Training in completion order instead (shortest responses first) would let a long response wait, or be dropped,
behind the bound: the trained batches would lean towards short responses.

The loss corrects each token against the logprob the generator sampled it with: `algorithm.rollout_correction`
(token_tis: decoupled PPO, the trainer's pre-update logprobs the proximal policy); `schedule.max_token_version_gap`
also masks tokens older than that many versions.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Optional


from rlhf.config.spec import RunSpec
from rlhf.errors import require
from rlhf.functional.staleness import fresh_enough, oldest_version, token_staleness, versions_per_row
from rlhf.parts import PartConfig
from rlhf.registry import register, resolve
from rlhf.run.state import RunState
from rlhf.schedules.asynchronous import THREAD_NAME, producing, staleness_metrics, stop_thread
from rlhf.schedules.loop import Loop, one_step, push_to_generator, run_steps, timed
from rlhf.step.collector import Collector, LostEpisodes, StreamFeed, past_share, unscored_error
from rlhf.step.learner import Learner
from rlhf.step.inflight import Group, advance, group_batch
from rlhf.step.scored import Scored, group_rows, join, take_groups
from rlhf.trajectory import with_groups

log = logging.getLogger("rlhf")


@dataclass
class StreamConfig(PartConfig):
    """Rows decode continuously; finished groups are scored as they end; pushed weights load between chunks of
    tokens, mid-response. Pair it with algorithm/rollout_correction=token_tis (or icepop, geo_reject)."""

    max_staleness: int = 1  # steps the generator may start groups ahead of the trainer: no trained token lags it by more versions (0 = on-policy)
    max_token_version_gap: Optional[int] = None  # tokens sampled more versions than this before the trainer leave the loss (counted); null = keep every token
    in_flight: Optional[int] = None  # rows decoding at once; null = (max_staleness + 1) steps' rows; at least one step's
    chunk_tokens: int = 8  # tokens each row samples between looks (finished rows leave, groups join, pushed weights load)

    def check(self, at: str) -> None:
        require(self.max_staleness >= 0, f"{at}.max_staleness={self.max_staleness} must be >= 0")
        require(
            self.max_token_version_gap is None or self.max_token_version_gap >= 0,
            f"{at}.max_token_version_gap={self.max_token_version_gap} must be >= 0 (or null to keep every token)",
        )
        require(self.in_flight is None or self.in_flight >= 1, f"{at}.in_flight={self.in_flight} must be >= 1 (or null)")
        require(self.chunk_tokens >= 1, f"{at}.chunk_tokens={self.chunk_tokens} must be >= 1")


def rows_in_flight(config: StreamConfig, rows_per_step: int) -> int:
    """`schedule.in_flight`, null resolved: the rows of every step the generator may work on ahead."""
    return config.in_flight if config.in_flight is not None else (config.max_staleness + 1) * rows_per_step


def check_run(config: StreamConfig, spec: RunSpec) -> None:
    """Its fit with the run (``spec``), before any model loads: the generator continues responses, the buffer holds a
    step, the algorithm needs nothing per batch, and the loss bounds what staleness does to it."""
    algorithm, env = spec.algorithm_keys, spec.env
    samples, prompts = algorithm.num_samples_per_prompt, spec.train.prompts_per_step
    require(
        env is not None or callable(getattr(spec.generator.obj, "continue_rows", None)),
        f"schedule=stream loads new weights mid-response, but generator={spec.generator.name} does not say it continues "
        "a response from its sampled prefix (a `continue_rows` method; `rlhf.generators.continuous.continue_by_generate` "
        "makes one from `generate`): use generator=hf or vllm, or schedule=async",
    )
    rows = prompts * samples
    require(
        config.in_flight is None or config.in_flight >= rows,
        f"schedule.in_flight={config.in_flight} rows cannot hold one step's groups (train.prompts_per_step={prompts} x "
        f"algorithm.num_samples_per_prompt={samples} = {rows} rows): raise it to at least {rows}, or null",
    )
    if env is not None:
        maker = resolve("env", env.name, key="env.name")
        require(
            getattr(maker, "runner", None) is None,
            f"env={env.name} plays its episodes through an agent loop of its own, which tags each episode with the "
            "version it started under; schedule=stream loads new weights between turns: use schedule=async",
        )
    advantage, policy_loss = algorithm.advantage["name"], algorithm.policy_loss["name"]
    require(
        not spec.algorithm.needs_greedy_baseline,
        f"algorithm.advantage={advantage} scores a greedy response per batch, which schedule=stream has not: use "
        "schedule=async",
    )
    unclipped = policy_loss == "importance_sampling" and algorithm.rollout_correction is None
    require(
        not (unclipped and config.max_staleness > 0),
        "algorithm.policy_loss=importance_sampling weighs stale tokens by an unclipped ratio, which grows unstable with "
        "staleness (the sampler-trainer KL grows with it): add algorithm/rollout_correction=token_tis, use "
        "policy_loss=ppo_clip, or set schedule.max_staleness=0",
    )


def stream_warnings(spec: RunSpec) -> list[str]:
    """The warnings for a streaming run (``spec``) whose loss trains stale tokens as if the trainer had sampled them,
    or whose token gap drops what the staleness bound lets through. A pairwise algorithm (online DPO) takes no
    rollout correction."""
    warnings = []
    staleness, gap = spec.schedule.config.max_staleness, spec.schedule.config.max_token_version_gap
    if staleness > 0 and spec.algorithm.pairwise:
        warnings.append(
            f"schedule=stream with schedule.max_staleness={staleness} and a pairwise algorithm "
            f"(algorithm={spec.algorithm_keys.name}): its loss takes no rollout correction, so pairs sampled by older "
            "weights train as if the trainer had sampled them; set schedule.max_staleness=0 for on-policy pairs"
        )
    elif staleness > 0 and spec.algorithm_keys.rollout_correction is None:
        warnings.append(
            f"schedule=stream with schedule.max_staleness={staleness} and no algorithm.rollout_correction: tokens "
            "sampled by older weights train as if the trainer had sampled them (the clip bounds the update, not the "
            "staleness); add algorithm/rollout_correction=token_tis"
        )
    if gap is not None and gap < staleness:
        warnings.append(
            f"schedule.max_token_version_gap={gap} is below schedule.max_staleness={staleness}: the generator runs up "
            f"to {staleness} versions ahead, and every token more than {gap} behind leaves the loss, which can be most "
            f"of a step's tokens (async/stale_token_share); raise the gap to {staleness}, or lower max_staleness to {gap}"
        )
    return warnings


@dataclass
class Finished:
    """A group whose rows all ended, scored."""

    group: Group  # its rows as sampled
    scored: Scored  # the rows as one group (group id 0), scored
    unscored: dict[str, tuple[int, str]] = field(default_factory=dict)  # reward function -> (rows it left unscored, first reason)


class StreamingCollector:
    """The stream schedule's collector: keeps rows decoding, starts groups within the staleness bound, scores
    finished groups, and `collect` hands the trainer a step's groups in drawing order (with dynamic sampling, the
    ones with a signal). It draws, samples and scores through a `StreamFeed` of ``collector`` (the run's `Collector`
    sampling with a `VersionedGenerator`), which it keeps only for the loop (evaluation, weight pushes).

    ``base`` is the step the run starts from: the generator holds version ``base`` and groups are counted from it.
    One lock (``lock``) guards the groups, the prompt stream's position and the counters, so `states_after` is
    consistent while the thread draws.
    """

    def __init__(self, collector: Collector, config: StreamConfig, base: int, last: int) -> None:
        self.collector = collector  # for the loop: evaluation samples, and weights are pushed, through it
        self.feed = feed = StreamFeed(collector)  # all that the stream reads of it
        self.generator, self.config = feed.generator, config
        self.group_size, self.prompts_per_step = feed.group_size, feed.prompts_per_step
        self.in_flight = rows_in_flight(config, self.prompts_per_step * self.group_size)
        self.filtering = feed.max_resample_rounds is not None
        self.base, self.last = base, last
        self.lock = threading.Condition()
        self.drawn: list[Group] = []  # started, not yet trained, in drawing order
        self.ready: dict[int, Finished] = {}  # group index -> its scored rows
        self.next_index = 0  # groups drawn since the start
        self.consumed = {base: 0}  # step -> groups trained (or filtered) by the end of it
        self.last_taken: list[Group] = []  # the latest step's groups (a failed step's are drawn again on resume)
        self.wanted = 0  # groups the trainer waits for (beyond the bound when dynamic sampling passes groups over)
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self.loaded = base  # the policy version the generator held at the last chunk
        self.stats = {"decode_s": 0.0, "chunks": 0, "tokens": 0, "slots": 0, "loads": 0}  # since the last `take`
        self.lost: LostEpisodes | None = None  # multi-turn: the episodes lost since the last `take`, checked there
        self.thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)

    # -- the producer thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self.stopping.is_set():
                if self.feed.multi_turn:
                    self._play()
                    continue
                finished = self._chunk()
                for group in finished:
                    self._score(group)
        except BaseException as err:  # handed to the trainer thread, which re-raises it
            self.error = err
        finally:
            with self.lock:
                self.lock.notify_all()

    def _chunk(self) -> list[Group]:
        """Load pushed weights, start groups where there is room, sample one chunk; the groups that finished."""
        limit = self.feed.sampling.max_new_tokens
        with self.generator.pinned() as (generator, version):
            if version != self.loaded:
                self.stats["loads"] += 1
                self.loaded = version
            self._start_groups(version)
            with self.lock:
                rows = [row for group in self.drawn if group.index not in self.ready for row in group.rows if not row.done(limit)]
            if rows:
                start = time.perf_counter()
                self.stats["tokens"] += advance(generator, rows, self.feed.sampling, self.config.chunk_tokens, version)
                self.stats["decode_s"] += time.perf_counter() - start
                self.stats["chunks"] += 1
                self.stats["slots"] += len(rows)
        if not rows:  # every allowed group is out: wait for the next weights
            self._wait_for_publish(version)
            return []
        with self.lock:
            return [g for g in self.drawn if g.index not in self.ready and g.done(limit)]

    def _play(self) -> None:
        """Multi-turn: load pushed weights, start groups where there is room (one step's at most) and play their
        episodes to the end. Pushed weights load before every turn's generate call, so an episode goes on under the
        newest policy from its next turn and each turn is tagged with the version that sampled it. The groups are
        ready, scored by their environments, when the play returns; a group whose episodes all failed is ready empty."""
        with self.generator.lock:  # an evaluation waits for the play: the environments' loops serve one caller at a time
            version = self.generator.current()
            if version != self.loaded:
                self.stats["loads"] += 1
                self.loaded = version
            groups = self._start_groups(version, most=self.prompts_per_step)
            if groups:
                start = time.perf_counter()
                scored, lost = self.feed.play([g.example for g in groups])
                self.stats["decode_s"] += time.perf_counter() - start
        if not groups:  # every allowed group is out: wait for the next weights
            self._wait_for_publish(version)
            return
        self.stats["chunks"] += 1
        self.stats["slots"] += len(groups) * self.group_size
        self.stats["tokens"] += int(scored.batch.loss_mask.sum())
        rows = dict(zip(scored.tasks, group_rows(scored.batch.group_id)))
        with self.lock:
            self.lost = lost if self.lost is None else self.lost.plus(lost)
            for n, group in enumerate(groups):
                self.ready[group.index] = Finished(group, take_groups(scored, [rows[n]] if n in rows else []))
            self.lock.notify_all()

    def _start_groups(self, version: int, most: int | None = None) -> list[Group]:
        """Draw prompts into free row slots while the staleness bound and the run's last step allow (and at most
        ``most`` groups); the groups drawn."""
        limit = self.feed.sampling.max_new_tokens
        started: list[Group] = []
        with self.lock:
            busy = sum(not row.done(limit) for g in self.drawn if g.index not in self.ready for row in g.rows)
            allowed = self._allowed(version)
            while self.next_index < allowed and busy + self.group_size <= self.in_flight and len(started) != most:
                example = self.feed.draw()
                started.append(Group.of(self.next_index, example, self.group_size))
                self.next_index += 1
                busy += self.group_size
            self.drawn += started
        return started

    def _allowed(self, version: int) -> int:
        """Groups that may be drawn by now: those trained by the end of step ``version`` plus ``max_staleness + 1``
        steps' worth (so each is trained by step version + max_staleness + 1, on weights at most max_staleness
        versions newer), never past what the last step needs (unless filtering discards groups)."""
        known = self.consumed.get(version, max(self.consumed.values()))
        allowed = known + (self.config.max_staleness + 1) * self.prompts_per_step
        if not self.filtering:
            allowed = min(allowed, (self.last - self.base) * self.prompts_per_step)
        return max(allowed, self.wanted)

    def _wait_for_publish(self, version: int) -> None:
        """Until new weights are published, the trainer asks for more groups, or the run stops."""
        with self.generator.changed:
            while self.generator.published <= version and not self.stopping.is_set() and self._allowed(version) <= self.next_index:
                self.generator.changed.wait(timeout=0.1)

    def _score(self, group: Group) -> None:
        """Score a finished group (outside the generator's lock: a reward model or user function may take a while)."""
        batch = group_batch(group, self.feed.pad_id)
        scored, unscored = self.feed.score_group(group.example, with_groups(batch, len(group.rows)))
        with self.lock:
            self.ready[group.index] = Finished(group, scored, unscored)
            self.lock.notify_all()

    # -- the trainer's side ---------------------------------------------------------------------------------------
    def take(self, step: int) -> tuple[list[Finished], dict[str, float]]:
        """The groups step ``step`` trains, in drawing order, and the producer's figures since the last take.

        With dynamic sampling (`algorithm.filter_groups`) groups without a signal are passed over, up to
        `algorithm.max_resample_rounds` steps' worth more; then the step trains the ones it kept (or, kept none,
        the last `train.prompts_per_step` as they are). Re-raises the producer's error."""
        if self.thread.ident is None:
            self.thread.start()
        if self.error is not None:  # even with the step's groups ready: the generator is broken (a failed weight load)
            raise self.take_error()
        first = self.consumed[step - 1]
        want = self.prompts_per_step
        most = want * (1 + self.feed.max_resample_rounds) if self.filtering else want
        taken: list[Finished] = []
        kept: list[Finished] = []
        with self.lock:
            while len(kept) < want and len(taken) < most:
                index = first + len(taken)
                self.wanted = max(self.wanted, index + 1)
                while index not in self.ready:
                    if self.error is not None or not self.thread.is_alive():
                        raise self.take_error() or RuntimeError(f"the streaming producer stopped before group {index}")
                    self.lock.wait(timeout=0.1)
                finished = self.ready[index]
                taken.append(finished)
                if not self.filtering or self._has_signal(finished):
                    kept.append(finished)
            self.consumed[step] = first + len(taken)
            done = {f.group.index for f in taken}
            self.last_taken = [f.group for f in taken]
            self.drawn = [g for g in self.drawn if g.index not in done]
            for index in done:
                del self.ready[index]
            stats, self.stats = self.stats, dict.fromkeys(self.stats, 0.0)
            lost, self.lost = self.lost, None
        if self.filtering:
            stats |= {"kept": len(kept), "taken": len(taken)}
        stats |= self.unscored_in(taken)
        if lost is not None:  # the breaker over the step's plays together, as the sync path reads its batch
            lost.check(kept=any(len(f.scored.batch) for f in taken))
        return (kept if kept else taken[-want:]), stats

    def unscored_in(self, taken: list[Finished]) -> dict[str, float]:
        """The circuit breaker over a step's groups together (those dynamic sampling passed over included), as the
        sync path reads its batch: past `reward.max_unscored_share` of their rows unscored, or no row left,
        `RewardUnavailable`. Otherwise the step's counts for `collect`: rows drawn, unscored, groups dropped."""
        rows = sum(len(f.group.rows) for f in taken)
        unscored = int(sum(f.scored.metrics.get("reward/unscored_rows", 0.0) for f in taken))
        limit = self.feed.max_unscored_share
        if unscored and (past_share(unscored, rows, limit) or not any(len(f.scored.batch) for f in taken)):
            functions: dict[str, tuple[int, str]] = {}
            for f in taken:
                for name, (n, reason) in f.unscored.items():
                    count, first = functions.get(name, (0, reason))
                    functions[name] = (count + n, first)
            raise unscored_error(unscored, rows, limit, functions)
        dropped = sum(f.scored.metrics.get("reward/unscored_dropped_groups", 0.0) for f in taken)
        return {"rows": rows, "unscored_rows": unscored, "unscored_dropped_groups": dropped}

    def take_error(self) -> BaseException | None:
        """The producer's error, handed over once: the producer lets go of it, or the error's traceback (which holds
        the frames that hold the producer) would keep the generator's engine alive in a reference cycle."""
        error, self.error = self.error, None
        return error

    def _has_signal(self, finished: Finished) -> bool:
        return self.feed.has_signal(finished.scored)

    def states_after(self, step: int) -> dict:
        """The prompt stream's, reward statistics' and RNGs' states for a checkpoint after ``step``: the stream as
        drawn so far, with every group drawn and not trained by then to be drawn again first (`PromptStream.replay`)."""
        with self.lock:
            end = self.consumed.get(step, 0)
            groups = sorted(self.last_taken + self.drawn, key=lambda g: g.index)
            pending = self.feed.prompt_ids([g.example.text for g in groups if g.index >= end])
            state = self.feed.state()
            state["prompts"]["replay"] = pending + state["prompts"].get("replay", [])
            return state

    def collect(self, step: int, times: dict[str, float]) -> Scored:
        """Step ``step``'s batch (`take`, waited for in `time/wait_for_rollout`; `step_batch`) with the producer's
        figures since the last step."""
        with timed(times, "wait_for_rollout"):
            finished, stats = self.take(step)
        scored = step_batch(finished, self.feed.pad_id, step - 1, self.config)
        metrics = scored.metrics | producer_metrics(stats, self.in_flight)
        if stats["unscored_rows"]:  # the step's counts, not the groups' mean
            metrics |= {"reward/unscored_share": stats["unscored_rows"] / stats["rows"],
                        "reward/unscored_rows": float(stats["unscored_rows"]),
                        "reward/unscored_dropped_groups": float(stats["unscored_dropped_groups"])}
        return replace(scored, metrics=metrics)

    def close(self, timeout: float = 60.0) -> None:
        """Stop after the current chunk and join the thread."""
        stop_thread(self.stopping, self.thread, timeout, "the streaming producer")


def step_batch(finished: list[Finished], pad_id: int, trainer_version: int, config: StreamConfig) -> Scored:
    """The step's groups as one batch: tokens older than `max_token_version_gap` versions out of the loss mask, each
    row's version its oldest token's, and the `async/*` figures."""
    scored = join([f.scored for f in finished], pad_id)
    batch = scored.batch
    versions, mask = batch.extras["token_versions"], batch.loss_mask
    kept = fresh_enough(versions, mask, trainer_version, config.max_token_version_gap)
    real = mask.bool()
    staleness = token_staleness(versions, trainer_version)[real].float()
    metrics = mean_metrics([f.scored.metrics for f in finished]) | {
        "async/token_staleness_mean": staleness.mean().item() if staleness.numel() else 0.0,
        "async/token_staleness_max": staleness.max().item() if staleness.numel() else 0.0,
        "async/versions_per_row": versions_per_row(versions, mask).float().mean().item(),
        "async/stale_token_share": 1.0 - kept.sum().item() / max(mask.sum().item(), 1.0),
    }
    row_versions = oldest_version(versions, mask)
    metrics |= staleness_metrics(row_versions, trainer_version, config.max_staleness)
    return replace(scored, batch=replace(batch, loss_mask=kept), metrics=metrics, versions=row_versions,
                   trainer_version=trainer_version)


def mean_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """The groups' reward metrics averaged (groups are the same size); keys some groups lack are averaged over the rest."""
    keys = {key for part in parts for key in part}
    return {key: sum(p[key] for p in parts if key in p) / sum(key in p for p in parts) for key in keys}


def producer_metrics(stats: dict[str, float], in_flight: int) -> dict[str, float]:
    """What the generator did since the last step: `time/generation` (seconds decoding), `stream/occupancy` (rows
    decoding per chunk / `schedule.in_flight`), `stream/tokens_per_s`, `stream/weight_loads`."""
    chunks = max(stats["chunks"], 1)
    metrics = {
        "time/generation": stats["decode_s"],
        "stream/occupancy": stats["slots"] / chunks / in_flight,
        "stream/tokens_per_s": stats["tokens"] / max(stats["decode_s"], 1e-9),
        "stream/weight_loads": float(stats["loads"]),
    }
    if "taken" in stats:
        metrics |= {"dynamic_sampling/kept_share": stats["kept"] / max(stats["taken"], 1),
                    "dynamic_sampling/kept_groups": float(stats["kept"])}
    return metrics


def stream_step(learner: Learner, loop: Loop, streaming: StreamingCollector, step: int) -> tuple[dict[str, float], Scored]:
    """Train on step ``step``'s groups, then publish the weights as version ``step``."""
    return one_step(
        lambda times: streaming.collect(step, times), learner, loop.state.guard,
        lambda: push_to_generator(streaming.collector, learner, version=step),
    )


@register("schedule", "stream")
def run(collector: Collector, learner: Learner, loop: Loop) -> RunState:
    """Train from ``loop.state.step`` to `train.num_steps` while the generator streams rows."""
    for warning in stream_warnings(loop.spec):
        log.warning(warning)
    base, last = loop.state.step, loop.spec.train.num_steps
    make = lambda versioned: StreamingCollector(versioned, loop.schedule, base, last)
    with producing(collector, base, make) as streaming:
        state = run_steps(
            streaming.collector, learner, loop, lambda step: stream_step(learner, loop, streaming, step),
            stream_states=streaming.states_after, guard=streaming.generator.lock,
        )
    error = streaming.take_error()
    if error is not None:  # after the last step's groups (a weight load that failed its check): still a failure
        raise error
    return state


run.config = StreamConfig  # its keys (`schedule.*`)
run.overlaps_generation = True  # the producer generates while the policy trains
run.check_run = check_run  # its fit with the generator, the batch and the algorithm
