"""`--multirun` sweeps: one job's failure does not stop the others, and the sweep ends with a summary.

In a single run `end_job` raises SystemExit with the run's exit code (`rlhf.exits`), as always. In a multirun it
records the outcome and returns, so Hydra's launcher goes on to the next job (Hydra lets an Exception end the
sweep after the batch and a SystemExit at once). `SweepSummary`, a Hydra callback (`hydra.callbacks` in
conf/config.yaml), writes each job's outcome to `<job folder>/outcome.json`; when the sweep ends it prints one line
per job, writes `<sweep folder>/summary.txt` and `summary.json`, and exits with the first failed job's code. A job
interrupted by SIGINT/SIGTERM (saved, exit 5) stops the sweep at once, after the summary: a scheduler asked it to.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlhf import exits
from rlhf.config.compose import compose_config
from rlhf.errors import ConfigError

log = logging.getLogger("rlhf")

OUTCOME_FILE = "outcome.json"
MAX_REASON = 300  # characters of the one-line reason kept in the summary


@dataclass
class Outcome:
    """How one job of a sweep ended."""

    job: int  # Hydra's job number (its folder's name under the sweep folder)
    overrides: list[str]  # the job's own overrides
    code: int  # its exit code (`rlhf.exits`), 0 = finished
    reason: str  # one line: "finished" or what went wrong

    def line(self) -> str:
        status = "finished" if self.code == exits.FINISHED else f"exit {self.code}: {self.reason}"
        return f"#{self.job} {' '.join(self.overrides) or '(no overrides)'}: {status}"


_recorded: tuple[int, str] | None = None  # this process's last job outcome, taken by SweepSummary.on_job_end


def one_line(text: str) -> str:
    """The first non-empty line of ``text``, cut to MAX_REASON characters."""
    line = next((part.strip() for part in str(text).splitlines() if part.strip()), "")
    return line if len(line) <= MAX_REASON else line[: MAX_REASON - 3] + "..."


def in_multirun() -> bool:
    """Whether this job is one of a `--multirun` sweep."""
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def end_job(code: int, reason: str) -> None:
    """End the job with exit ``code``: SystemExit in a single run; in a multirun, record it for the summary and
    return, so the next job runs."""
    global _recorded
    if not in_multirun():
        if code != exits.FINISHED:
            raise SystemExit(code) from None
        return
    _recorded = (code, one_line(reason))


def take_outcome(config: DictConfig, job_return: JobReturn) -> Outcome:
    """The outcome `end_job` recorded for the job that just ended, or its Hydra status when none was recorded
    (an exception that escaped `main`)."""
    global _recorded
    recorded, _recorded = _recorded, None
    if recorded is None:
        failed = job_return.status == JobStatus.FAILED
        error = job_return._return_value  # the exception; the public property would re-raise it
        recorded = (1, one_line(f"{type(error).__name__}: {error}")) if failed else (exits.FINISHED, "finished")
    return Outcome(int(config.hydra.job.num), list(job_return.overrides or []), *recorded)


def read_outcomes(sweep_dir: Path) -> list[Outcome]:
    """Every job outcome written under ``sweep_dir``, by job number."""
    outcomes = [Outcome(**json.loads(path.read_text())) for path in sweep_dir.glob(f"*/{OUTCOME_FILE}")]
    return sorted(outcomes, key=lambda outcome: outcome.job)


def write_summary(sweep_dir: Path, note: str = "") -> list[Outcome]:
    """Log one line per job and write `summary.txt` and `summary.json` into ``sweep_dir``; returns the outcomes."""
    outcomes = read_outcomes(sweep_dir)
    failed = [outcome for outcome in outcomes if outcome.code != exits.FINISHED]
    head = f"sweep summary: {len(outcomes) - len(failed)} of {len(outcomes)} job(s) finished"
    head += f"; {note}" if note else ""
    lines = [head, *(outcome.line() for outcome in outcomes)]
    (sweep_dir / "summary.txt").write_text("\n".join(lines) + "\n")
    (sweep_dir / "summary.json").write_text(json.dumps([asdict(outcome) for outcome in outcomes], indent=2) + "\n")
    level = logging.ERROR if failed else logging.INFO
    log.log(level, "%s\n  %s\n(%s)", head, "\n  ".join(lines[1:]), sweep_dir / "summary.txt")
    return outcomes


def sweep_exit_code(outcomes: list[Outcome]) -> int:
    """The first failed job's exit code, or 0 when every job finished."""
    return next((outcome.code for outcome in outcomes if outcome.code != exits.FINISHED), exits.FINISHED)


