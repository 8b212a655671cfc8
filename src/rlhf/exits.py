"""Exit codes of the command-line entry points, and the one-paragraph message for an error in user code.

    0  finished                    3  non-finite loss (too many skipped steps)   5  interrupted, checkpoint saved
    1  crash of Python itself      4  a Ray worker failed, died or timed out       6  an error raised during the run
    2  config error (or the run folder is in use by another run)                      (user code: reward, environment)
"""

from __future__ import annotations

import logging
import sysconfig
import traceback
from pathlib import Path

FINISHED = 0
CONFIG_ERROR = 2
NON_FINITE = 3
WORKER_FAILED = 4
INTERRUPTED_SAVED = 5
RUN_RAISED = 6

log = logging.getLogger("rlhf")


def of_hydra(code: int | str | None) -> int | str | None:
    """An entry point's exit code as `rlhf.exits` says it: 1 is Hydra reporting its own error, which is always the
    command line's or the config files' (an unknown key, a wrong type, an unknown group option or experiment), so
    CONFIG_ERROR; any other code passes unchanged."""
    return CONFIG_ERROR if code == 1 else code

_PACKAGE = Path(__file__).resolve().parent
_LIBRARY_KEYS = ("stdlib", "platstdlib", "purelib", "platlib")
_LIBRARIES = {Path(p).resolve() for key in _LIBRARY_KEYS if (p := sysconfig.get_path(key))}


def _is_ours(filename: str) -> bool:
    return Path(filename).resolve().is_relative_to(_PACKAGE)


def _is_library(filename: str) -> bool:
    path = Path(filename).resolve()
    return any(path.is_relative_to(lib) for lib in _LIBRARIES) or filename.startswith("<")


def user_frame(err: BaseException) -> traceback.FrameSummary | None:
    """The user's frame that raised ``err``: walking out from where it was raised, past Python's and installed
    libraries' frames, the first frame outside them, unless a frame of this package comes first (None then)."""
    for frame in reversed(traceback.extract_tb(err.__traceback__)):
        if _is_ours(frame.filename):
            return None
        if not _is_library(frame.filename):
            return frame
    return None


def describe_failure(err: BaseException, hint: str = "") -> str:
    """One paragraph: the exception's type and text, the user's function and line where it was raised, ``hint``."""
    text = f"{type(err).__name__}: {err}"
    frame = user_frame(err)
    where = f"the run raised {text}"
    if frame is not None:
        where = f"{frame.name}() raised {text}\n  at {frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"
    return f"{where}\n(full traceback in the run's log file{'; ' + hint if hint else ''})"


def traceback_to_log_file(err: BaseException) -> None:
    """Write ``err``'s full traceback to the log files only (Hydra's `<run>/<job>.log`), not to the console."""
    exc_info = (type(err), err, err.__traceback__)
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "traceback of the error above", (), exc_info)
    for handler in logging.getLogger().handlers + log.handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def report_run_error(err: Exception, hint: str = "") -> int:
    """Log ``err`` as a user-facing paragraph (traceback to the log file only) and return RUN_RAISED."""
    log.error("%s", describe_failure(err, hint))
    traceback_to_log_file(err)
    return RUN_RAISED
