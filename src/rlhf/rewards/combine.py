"""Several reward functions (and optionally a reward model) summed with weights, the overlong shaping, and the non-stop
penalty."""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Iterable
from typing import NamedTuple

import torch

from rlhf import registry
from rlhf.errors import ConfigError, RewardValueError
from rlhf.functional import overlong_penalty
from rlhf.rewards.failure import is_unscored, retry_failed
from rlhf.trajectory import Trajectories

# A score beyond this size is a bug, not a signal: squared in a variance it nears float32's overflow (3.4e38) long
# before 1e38, and no reward in this project's tasks comes within orders of magnitude of it.
MAX_ABS_SCORE = 1e6


def within_bound(number: float) -> bool:
    """Whether ``number`` is a score training may take: finite, with |number| <= MAX_ABS_SCORE."""
    return math.isfinite(number) and abs(number) <= MAX_ABS_SCORE


def as_score(value) -> float | None:
    """``value`` as a float when it is a real number (bool, int, float, a numpy or 0-d torch number), else None; a
    number past float's range (an int such as 10**400) as an infinity of its sign."""
    if value is None or isinstance(value, (str, bytes)):
        return None
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf
    except (TypeError, ValueError):
        return None


def score_problem(value, number: float | None) -> str | None:
    """Why a returned score ``value`` (``number``: `as_score`'s reading) cannot be trained on, or None."""
    if number is None:
        return "not a number"
    if math.isnan(number) or (math.isinf(number) and not isinstance(value, int)):  # an int is finite, if huge
        return "not finite"
    return "too large" if abs(number) > MAX_ABS_SCORE else None


def shown(value, width: int = 60) -> str:
    """``repr(value)``, cut to ``width`` characters for a message (10**400 has 401 digits)."""
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def score_entries(source: str, returned, rows: int) -> list:
    """``returned`` as a list of its ``rows`` entries (each a score, or `Unscored` where the function could not score
    the row; a tensor's values). RewardValueError naming ``source`` when it is a coroutine or not one entry per row;
    ValueError when it holds another number of entries."""
    if inspect.iscoroutine(returned):
        returned.close()  # never awaited: closed, so Python does not warn about it as well
        raise RewardValueError(
            f"{source} returned a coroutine: it is an `async def`, and reward functions are called, not awaited; make "
            f"it a plain `def` (run an event loop inside it if it needs one)"
        )
    if isinstance(returned, torch.Tensor):
        returned = returned.detach().cpu().reshape(-1).tolist()
    if isinstance(returned, (str, bytes, dict)) or not isinstance(returned, Iterable) or getattr(returned, "ndim", 1) == 0:
        raise RewardValueError(
            f"{source} returned {type(returned).__name__} {returned!r:.60}, not one score per response; return a list of "
            f"{rows} floats"
        )
    entries = list(returned)
    if len(entries) != rows:
        raise ValueError(f"{source} returned {len(entries)} scores for {rows} responses")
    return entries


def checked_scores(source: str, scores, rows: int) -> torch.Tensor:
    """``scores`` (one per row) as a float32 tensor, or RewardValueError naming ``source``, the row and the value
    when one is not a number, not finite, or larger than MAX_ABS_SCORE (`score_entries` checks it holds one per row).
    Shape: (rows,)."""
    entries = score_entries(source, scores, rows)
    values = [as_score(value) for value in entries]
    for row, (value, number) in enumerate(zip(entries, values)):
        what = score_problem(value, number)
        if what is not None:
            raise RewardValueError(
                f"{source} scored row {row} {shown(value)} ({type(value).__name__}): {what}; every score must be a finite "
                f"number with |score| <= {MAX_ABS_SCORE:g}, so the step stopped before training on it. Fix the "
                f"scoring (return a float per response, e.g. 0.0 where there is nothing to score)"
            )
    return torch.tensor(values, dtype=torch.float32)


def split_unscored(source: str, returned, rows: int) -> tuple[torch.Tensor, torch.Tensor, str | None]:
    """``returned`` (`score_entries`) with its `Unscored` entries split out: (scores (rows,), 0 where unscored and
    checked by `checked_scores` elsewhere; unscored (rows,) bool; the first unscored entry's reason, or None)."""
    entries = score_entries(source, returned, rows)
    unscored = [is_unscored(value) for value in entries]
    reason = next((value.reason for value, missed in zip(entries, unscored) if missed), None)
    scores = checked_scores(source, [0.0 if missed else value for value, missed in zip(entries, unscored)], rows)
    return scores, torch.tensor(unscored, dtype=torch.bool), reason


