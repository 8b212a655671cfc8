"""`code`: the response's Python code run against its row's tests in a sandbox (`rlhf.rewards.sandbox`).

A row's ground truth is its tests, one of two kinds:

- assert lines, ``["assert f(2) == 4", "assert f(0) == 0"]``: the program runs once, then each line in its namespace;
  a line passes when it runs without raising;
- stdin/stdout pairs, ``[{"input": "3\\n", "output": "9\\n"}, ...]``: the program runs once per pair, reading the
  input; a pair passes when it exits 0 and its stdout equals the output (trailing spaces of each line and trailing
  blank lines ignored).

The code is the first fenced block of the response (`````python ... `````; ``args.extract=fenced``, a response
without one scores 0), or the whole response (``args.extract=whole``). The score is the fraction of the row's tests
that passed (``args.score=fraction``) or 1.0 only when all did (``args.score=all``). A row whose sandbox failed for
reasons of its own is `rlhf.rewards.failure.Unscored`, not 0.

Metrics (``reward/code_<key>``): ``pass_rate`` (tests passed / tests run), ``all_pass_rate`` (rows that passed every
test), ``no_code_rate`` (rows without a fenced block), ``timeouts`` and ``output_limits`` (runs stopped so),
``unscored`` (rows the sandbox failed to score).
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from rlhf.errors import ConfigError, require
from rlhf.registry import register
from rlhf.rewards.failure import Unscored, is_unscored
from rlhf.rewards.rules import Scores, verifier
from rlhf.rewards.sandbox import Limits, Outcome, run_program

FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
EXTRACT_MODES = ("fenced", "whole")
SCORE_MODES = ("fraction", "all")
TESTS_FIX = ('give each row\'s tests as a list of assert lines (["assert f(1) == 2"]) or of stdin/stdout pairs '
             '([{"input": "1\\n", "output": "2\\n"}]), read with dataset.ground_truth_format=json')


def extract_code(response: str, mode: str) -> str | None:
    """The program in ``response``: its first fenced block (``mode="fenced"``; None without one), or all of it."""
    if mode == "whole":
        return response
    found = FENCE.search(response)
    return found.group(1) if found else None


def same_output(actual: bytes, expected: str) -> bool:
    """Whether a program's stdout matches the expected text, ignoring trailing spaces and trailing blank lines."""
    def lines(text: str) -> list[str]:
        rows = [row.rstrip() for row in text.splitlines()]
        while rows and not rows[-1]:
            rows.pop()
        return rows
    return lines(actual.decode("utf-8", "replace")) == lines(expected)


@dataclass(frozen=True)
class Job:
    """One sandbox run: a row, its program, and the assert lines or the one stdin/stdout pair it checks."""

    row: int
    source: str
    asserts: tuple[str, ...] | None = None
    pair: dict | None = None


def _run(job: Job, limits: Limits) -> tuple[int, int, Outcome | Unscored]:
    """(tests passed, tests checked, how the run ended)."""
    if job.asserts is not None:
        outcome = run_program(job.source, limits, tests=list(job.asserts))
        return (0 if is_unscored(outcome) else len(outcome.passed)), len(job.asserts), outcome
    outcome = run_program(job.source, limits, stdin=job.pair["input"].encode())
    ok = not is_unscored(outcome) and outcome.status == "ok" and same_output(outcome.stdout, job.pair["output"])
    return int(ok), 1, outcome


def _jobs(codes: list[str | None], truths: list) -> list[Job]:
    """The runs a batch needs: one per row of assert lines, one per stdin/stdout pair; none for a row without code."""
    jobs = []
    for row, (source, tests) in enumerate(zip(codes, truths)):
        if source is None:
            continue
        if isinstance(tests[0], str):
            jobs.append(Job(row, source, asserts=tuple(tests)))
        else:
            jobs += [Job(row, source, pair=pair) for pair in tests]
    return jobs


