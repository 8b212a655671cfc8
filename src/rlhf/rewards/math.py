"""Math answers: `math_verify` checks the final answer symbolically; `boxed_format` rewards one ``\\boxed{}``.

`math_verify` uses the math-verify package (``pip install 'rlhf[math]'``): it extracts the response's final
answer (its ``\\boxed{...}`` first, else its last number or ``answer is ...`` expression) and compares it with
the ground truth ("42", "\\frac{1}{2}", "0.5", "$\\sqrt{2}$") through SymPy: 1/2, \\frac{1}{2} and 0.5 agree.

Time bound: math-verify stops each parse and each comparison after ``timeout_s`` seconds (`args.timeout_s`) with
``signal.alarm``, which works only in a process's main thread. Off the main thread (the async schedule scores
in its producer thread) the batch is scored in a one-worker child process, whose main thread applies the same
bound. The worker is spawned (safe beside CUDA and other threads) on first use, which takes a second or a few
(it re-imports the entry module, e.g. `rlhf.train` and torch), and serves every later batch. On the main
thread the alarm replaces any other SIGALRM timer (pytest-timeout's signal method, for one). A parse or comparison
stopped there scores 0; they are counted (`reward/math_verify_timeouts`) and said in one line per batch, instead of
math-verify's own warning for each.
"""

from __future__ import annotations

import logging
import multiprocessing
import re
from contextlib import contextmanager
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from rlhf.data.answers import BOXED, boxed_contents
from rlhf.errors import ConfigError, require
from rlhf.registry import register
from rlhf.rewards.rules import Scores, verifier

log = logging.getLogger("rlhf")
_WORKER: ProcessPoolExecutor | None = None  # scores batches handed over from threads other than the main one
_WORKER_LOCK = threading.Lock()  # two producer threads must not start two workers
Graded = tuple[list[float], list[bool], int]  # (1.0/0.0 per response, whether each had an answer to read, timeouts)
PLAIN_NUMBER = re.compile(r"[-+]?\d[\d,]*(\.\d+)?")  # a truth math-verify reads without asking it


def _one_nonempty_box(text: str) -> bool:
    """Whether ``text`` holds exactly one ``\\boxed{...}``, closed and not blank."""
    boxes = boxed_contents(text)
    return len(boxes) == 1 and boxes[0] is not None and boxes[0].strip() != ""


@register("reward", "boxed_format")
def boxed_format(prompts, responses, ground_truths, **_) -> list[float]:
    """1.0 when the response has exactly one non-empty ``\\boxed{...}`` (the answer format), else 0.0."""
    return [float(_one_nonempty_box(r)) for r in responses]


def _math_verify_api():
    """math-verify's (parse, verify, extraction targets: boxed answer first, then LaTeX, then expressions)."""
    try:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    except ImportError as err:
        raise ConfigError(
            "reward function math_verify needs the math-verify package: pip install 'rlhf[math]' "
            "(or pip install 'math-verify>=0.7'), or remove math_verify from reward.functions"
        ) from err
    return parse, verify, [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]


def _parse_truth(truth: str, timeout_s: int) -> list:
    """math-verify's parse of a ground truth; bare LaTeX ("\\sqrt{2}") is read as if written "$\\sqrt{2}$"."""
    parse, _, targets = _math_verify_api()
    text = truth if "$" in truth or BOXED in truth else f"${truth}$"
    gold = parse(text, extraction_config=targets, parsing_timeout=timeout_s)
    if not gold:
        raise ValueError(
            f"reward function math_verify: ground truth {truth!r} holds no answer math-verify can read; fix "
            "that row of the dataset's ground-truth column (dataset.ground_truth_key), e.g. '42' or '1/2'"
        )
    return gold


def score_answers(responses: list[str], truths: list[str], timeout_s: int) -> Graded:
    """Per response: 1.0 when its final answer equals its truth, else 0.0; whether it had an answer; and how many
    parses and comparisons ran past ``timeout_s`` (each scored 0).

    One parse per distinct truth, and one comparison per distinct (truth, extracted answer): a group's samples often
    give the same answer, and a comparison that runs into the timeout (a huge truth, a pathological answer) costs
    the timeout once, not once per sample."""
    parse, verify, targets = _math_verify_api()
    with _timeouts_counted() as timeouts:
        golds = {truth: _parse_truth(truth, timeout_s) for truth in set(truths)}
        compared: dict[tuple, bool] = {}
        scores, answered = [], []
        for response, truth in zip(responses, truths):
            answer = parse(response, extraction_config=targets, parsing_timeout=timeout_s)  # [] if none; no raise
            answered.append(bool(answer))
            key = (truth, tuple(str(part) for part in answer))
            if answer and key not in compared:
                compared[key] = bool(verify(golds[truth], answer, timeout_seconds=timeout_s))
            scores.append(float(bool(answer) and compared[key]))
    return scores, answered, len(timeouts)