def function_label(name: str, fn) -> str:
    """How an error names a reward function: its config name and where it is defined."""
    where = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"
    return f"reward function {name!r}" + (f" ({where})" if where != name else "")


CALL_ARGS = ("prompts", "responses", "ground_truths")  # what every reward function is called with


def check_args(fn, args: dict, at: str, name: str) -> None:
    """ConfigError for an `args` key the function does not take: its keyword parameters are its keys. A function
    whose catch-all is ``**_`` ignores the rest, so a misspelt key would be lost; one with ``**kwargs`` takes any.
    A function may check its values too: ``fn.check_args(at, **args)`` runs when the reward set is built."""
    params = inspect.signature(fn).parameters.values()
    catch_all = [p.name for p in params if p.kind is inspect.Parameter.VAR_KEYWORD]
    if catch_all and catch_all[0] != "_":
        return
    known = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in CALL_ARGS]
    for key in args:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {at}.args.{close[0]}?" if close else "remove it"
            takes = f"takes {', '.join(known)}" if known else "takes no args"
            raise ConfigError(f"{at}.args.{key}: reward function {name} {takes}; {hint}")


class RowScores(NamedTuple):
    """What `RewardSet.score_rows` gives for a batch of B rows."""

    scores: torch.Tensor  # (B,) the weighted sum after the shaping and the non-stop penalty; 0 where unscored
    metrics: dict[str, float]  # reward/<name> per function, reward/unscored_share, objective/verifiable_correct_rate, ...
    correct: torch.Tensor | None  # (B,) bool: every verifier passed and the response stopped; None without a verifier
    unscored: torch.Tensor  # (B,) bool: a function could not score the row (after its retries)
    failures: dict[str, tuple[int, str]]  # each function that left rows unscored -> (its unscored rows, its first reason)


