"""The Collector: prompts or tasks in, a scored batch out.

It owns what a step needs before any training: the prompt stream, the generator, the reward functions and, for
multi-turn runs, the environment. `collect` draws the step's prompts, samples a group of responses per prompt (or
plays a group of episodes per task), scores them, keeps only groups with a signal when asked (dynamic sampling,
`rlhf.step.scored`) and adds the greedy baseline an advantage such as ReMax needs. `evaluate` runs the same sampling
and scoring on held-out prompts. Everything the update needs arrives in one `Scored`.
"""

from __future__ import annotations

import logging
import copy
import time
import zlib
from dataclasses import dataclass, replace
from typing import Callable

import torch

from rlhf.data.prompts import PromptExample, PromptStream
from rlhf.envs.loop import EpisodeRunner, play_retrying
from rlhf.envs.rows import episode_metrics, episode_rows, transcript
from rlhf.generators.base import SamplingParams
from rlhf.models.dtypes import tensor_bytes
from rlhf.rewards.failure import RewardUnavailable
from rlhf.seeding import rng_states
from rlhf.step.scored import Scored, group_rows, groups_with_signal, join, kept_groups, round_metrics, take_groups
from rlhf.trajectory import Trajectories, with_groups

log = logging.getLogger("rlhf")

ENV_METRICS = ("success_rate", "first_turn_success_rate", "later_turn_success_rate", "episode_return", "num_turns_per_episode",
               "failed_episodes")


class EpisodesFailed(RuntimeError):
    """Too many of a batch's episodes failed (`env.max_failed_share`), or all of them."""


@dataclass(frozen=True)
class LostEpisodes:
    """The episodes a play lost, for the circuit breaker: ``failed`` of ``total`` failed (after ``retries`` more
    tries each), ``short`` more went with groups left under ``min_group``; ``first`` is the first failure's error."""

    env: str  # `env.name`
    share: float  # `env.max_failed_share`
    retries: int  # `env.failed_retries`
    min_group: int  # the smallest group kept
    total: int = 0  # episodes played (a retried one once)
    failed: int = 0  # failed after their retries
    short: int = 0  # lost with their group
    first: str | None = None  # the first failure's error

    def plus(self, other: LostEpisodes) -> LostEpisodes:
        """Both plays' counts together (the first error the earlier one's)."""
        return replace(self, total=self.total + other.total, failed=self.failed + other.failed,
                       short=self.short + other.short, first=self.first if self.first is not None else other.first)

    def check(self, training: bool = True, kept: bool | None = None) -> None:
        """`EpisodesFailed` when more than `env.max_failed_share` failed (training only: an evaluation has no limit),
        or episodes failed and none was ``kept`` (default: none of these plays' episodes was)."""
        kept = self.failed + self.short < self.total if kept is None else kept
        if past_share(self.failed, self.total, self.share if training else None) or (self.total and not kept):
            raise EpisodesFailed(breaker_message(
                self.failed, self.total, f"episodes failed in environment {self.env!r} after env.failed_retries={self.retries}",
                "env.max_failed_share", self.share,
                f"{self.short} more went with groups left under {self.min_group}; the first error: {self.first}",
                "the environment's (or the agent's)", "it",
            ))