def check_code_args(
    at: str, extract: str = "fenced", score: str = "fraction", workers: int = 2, cpu_s: int = 5, memory_mb: int = 512,
    wall_s: float = 10.0, output_bytes: int = 1 << 20, file_bytes: int = 1 << 20, open_files: int = 64,
    processes: int = 16, **_,
) -> None:
    """ConfigError naming the key for args `code` cannot use (runs when the reward set is built)."""
    require(extract in EXTRACT_MODES, f"reward function code: {at}.extract={extract!r}; choose fenced or whole")
    require(score in SCORE_MODES, f"reward function code: {at}.score={score!r}; choose fraction or all")
    for key, value, least in (("workers", workers, 1), ("cpu_s", cpu_s, 1), ("memory_mb", memory_mb, 64),
                              ("output_bytes", output_bytes, 1), ("file_bytes", file_bytes, 0),
                              ("open_files", open_files, 16), ("processes", processes, 1)):
        require(isinstance(value, int) and not isinstance(value, bool) and value >= least,
                f"reward function code: {at}.{key}={value!r} must be a whole number >= {least}")
    require(isinstance(wall_s, (int, float)) and not isinstance(wall_s, bool) and wall_s > 0,
            f"reward function code: {at}.wall_s={wall_s!r} must be a number of seconds > 0")


def problem_with_tests(tests) -> str | None:
    """Why ``tests`` (one row's ground truth) is not a list of assert lines or of stdin/stdout pairs, or None."""
    if not isinstance(tests, (list, tuple)) or not tests:
        return f"its tests are {type(tests).__name__} {str(tests)[:60]!r}, not a non-empty list"
    if all(isinstance(line, str) for line in tests):
        for line in tests:
            try:
                compile(line, "test", "exec")
            except SyntaxError as err:
                return f"the assert line {line[:60]!r} is not valid Python ({err.msg})"
        return None
    for pair in tests:
        if not (isinstance(pair, dict) and set(pair) == {"input", "output"}
                and all(isinstance(pair[k], str) for k in pair)):
            return f"{str(pair)[:60]!r} is not an assert line, nor an {{input, output}} pair of strings (all of a row's tests are one kind)"
    return None


def check_truths(truths: list, origins: list[str], **args) -> None:
    """Before any model loads: every row's tests are one of the two kinds, else ConfigError naming the row."""
    check_code_args("reward.functions[].args", **args)
    for truth, where in zip(truths, origins):
        problem = problem_with_tests(truth)
        if problem is not None:
            raise ConfigError(f"reward function code: the row at {where}: {problem}; {TESTS_FIX}")


@register("reward", "code")
@verifier
def code(
    prompts, responses, ground_truths, extract: str = "fenced", score: str = "fraction", workers: int = 2,
    cpu_s: int = 5, memory_mb: int = 512, wall_s: float = 10.0, output_bytes: int = 1 << 20, file_bytes: int = 1 << 20,
    open_files: int = 64, processes: int = 16, **_,
) -> Scores:
    """Per response: the fraction of its row's tests its code passed (or 1.0/0.0 for all of them), or `Unscored`."""
    check_code_args("args", extract, score, workers, cpu_s, memory_mb, wall_s, output_bytes, file_bytes, open_files, processes)
    for i, tests in enumerate(ground_truths):
        if (problem := problem_with_tests(tests)) is not None:
            raise ConfigError(f"reward function code: row {i}: {problem}; {TESTS_FIX}")
    limits = Limits(cpu_s, memory_mb, float(wall_s), output_bytes, file_bytes, open_files, processes)
    codes = [extract_code(response, extract) for response in responses]
    jobs = _jobs(codes, ground_truths)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox") as pool:
        results = list(pool.map(lambda job: _run(job, limits), jobs))
    passed, checked = [0] * len(responses), [0] * len(responses)
    failed: dict[int, Unscored] = {}
    for job, (ok, count, outcome) in zip(jobs, results):
        passed[job.row] += ok
        checked[job.row] += count
        if is_unscored(outcome):
            failed.setdefault(job.row, outcome)
    values = []
    for row, tests in enumerate(ground_truths):
        fraction = passed[row] / len(tests)
        values.append(failed[row] if row in failed else fraction if score == "fraction" else float(fraction == 1.0))
    scored = [row for row in range(len(responses)) if row not in failed]
    outcomes = [outcome for _, _, outcome in results if not is_unscored(outcome)]
    metrics = {
        "pass_rate": sum(passed[r] for r in scored) / max(sum(len(ground_truths[r]) for r in scored), 1),
        "all_pass_rate": sum(passed[r] == len(ground_truths[r]) for r in scored) / max(len(scored), 1),
        "no_code_rate": codes.count(None) / max(len(codes), 1),
        "timeouts": float(sum(o.status == "timeout" for o in outcomes)),
        "output_limits": float(sum(o.status == "output_limit" for o in outcomes)),
        "unscored": float(len(failed)),
    }
    return Scores(values, metrics=metrics)


code.check_args = check_code_args
code.check_truths = check_truths