class RewardSet:
    """Scores responses with every configured function; see `rlhf.rewards.rules` for the call signature. ``cfg``: the
    `reward` section, typed (`RunSpec.reward`) or as a node."""

    def __init__(self, cfg, max_new_tokens: int | None = None) -> None:
        self.cfg = cfg
        self.max_new_tokens = max_new_tokens  # the response budget (generator.max_new_tokens) overlong shaping counts from
        if cfg.overlong_buffer_len is not None and max_new_tokens is None:
            raise ValueError("reward.overlong_buffer_len is set: RewardSet needs the response budget, max_new_tokens")
        self.model = None  # a RewardModelScorer, attached once models may load
        self.functions = []
        for i, fn_cfg in enumerate(cfg.functions):
            fn = registry.resolve("reward", fn_cfg.name, key=f"reward.functions[{i}].name")
            args = dict(fn_cfg.args)
            check_args(fn, args, f"reward.functions[{i}]", fn_cfg.name)
            weight = float(fn_cfg.weight)
            if not math.isfinite(weight):
                raise ConfigError(f"reward.functions[{i}].weight={weight} ({fn_cfg.name}) must be a finite number")
            if callable(check := getattr(fn, "check_args", None)):  # the function's own checks of its args
                check(f"reward.functions[{i}].args", **args)
            self.functions.append((fn_cfg.name, weight, args, fn))

    def check_truths(self, truths: list, origins: list[str]) -> None:
        """Each function that reads ground truths a way of its own (``fn.check_truths(truths, origins, **args)``, e.g.
        `math_verify`'s parser) checks the dataset's before any model loads; ConfigError naming where the row is
        (``origins``: each truth's, "p.jsonl line 101")."""
        for name, _, args, fn in self.functions:
            check = getattr(fn, "check_truths", None)
            if check is not None:
                check(truths, origins, **args)

    @property
    def verifiers(self) -> list[str]:
        """Names of the functions that check correctness against a ground truth."""
        return [name for name, _, _, fn in self.functions if getattr(fn, "is_verifier", False)]

    def source_names(self) -> str:
        """The scores summed into a reward, for error messages: `reward.functions` names and the reward model."""
        names = [f"{name} (weight {weight:g})" for name, weight, _, _ in self.functions]
        if self.model is not None:
            names.append(f"the reward model (weight {self.cfg.model_weight:g})")
        return "reward " + ", ".join(names)

    def state_dict(self) -> dict:
        """The reward model's running score statistics (normalisation must continue where it stopped)."""
        return {"model_moments": self.model.moments.state_dict()} if self.model is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.model is not None and "model_moments" in state:
            self.model.moments.load_state_dict(state["model_moments"])

    @property
    def has_verifier(self) -> bool:
        """Whether a verifier (a function that says right or wrong: arith_correct, math_verify, ...) is among the functions."""
        return any(getattr(fn, "is_verifier", False) for _, _, _, fn in self.functions)

    def score(
        self, prompts: list[str], responses: list[str], ground_truths: list, batch: Trajectories, training: bool = True
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """(scores (B,), metrics): `score_rows` without the per-row verdict (a row no function could score: 0)."""
        scored = self.score_rows(prompts, responses, ground_truths, batch, training)
        return scored.scores, scored.metrics

    def call(self, name: str, fn, args: dict, prompts: list[str], responses: list[str], ground_truths: list):
        """One function's scores of every row (B,), the rows it could not score (B,) bool, its returned list (for
        its metrics) and the first reason it gave for an unscored row. A row returned `Unscored` is asked again,
        alone with the others so returned, up to `reward.unscored_retries` more times (only those rows)."""
        returned = fn(prompts=prompts, responses=responses, ground_truths=ground_truths, **args)
        label = function_label(name, fn)
        values = score_entries(label, returned, len(responses))

        def again(rows: list[int]) -> list:
            retried = fn(prompts=[prompts[r] for r in rows], responses=[responses[r] for r in rows],
                         ground_truths=[ground_truths[r] for r in rows], **args)
            return score_entries(label, retried, len(rows))

        values, _ = retry_failed(values, is_unscored, again, self.cfg.unscored_retries)
        scores, unscored, reason = split_unscored(label, values, len(values))
        return scores, unscored, returned, reason

    def score_rows(
        self, prompts: list[str], responses: list[str], ground_truths: list, batch: Trajectories, training: bool = True
    ) -> RowScores:
        """The batch's `RowScores`: the weighted sum of every function and the model, plus the overlong shaping, then
        the non-stop penalty (which replaces the whole score of a response that never stopped); ``correct``: every
        verifier passed and the response stopped (None without a verifier); ``unscored``: a function could not score
        the row (`rlhf.rewards.failure.Unscored`, after its retries): its score is 0 here and means nothing, the
        Collector drops the row (`reward/unscored_share`, and `reward/<name>_unscored` per function); ``failures``:
        each such function's unscored rows and first reason, for the error that stops the run.

        ``training=False`` (evaluation) leaves the reward model's running statistics alone; the reward is the same.
        """
        stopped = batch.stopped.cpu()
        total = torch.zeros(len(responses))
        verified = torch.ones(len(responses), dtype=torch.bool)
        has_verifier = False
        metrics: dict[str, float] = {}
        unscored = torch.zeros(len(responses), dtype=torch.bool)
        failures: dict[str, tuple[int, str]] = {}
        for name, weight, args, fn in self.functions:
            values, missed, scores, reason = self.call(name, fn, args, prompts, responses, ground_truths)
            total += weight * values
            unscored |= missed
            metrics[f"reward/{name}"] = values[~missed].mean().item() if not missed.all() else 0.0
            if reason is not None:
                failures[name] = (int(missed.sum()), reason)
                metrics[f"reward/{name}_unscored"] = float(missed.sum())
            # a function returning `rules.Scores` reports more: reward/<name>_<metric>
            extra = getattr(scores, "metrics", {})
            metrics |= {f"reward/{name}_{key}": float(value) for key, value in extra.items()}
            if getattr(fn, "is_verifier", False):
                has_verifier = True
                verified &= values > 0
        if self.model is not None:
            model_scores, model_metrics = self.model.score(batch, update_stats=training)
            total += self.cfg.model_weight * model_scores
            metrics |= model_metrics
        if self.cfg.overlong_buffer_len is not None:
            shaping = self.overlong_shaping(batch)
            total += shaping
            metrics["reward/overlong_penalty"] = shaping.mean().item()
        checked_scores(f"the weighted sum of {self.source_names()}", total, len(responses))
        if self.cfg.non_stop_penalty:
            total = torch.where(stopped, total, torch.full_like(total, self.cfg.penalty_reward_value))
        correct = verified & stopped if has_verifier else None  # a truncated response is never correct, whatever its text
        if correct is not None:
            metrics["objective/verifiable_correct_rate"] = correct[~unscored].float().mean().item() if not unscored.all() else 0.0
        metrics["reward/unscored_share"] = unscored.float().mean().item()
        return RowScores(torch.where(unscored, torch.zeros_like(total), total), metrics, correct, unscored, failures)

    def overlong_shaping(self, batch: Trajectories) -> torch.Tensor:
        """(B,) reward added for each response's length (`rlhf.functional.overlong_penalty`), on the CPU."""
        lengths = batch.action_lengths.cpu()
        return overlong_penalty(lengths, self.max_new_tokens, self.cfg.overlong_buffer_len, self.cfg.overlong_penalty_factor)