@contextmanager
def _timeouts_counted():
    """Inside the block, math-verify's "Timeout during parsing/comparison" warnings are kept in the list yielded
    instead of printed (the caller says them once, naming `args.timeout_s`)."""
    caught: list[logging.LogRecord] = []

    def keep(record: logging.LogRecord) -> bool:
        if record.getMessage().startswith("Timeout during"):
            caught.append(record)
            return False
        return True

    loggers = [logging.getLogger(name) for name in ("math_verify.grader", "math_verify.parser")]
    for logger in loggers:
        logger.addFilter(keep)
    try:
        yield caught
    finally:
        for logger in loggers:
            logger.removeFilter(keep)


def _worker() -> ProcessPoolExecutor:
    """The one-process pool that scores off the main thread (started on first use)."""
    global _WORKER
    with _WORKER_LOCK:
        if _WORKER is None:
            _WORKER = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        return _WORKER


def _score_in_worker(responses: list[str], truths: list[str], timeout_s: int) -> Graded:
    """`score_answers` in the worker process, where signal timeouts work; a dead worker is replaced."""
    global _WORKER
    try:
        return _worker().submit(score_answers, responses, truths, timeout_s).result()
    except BrokenProcessPool as err:
        with _WORKER_LOCK:
            _WORKER = None  # the next batch starts a fresh worker
        raise RuntimeError(
            f"reward function math_verify: its scoring process died ({err}); lower args.timeout_s"
        ) from err


def _check_args(ground_truths: list, timeout_s) -> None:
    """Config errors: a missing ground truth, or a timeout signal.alarm cannot take."""
    require(
        all(truth is not None for truth in ground_truths),
        "reward function math_verify needs a ground truth per prompt: set dataset.ground_truth_key to the "
        "dataset's answer column",
    )
    require(
        isinstance(timeout_s, int) and not isinstance(timeout_s, bool) and timeout_s >= 1,
        f"reward function math_verify: args.timeout_s={timeout_s!r} must be a whole number of seconds >= 1 "
        "(math-verify's signal.alarm bound per parse and per comparison)",
    )


def check_truths(truths: list, origins: list[str], timeout_s: int = 5, **_) -> None:
    """Before any model loads: every distinct ground truth (``origins``: where each one's row is, "p.jsonl line 101")
    is one math-verify reads within ``timeout_s``, else ConfigError naming where the first that is not is, and how
    many are not (before, the run stopped at the step that first drew it)."""
    _check_args(truths, timeout_s)
    bad: dict[str, int] = {}  # unreadable truth -> its first row
    seen: set[str] = set()
    for row, truth in enumerate(str(t).strip() for t in truths):
        if truth in seen or PLAIN_NUMBER.fullmatch(truth):  # a plain number always reads (GSM8K's every truth)
            continue
        seen.add(truth)
        try:
            _parse_truth(truth, timeout_s)
        except ValueError:
            bad[truth] = row
    if bad:  # (about 2.5 ms a distinct non-numeric truth on a 2-core CPU: seconds for MATH's 7,500)
        truth, row = next(iter(bad.items()))
        raise ConfigError(
            f"reward function math_verify: the ground truth at {origins[row]} ({truth!r}) holds no answer math-verify can "
            f"read within args.timeout_s={timeout_s} s ({len(bad)} distinct such truths in all); fix those rows of the "
            f"dataset's ground-truth column (dataset.ground_truth_key), e.g. '42' or '1/2', or drop them"
        )


@register("reward", "math_verify")
@verifier
def math_verify(prompts, responses, ground_truths, timeout_s: int = 5, **_) -> Scores:
    """1.0 when the final answer equals the ground truth symbolically, else 0.0; metric ``no_answer_rate``."""
    _check_args(ground_truths, timeout_s)
    truths = [str(truth).strip() for truth in ground_truths]
    if threading.current_thread() is threading.main_thread():
        scores, answered, timeouts = score_answers(list(responses), truths, timeout_s)
    else:
        scores, answered, timeouts = _score_in_worker(list(responses), truths, timeout_s)
    if timeouts:
        log.warning(
            "reward function math_verify: %d parses or comparisons of this batch ran past args.timeout_s=%d s and "
            "scored 0 (a ground truth or answer SymPy is slow to compare, e.g. a huge power); lower args.timeout_s "
            "to bound the time they take, or rewrite those ground truths (reward/math_verify_timeouts counts them)",
            timeouts, timeout_s,
        )
    no_answer_rate = answered.count(False) / max(len(answered), 1)
    return Scores(scores, metrics={"no_answer_rate": no_answer_rate, "timeouts": float(timeouts)})


math_verify.check_truths = check_truths