class Collector:
    """Prompts (or tasks) -> generated, scored groups, ready for the `Learner`.

    ``sampling`` is the training sampling (`generator.*`); ``samples_per_prompt`` responses (or episodes) form a group.
    ``max_resample_rounds`` >= 0 turns on dynamic sampling (`algorithm.filter_groups`), None leaves it off;
    ``filter_on`` (score or accuracy) is what must differ within a kept group.
    ``greedy_baseline``: also score one greedy response per prompt (ReMax's baseline).
    ``max_unscored_share``: `reward.max_unscored_share` (`drop_unscored`).
    """

    def __init__(
        self, generator, tokenizer, rewards, prompts: PromptStream, sampling: SamplingParams, *, prompts_per_step: int,
        samples_per_prompt: int, max_resample_rounds: int | None = None, greedy_baseline: bool = False,
        env: EpisodeRunner | None = None, filter_on: str = "score", min_group: int = 1, max_unscored_share: float = 0.25,
    ) -> None:
        self.generator, self.tokenizer, self.rewards, self.prompts = generator, tokenizer, rewards, prompts
        self.sampling, self.env = sampling, env
        self.prompts_per_step, self.samples_per_prompt = prompts_per_step, samples_per_prompt
        self.max_resample_rounds, self.greedy_baseline = max_resample_rounds, greedy_baseline
        self.filter_on = filter_on  # dynamic sampling keeps groups whose `score`s differ, or whose verdicts (`accuracy`)
        self.min_group = min_group  # the fewest episodes a group keeps when others failed (the estimator's samples per prompt)
        self.max_unscored_share = max_unscored_share  # past this share of a training batch's rows unscored, the run stops
        self.weights_version = 0  # weight pushes through `load_weights` (the async schedule's version when it gives one)

    def using(self, generator) -> "Collector":
        """This Collector sampling with ``generator`` instead (the async schedules' versioned one): the same prompt
        stream, rewards and environment; the run's own Collector keeps its generator."""
        other = copy.copy(self)
        other.generator = generator
        return other

    def state_dict(self) -> dict:
        """What collecting changes, to rewind a failed step or save a checkpoint: the prompt stream's position
        ({"prompts"}) and the reward statistics ({"rewards"})."""
        return {"prompts": self.prompts.state_dict(), "rewards": self.rewards.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Put back what `state_dict` recorded (a state without "prompts" leaves the stream where it is)."""
        if "prompts" in state:
            self.prompts.load_state_dict(state["prompts"])
        self.rewards.load_state_dict(state["rewards"])

    @property
    def pad_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    def collect(
        self, examples: list[PromptExample] | None = None, draw: Callable[[int], list[PromptExample]] | None = None,
        generator=None, sampling: SamplingParams | None = None,
    ) -> Scored:
        """One step's scored groups: for `train.prompts_per_step` prompts from the stream (or ``examples``),
        ``samples_per_prompt`` responses each, scored; with dynamic sampling only groups with a signal, more prompts
        drawn with ``draw(n)`` (default: from the stream) for each resampling round. ``generator`` (default: the
        run's) generates every round, ``sampling`` (default: the training sampling) sets its limits."""
        draw = draw if draw is not None else self.prompts.next_batch
        examples = examples if examples is not None else draw(self.prompts_per_step)
        sampling = sampling if sampling is not None else self.sampling
        if self.max_resample_rounds is None:
            return self.sample(examples, self.samples_per_prompt, sampling, generator=generator)
        return self.filtered(examples, draw, sampling, generator)

    def filtered(self, examples: list[PromptExample], draw, sampling: SamplingParams, generator) -> Scored:
        """`collect` under dynamic sampling (`rlhf.step.scored`): rounds of ``len(examples)`` prompts until that many
        groups have a signal or `algorithm.max_resample_rounds` extra rounds are spent."""
        wanted = len(examples)
        rounds: list[Scored] = []
        kept: list[Scored] = []
        num_kept = generated = 0
        while True:
            scored = self.sample(examples, self.samples_per_prompt, sampling, generator=generator)
            rounds.append(scored)
            groups = group_rows(scored.batch.group_id)
            signal = groups_with_signal(self.verdicts(scored), groups)
            generated += len(groups)
            kept.append(take_groups(scored, signal[: wanted - num_kept]))
            num_kept += len(signal)
            if num_kept >= wanted or len(rounds) > self.max_resample_rounds:
                break
            examples = draw(wanted)
        trained = min(num_kept, wanted)
        if trained < wanted:
            log.warning(
                "dynamic sampling: %d of %d groups had a signal after %d generate calls; training on %s. Raise "
                "algorithm.max_resample_rounds=%d (or train.prompts_per_step) to fill the step",
                trained, wanted, len(rounds), f"those {trained}" if trained else "the last batch as is (all advantages 0)",
                self.max_resample_rounds,
            )
        result = join(kept, self.pad_id) if trained else rounds[-1]
        metrics = round_metrics(rounds) | {
            "dynamic_sampling/rounds": float(len(rounds)),
            "dynamic_sampling/kept_share": num_kept / max(generated, 1),
            "dynamic_sampling/kept_groups": float(trained),
        }
        return replace(result, metrics=metrics)

    def verdicts(self, scored: Scored):
        """What must differ within a group for dynamic sampling to keep it: the verifier's verdicts
        (`filter_on=accuracy`) or the scores. Shape: (B,)."""
        return scored.batch.extras["correct"] if self.filter_on == "accuracy" else scored.scores

    def sample(
        self, examples: list[PromptExample], samples_per_prompt: int, sampling: SamplingParams, training: bool = True,
        generator=None,
    ) -> Scored:
        """``samples_per_prompt`` responses per prompt (grouped in a row), decoded and scored; with an environment,
        that many episodes of each task (`play`). When training with ``greedy_baseline``, one greedy response per
        prompt is generated and scored too (`with_greedy_baseline`). ``generator`` defaults to the run's."""
        generator = generator if generator is not None else self.generator
        if self.env is not None:
            return self.play(examples, samples_per_prompt, sampling, generator, training)
        repeated = [ex for ex in examples for _ in range(samples_per_prompt)]
        batch = generator.generate([list(ex.token_ids) for ex in repeated], sampling)
        scored, failures = self.score(repeated, with_groups(batch, samples_per_prompt), training)
        scored.metrics |= getattr(generator, "last_metrics", {})  # the hf generator's shared prefill counts
        if training and self.greedy_baseline:
            scored = self.with_greedy_baseline(examples, scored, sampling, generator)
        return self.drop_unscored(scored, self.max_unscored_share if training else None, failures)

    def with_greedy_baseline(self, examples: list[PromptExample], scored: Scored, sampling: SamplingParams, generator) -> Scored:
        """``scored`` with each row's baseline, the score of its prompt's greedy response (ReMax), as
        ``batch.extras['baseline_scores']`` (B,); its cost is logged as `time/greedy_baseline`."""
        start = time.perf_counter()
        greedy = generator.generate([list(ex.token_ids) for ex in examples], replace(sampling, greedy=True))
        baseline = self.score(examples, with_groups(greedy, 1), training=False)[0].scores
        per_row = baseline.repeat_interleave(len(scored.batch) // len(examples))
        batch = replace(scored.batch, extras=dict(scored.batch.extras, baseline_scores=per_row))
        metrics = scored.metrics | {
            "objective/greedy_baseline_scores": baseline.mean().item(),
            "time/greedy_baseline": time.perf_counter() - start,
        }
        return replace(scored, batch=batch, metrics=metrics)

    def play(
        self, examples: list[PromptExample], group_size: int, sampling: SamplingParams, generator=None, training: bool = True,
    ) -> Scored:
        """``group_size`` episodes of each task, as trajectory rows scored by the environment (`play_batch`). A training
        batch in which more than `env.max_failed_share` of the episodes failed, or any batch that kept no episode,
        raises `EpisodesFailed`, naming the environment and the first error (`LostEpisodes.check`)."""
        scored, lost = self.play_batch(examples, group_size, sampling, generator)
        lost.check(training)
        return scored

    def play_batch(
        self, examples: list[PromptExample], group_size: int, sampling: SamplingParams, generator=None,
    ) -> tuple[Scored, LostEpisodes]:
        """(the played groups as trajectory rows scored by the environment, the episodes lost), the share unchecked; a
        play that kept no episode raises `EpisodesFailed`.

        A failed episode is played again, fresh, up to `env.failed_retries` times (`play_retrying`); one that still
        failed leaves its group as an unscored row does (`kept_groups`: a group left smaller than the estimator's
        samples per prompt goes too), and is counted.
        """
        runner = self.env
        generator = generator if generator is not None else self.generator
        tasks = examples if runner.maker.uses_dataset else [None] * len(examples)
        seeds = [task_seed(ex, runner.maker.uses_dataset, self.prompts.seed) for ex in examples]
        if hasattr(runner, "version"):  # an endpoint tags each reply with the policy version that sampled it
            runner.version = self.weights_version
        retries = runner.cfg.failed_retries
        episodes, retried, runner_metrics = play_retrying(runner, generator, tasks, seeds, group_size, sampling, retries)
        lost = [ep.failed for ep in episodes]
        groups = group_rows(torch.tensor([ep.group for ep in episodes]))
        kept = kept_groups(groups, lost, self.min_group)
        failed = sum(lost)
        short = len(episodes) - failed - sum(map(len, kept))
        first = next((ep.error for ep in episodes if ep.failed), None)
        losses = LostEpisodes(runner.cfg.name, runner.cfg.max_failed_share, retries, min(self.min_group, group_size), len(episodes), failed, short,
                              None if first is None else str(first))
        if not kept:  # no episode to build rows from: stops whatever the share (a stream's play is a step's groups)
            losses.check(training=False)
        played = [replace(episodes[row], group=n) for n, rows in enumerate(kept) for row in rows]
        batch = episode_rows(played, runner.cfg.reward_reduce, self.pad_id)
        metrics = episode_metrics(played, failed) | runner_metrics | {
            "env/failed_share": failed / len(episodes) if episodes else 0.0, "env/retried_episodes": float(retried),
            "env/short_group_episodes": float(short), "env/failed_dropped_groups": float(len(groups) - len(kept)),
        }
        tasks = [episodes[rows[0]].group for rows in kept]
        scored = Scored(batch, [ep.turns[0].observation for ep in played], [transcript(ep) for ep in played], metrics, tasks=tasks)
        return scored, losses

    def score(
        self, repeated: list[PromptExample], batch: Trajectories, training: bool = True
    ) -> tuple[Scored, dict[str, tuple[int, str]]]:
        """Decode and score trajectories of the prompts ``repeated`` (one row each): the scored batch, and each reward
        function that left rows unscored -> (its rows, its first reason) (`RowScores.failures`)."""
        responses = self.tokenizer.batch_decode(batch.window_ids, skip_special_tokens=True)
        prompts = [ex.text for ex in repeated]
        scores, metrics, correct, unscored, failures = self.rewards.score_rows(
            prompts, responses, [ex.ground_truth for ex in repeated], batch, training
        )
        if self.filter_on == "accuracy" and correct is not None:  # dynamic sampling filters on the verdicts
            batch = replace(batch, extras=dict(batch.extras, correct=correct.float()))
        if unscored.any():  # `drop_unscored` takes these rows out
            batch = replace(batch, extras=dict(batch.extras, unscored=unscored))
        return Scored(replace(batch, scores=scores).to("cpu"), prompts, responses, metrics), failures

    def drop_unscored(self, scored: Scored, limit: float | None, failures: dict[str, tuple[int, str]]) -> Scored:
        """``scored`` without the rows no reward could score (`rlhf.rewards.failure`): they leave the loss and their
        groups' statistics, as if never drawn, and a group left with fewer rows than the estimator needs (its samples
        per prompt, at most the group's size) goes too (`reward/unscored_rows`, `reward/unscored_dropped_groups`).
        Past ``limit`` (`reward.max_unscored_share`; None: no limit, evaluation) of the rows unscored, or none left,
        `RewardUnavailable` names the functions and their first reasons (``failures``: `Collector.score`'s)."""
        unscored = scored.batch.extras.get("unscored")
        if unscored is None:
            return scored
        extras = {key: value for key, value in scored.batch.extras.items() if key != "unscored"}
        scored = replace(scored, batch=replace(scored.batch, extras=extras))
        groups = group_rows(scored.batch.group_id)
        kept = kept_groups(groups, unscored.tolist(), self.min_group)
        if past_share(int(unscored.sum()), len(unscored), limit) or (limit is not None and not kept):
            raise unscored_error(int(unscored.sum()), len(unscored), limit, failures)
        metrics = scored.metrics | {"reward/unscored_rows": float(unscored.sum()),
                                    "reward/unscored_dropped_groups": float(len(groups) - len(kept))}
        return replace(take_groups(scored, kept), metrics=metrics)

    def evaluate(
        self, examples: list[PromptExample], eval_cfg, sampling: SamplingParams | None = None
    ) -> tuple[dict[str, float], dict[str, Scored]]:
        """Metrics and scored completions on ``examples`` (at most `eval.max_prompts`): greedy (`eval.greedy`) and
        `eval.num_samples` sampled at the training temperature (or with ``sampling``'s limits)."""
        if eval_cfg.max_prompts is not None:
            examples = examples[: eval_cfg.max_prompts]
        sampling = sampling if sampling is not None else self.sampling
        metrics: dict[str, float] = {}
        results: dict[str, Scored] = {}
        runs = [("greedy", 1, True)] if eval_cfg.greedy else []
        if eval_cfg.num_samples > 0:
            runs.append(("sampled", eval_cfg.num_samples, False))
        for name, n, greedy in runs:
            try:
                scored = self.sample(examples, n, replace(sampling, greedy=greedy), training=False)
            except EpisodesFailed as error:  # an evaluation that lost every episode is reported, not the run's end
                log.warning("evaluation (%s) measured nothing: %s", name, error)
                metrics[f"eval/{name}_failed_episodes"] = float(len(examples) * n)
                continue
            if "reward/unscored_rows" in scored.metrics:
                metrics[f"eval/{name}_unscored"] = scored.metrics["reward/unscored_rows"]
            if not len(scored.batch):
                log.warning("evaluation (%s) measured nothing: no response could be scored", name)
                continue
            metrics[f"eval/{name}_scores"] = scored.scores.mean().item()
            if "objective/verifiable_correct_rate" in scored.metrics:
                metrics[f"eval/{name}_correct_rate"] = scored.metrics["objective/verifiable_correct_rate"]
            for key in ENV_METRICS:
                if f"env/{key}" in scored.metrics:
                    metrics[f"eval/{name}_{key}"] = scored.metrics[f"env/{key}"]
            if "reward/model" in scored.metrics:
                metrics[f"eval/{name}_reward_model"] = scored.metrics["reward/model"]
            metrics[f"eval/{name}_sequence_lengths"] = scored.batch.action_lengths.mean().item()
            results[name] = scored
        return metrics, results

    def load_weights(self, weights, version: int | None = None) -> dict[str, float]:
        """Hand new policy weights (from `Learner.weights`) to the generator, as ``version`` when given (the async
        schedule's). Returns `perf/weight_sync_mb`, the push's size, when the weights pass through this process (the
        Ray backend sends them through the object store instead)."""
        self.generator.update_weights(weights, **({} if version is None else {"version": version}))
        self.weights_version = version if version is not None else self.weights_version + 1
        if not isinstance(weights, dict):
            return {}
        return {"perf/weight_sync_mb": tensor_bytes(weights.values()) / 2**20}


def unscored_error(unscored: int, rows: int, limit: float, functions: dict[str, tuple[int, str]]) -> RewardUnavailable:
    """The breaker's error for ``unscored`` of ``rows`` rows past ``limit`` (`reward.max_unscored_share`), naming
    each failing function with its count and first reason (``functions``: `RowScores.failures`' shape)."""
    failing = "; ".join(f"reward function {name!r}: {n} rows, first reason: {reason}" for name, (n, reason) in functions.items())
    return RewardUnavailable(breaker_message(
        unscored, rows, "rows could not be scored", "reward.max_unscored_share", limit, failing, "the scorer's", "the service",
    ))


def breaker_message(lost: int, total: int, what: str, key: str, limit: float | None, details: str, whose: str, fix: str) -> str:
    """The message of an error that stops the run when ``lost`` of a batch's ``total`` rows or episodes were lost
    (``what`` happened to them) past the share ``key`` = ``limit`` allows (`past_share`), or none was left: the
    ``details`` (each failing function, the first error), whose failure it is (``whose``, never the policy's), what to
    ``fix``, and how to go on from the last complete step."""
    return (
        f"{lost} of the batch's {total} {what}, past {key}={limit} ({details}); the failure is {whose}, not the "
        f"policy's: fix {fix} (or raise {key}), then continue with resume=auto"
    )


def past_share(failed: int, total: int, limit: float | None) -> bool:
    """The circuit breaker's rule: whether ``failed`` of a training batch's ``total`` samples (unscored rows, failed
    episodes) is more than the share ``limit`` allows (None: no limit, as in evaluation)."""
    return limit is not None and failed > limit * total


def task_seed(example: PromptExample, uses_dataset: bool, run_seed: int) -> int:
    """An episode's reset seed: the task instance itself for environments without a dataset (its ground truth),
    else fixed by the prompt text and the run's seed."""
    if not uses_dataset:
        return int(example.ground_truth)
    return (zlib.crc32(example.text.encode()) + 7919 * run_seed) % 2**31


def collecting_state(collector: Collector) -> dict:
    """The Collector's state and every global RNG's ({"prompts", "rewards", "rng"}): what a schedule that collects
    ahead of training records before each draw, and saves for the step it trained last."""
    return collector.state_dict() | {"rng": rng_states()}


class StreamFeed:
    """What a collector that keeps rows in flight (schedule=stream's `StreamingCollector`) takes from the Collector,
    and nothing else: the generator and the training sampling, the group sizes, prompts drawn one at a time, a
    finished group scored, a group of episodes played, dynamic sampling's rule, and the state a checkpoint records."""

    def __init__(self, collector: Collector) -> None:
        self._collector = collector
        self.generator = collector.generator  # samples the rows (a `VersionedGenerator` under schedule=stream)
        self.sampling = collector.sampling  # the training sampling; a row ends at its max_new_tokens
        self.group_size = collector.samples_per_prompt  # rows (or episodes) per prompt
        self.prompts_per_step = collector.prompts_per_step  # groups one step trains
        self.max_resample_rounds = collector.max_resample_rounds  # dynamic sampling's extra steps' worth; None: off
        self.multi_turn = collector.env is not None  # episodes played by an environment, not rows decoded
        self.pad_id = collector.pad_id
        self.max_unscored_share = collector.max_unscored_share  # the breaker's limit over a step's rows

    def draw(self) -> PromptExample:
        """The prompt stream's next prompt."""
        return self._collector.prompts.next_batch(1)[0]

    def prompt_ids(self, texts: list[str]) -> list[int]:
        """Each prompt text's index in the training split (`PromptStream.ids_of`), to draw again on resume."""
        return self._collector.prompts.ids_of(texts)

    def score_group(self, example: PromptExample, batch: Trajectories) -> tuple[Scored, dict[str, tuple[int, str]]]:
        """One finished group's rows of ``example`` (group id 0) scored, its unscored rows dropped with no limit (the
        stream collector applies `reward.max_unscored_share` to a step's groups together); and what each reward
        function left unscored (function -> (rows, first reason))."""
        scored, failures = self._collector.score([example] * len(batch), batch)
        return self._collector.drop_unscored(scored, None, failures), failures

    def play(self, examples: list[PromptExample]) -> tuple[Scored, LostEpisodes]:
        """``group_size`` episodes of each task, played with the training sampling and scored, and the episodes lost,
        unchecked (`Collector.play_batch`): the stream checks a step's plays together."""
        return self._collector.play_batch(examples, self.group_size, self.sampling)

    def has_signal(self, scored: Scored) -> bool:
        """Whether one group's rows differ in what dynamic sampling looks at (`Collector.verdicts`)."""
        rows = [list(range(len(scored.batch)))]
        return len(scored.batch) > 0 and bool(groups_with_signal(self._collector.verdicts(scored), rows))

    def state(self) -> dict:
        """`collecting_state`: the prompt stream's, the reward statistics' and the global RNGs' states now."""
        return collecting_state(self._collector)
