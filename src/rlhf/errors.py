"""The error every user-facing config problem raises (kept apart so any module can raise it without cycles)."""

import errno
import threading
from contextlib import contextmanager

FULL_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT)  # an OSError with one of these: the disk (or the user's quota) is full


class ConfigError(ValueError):
    """A config that cannot run; the message names the key and the fix."""


def require(ok: bool, message: str) -> None:
    """Raise ConfigError(message) unless ``ok``."""
    if not ok:
        raise ConfigError(message)


class NoSpaceError(OSError):
    """A save failed on a full disk or quota; the message names the folder, the room it needs and the room free."""

    code = errno.ENOSPC

    def __init__(self, message: str) -> None:
        super().__init__(self.code, message)

    def __str__(self) -> str:
        return self.strerror

    def __reduce__(self):  # OSError pickles (errno, strerror); a Ray worker's error must rebuild from the message alone
        return type(self), (self.strerror,)


class FileSizeLimitError(NoSpaceError):
    """A save failed on this process's file size limit (`ulimit -f`): room is lacking for one file, not on the disk."""

    code = errno.EFBIG


class RewardValueError(ValueError):
    """A reward function or reward model produced a score that is not a finite number of sane size; the message names
    the source, the row and the value, so the run stops before that score reaches a statistic or a loss."""


class StopNow(SystemExit):
    """A second stop signal: the run ends at once, nothing more saved (not a user's sys.exit: never reported as one)."""


class StopRequested(Exception):
    """A stop signal (SIGTERM/SIGINT) arrived while the step waited on user code that need not end soon (agents): the
    step is abandoned, the last complete step saved, and the run ends as interrupted (exit 5)."""


stop_requested = threading.Event()  # set by `StopSignals` at the first stop signal: waits on agents give up at once


class UserExit(RuntimeError):
    """User code inside the run (a reward function, an environment, an agent) called ``sys.exit`` or raised
    ``SystemExit``: the run reports it as that code's error (exit 6, the last complete step saved) instead of
    ending as if it had finished."""


def as_user_error(caught: BaseException) -> BaseException:
    """``caught`` itself, or for a ``SystemExit`` (but a `StopNow`) a `UserExit` naming the function that raised it
    and its line."""
    if not isinstance(caught, SystemExit) or isinstance(caught, StopNow):
        return caught
    tb = caught.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = "" if tb is None else (
        f" in {tb.tb_frame.f_code.co_name} ({tb.tb_frame.f_code.co_filename}:{tb.tb_lineno})"
    )
    return UserExit(
        f"sys.exit({caught.code!r}) was called{where} inside the run: user code (a reward function, an environment, "
        f"an agent) must return a value or raise an exception, never end the process; the run stops here, the last "
        f"complete step (if one is) saved"
    )


@contextmanager
def user_exits_named():
    """A ``sys.exit`` in user code within the block is raised as a `UserExit` naming where it was called (exit 6),
    an Exception the run's error handling takes like any other, instead of ending the run silently with the user's
    exit code; a second stop signal (`StopNow`) passes as itself."""
    try:
        yield
    except SystemExit as caught:
        err = as_user_error(caught)
        if err is caught:
            raise
        raise err from caught