class SweepSummary(Callback):
    """Hydra callback: each job's outcome to its folder, and at the end of a sweep the summary and exit code."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        for stale in Path(config.hydra.sweep.dir).glob(f"*/{OUTCOME_FILE}"):  # a reused sweep folder's last sweep
            stale.unlink()

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if config.hydra.mode != RunMode.MULTIRUN:
            return
        outcome = take_outcome(config, job_return)
        (Path(config.hydra.runtime.output_dir) / OUTCOME_FILE).write_text(json.dumps(asdict(outcome)) + "\n")
        if outcome.code == exits.INTERRUPTED_SAVED:
            write_summary(Path(config.hydra.sweep.dir), f"stopped after job #{outcome.job} was interrupted")
            raise SystemExit(outcome.code)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        code = sweep_exit_code(write_summary(Path(config.hydra.sweep.dir)))
        if code != exits.FINISHED:
            raise SystemExit(code)


def _at_first_values(parsed: list, texts: list[str]) -> list[str]:
    """The overrides ``texts`` (parsed as ``parsed``) with each swept key at its first value."""
    return [f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}" if o.is_sweep_override() else text
            for o, text in zip(parsed, texts)]


def first_job(overrides: list[str]) -> list[str]:
    """``overrides`` with each swept key at its first value: the sweep's first job (Hydra's parser reads the values,
    ranges and choices included). Raises HydraException for a malformed override."""
    return _at_first_values(OverridesParser.create().parse_overrides(overrides), overrides)


def swept_keys(argv: list[str]) -> set[str]:
    """The keys this `--multirun` sweep varies across jobs (`train.lr` of `train.lr=1e-4,3e-4`, `dataset` of
    `dataset=gsm8k,math`), without `+`/`~`; empty outside a multirun or for a malformed override (Hydra reports it).
    Read from what the sweep recorded (`sweep_overrides`), so a job launched as a process of its own is covered too."""
    if not in_multirun():
        return set()
    try:
        parsed = OverridesParser.create().parse_overrides(sweep_overrides(argv))
    except HydraException:
        return set()
    return {o.get_key_element().lstrip("+~") for o in parsed if o.is_sweep_override()}


def sweep_overrides(argv: list[str]) -> list[str]:
    """The overrides this job's sweep was launched with: the command line's and the config's `hydra.sweeper.params`,
    from the sweep's `multirun.yaml`, which Hydra's sweeper writes before any job starts. A launcher that starts each
    job as a process of its own (joblib, submitit) runs it with another ``argv``, and sweeper params are not on the
    command line at all. Without that file (another sweeper), the overrides among ``argv``."""
    recorded = Path(HydraConfig.get().sweep.dir) / "multirun.yaml"
    if not recorded.is_file():
        return [a for a in argv if not a.startswith("-") and "=" in a]
    hydra = OmegaConf.load(recorded).hydra
    params = hydra.sweeper.get("params") or {}
    return [*hydra.overrides.task, *(f"{key}={value}" for key, value in params.items())]


def check_sweep_values(argv: list[str]) -> None:
    """For `--multirun`, before any job starts: each value of each swept key composes with the others at their first
    values, else ConfigError naming the key and the value (before, a wrong type in one value aborted the sweep partway,
    with no summary). One composition per value, not per job."""
    if "--multirun" not in argv and "-m" not in argv:
        return
    given = [a for a in argv if not a.startswith("-") and "=" in a and not a.startswith("hydra.")]
    try:
        parsed = OverridesParser.create().parse_overrides(given)
    except HydraException:
        return  # Hydra reports a malformed override itself
    first = _at_first_values(parsed, given)
    for i, override in enumerate(parsed):
        if not override.is_sweep_override():
            continue
        for value in override.sweep_string_iterator():
            attempt = [*first[:i], f"{override.get_key_element()}={value}", *first[i + 1:]]
            try:
                compose_config(attempt)
            except (HydraException, OmegaConfBaseException, ValueError) as err:
                raise ConfigError(
                    f"{override.get_key_element()}={value} in the sweep does not compose "
                    f"({one_line(str(err.__cause__ or err))}); "
                    f"no job was started: fix or drop that value"
                ) from None
