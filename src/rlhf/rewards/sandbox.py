"""Runs one untrusted Python program in a fresh subprocess, within limits, and says how it ended.

Each run gets a new interpreter (``python -I``: no environment variables, no user site), its own empty temporary
folder as working directory (removed afterwards), stdin from /dev/null or the test's input, and its own session, so
the whole process group is killed at the wall limit. `sandbox_boot.py` (the child side) then sets, before the
program's first line:

- resource limits, soft = hard: CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS), the size of any one file it
  writes (RLIMIT_FSIZE), open files (RLIMIT_NOFILE), no core files, and processes (RLIMIT_NPROC: its user's current
  count plus ``Limits.processes``; the kernel does not apply it to root, hence the next point);
- as root, the unprivileged user ``nobody`` (so the program cannot signal the trainer, nor write outside its folder
  and world-writable places); as another user, the same uid (it can signal that user's other processes unless the
  PID namespace below is in force);
- new network and PID namespaces, where the platform allows (root, or user namespaces open to unprivileged users):
  no network interface but a down loopback, and no other process in sight; when the program's process 1 of that
  namespace exits, the kernel kills all it left behind, however they detached.

The wall time counts from when the child is set up and the program starts (a slow interpreter start on a loaded
machine is not the program's time); a child not set up within STARTUP_S is the sandbox's failure.

The parent reads stdout and stderr while the program runs and kills it past ``Limits.output_bytes``. What the
program does wrong (raises, exits non-zero, runs out of time or memory, forks or prints without bound, kills itself)
is its own fault: a failed test. What goes wrong on the sandbox's side (no temporary folder, no process could be
started, the child failed to set itself up) is not: `run_program` returns `rlhf.rewards.failure.Unscored`.
"""

from __future__ import annotations

import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rlhf.rewards.failure import Unscored

BOOT = Path(__file__).with_name("sandbox_boot.py")  # the child side
INTERPRETER = sys.executable  # the interpreter each run starts
STARTUP_S = 60.0  # seconds a child may take to be ready (interpreter start, set-up) before the sandbox gives up on it


@dataclass(frozen=True)
class Limits:
    """What one run may use; each is enforced as the module docstring says."""

    cpu_s: int = 5  # CPU seconds (RLIMIT_CPU)
    memory_mb: int = 512  # address space in MiB (RLIMIT_AS); the interpreter itself takes about 30
    wall_s: float = 10.0  # wall-clock seconds before the whole process group is killed
    output_bytes: int = 1 << 20  # stdout and stderr together, read while it runs
    file_bytes: int = 1 << 20  # the largest file it may write (RLIMIT_FSIZE)
    open_files: int = 64  # open file descriptors (RLIMIT_NOFILE)
    processes: int = 16  # processes beyond its user's current count (RLIMIT_NPROC; not applied to root)


@dataclass
class Outcome:
    """How one run ended: ``status`` is ok, error (non-zero exit or killed by a signal), timeout or output_limit."""

    status: str
    exit_code: int | None = None
    stdout: bytes = b""
    stderr: bytes = b""
    passed: set[int] = field(default_factory=set)  # assert tests only: the indices of the lines that held
    enforced: dict = field(default_factory=dict)  # what the child could enforce: network, pid_namespace, uid


def run_program(source: str, limits: Limits, tests: list[str] | None = None, stdin: bytes | None = None) -> Outcome | Unscored:
    """Run ``source`` once: with ``tests`` (assert lines, run after it in its namespace, each reported when it held),
    or as a whole program reading ``stdin``. An `Outcome`, or `Unscored` when the sandbox itself failed."""
    try:
        folder = tempfile.mkdtemp(prefix="rlhf-sandbox-")
    except OSError as err:
        return Unscored(f"sandbox: no temporary folder ({err})")
    try:
        return _run_in(folder, source, limits, tests, stdin)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _run_in(folder: str, source: str, limits: Limits, tests: list[str] | None, stdin: bytes | None) -> Outcome | Unscored:
    token = secrets.token_hex(16)
    job = json.dumps({"source": source, "tests": tests, "token": token, "limits": asdict(limits)}).encode()
    try:
        input_file = _input_file(folder, stdin) if stdin is not None else None
    except OSError as err:
        return Unscored(f"sandbox: could not write the test's input ({err})")
    job_read, job_write = os.pipe()
    report_read, report_write = os.pipe()
    try:
        process = subprocess.Popen(
            [INTERPRETER, "-I", str(BOOT), str(job_read), str(report_write)],
            stdin=input_file if input_file is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=folder, pass_fds=(job_read, report_write),
            start_new_session=True, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
        )
    except OSError as err:  # EAGAIN or ENOMEM at fork, a missing interpreter: not the program's doing
        for fd in (job_read, job_write, report_read, report_write):
            os.close(fd)
        return Unscored(f"sandbox: could not start a process ({err})")
    finally:
        if input_file is not None:
            input_file.close()
    os.close(job_read)
    os.close(report_write)
    try:
        _send(job_write, job)
        return _collect(process, report_read, token, limits, len(tests) if tests is not None else 0)
    finally:
        _kill_group(process)
        os.close(report_read)


def _input_file(folder: str, stdin: bytes):
    """``stdin`` in a file only this user can read, opened for reading and already unlinked (nothing left on disk)."""
    path = Path(folder).with_name(Path(folder).name + ".stdin")
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as writer:
        writer.write(stdin)
    try:
        return open(path, "rb")
    finally:
        path.unlink()


def _send(fd: int, job: bytes) -> None:
    """The job down its pipe (the child reads it whole before anything else); a child already gone shows later."""
    try:
        with os.fdopen(fd, "wb") as pipe:
            pipe.write(job)
    except BrokenPipeError:
        pass


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL to the run's whole process group (what it forked and left behind), then reap the child."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()
    for pipe in (process.stdout, process.stderr):
        pipe.close()


def _collect(process: subprocess.Popen, report: int, token: str, limits: Limits, tests: int) -> Outcome | Unscored:
    """Read the run's output and reports until it ends, its wall time is up, or its output passes the cap."""
    out, err = process.stdout.fileno(), process.stderr.fileno()
    streams = {out: bytearray(), err: bytearray(), report: bytearray()}
    selector = selectors.DefaultSelector()
    for fd in streams:
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ)
    deadline = time.monotonic() + STARTUP_S  # until the child is ready; then the program's own wall time
    ready = False
    report_cap = 200 + tests * 64  # "ready ..." and one "pass <token> <i>" per test: more is noise
    status = None
    while selector.get_map() and status is None:
        left = deadline - time.monotonic()
        if left <= 0:
            status = "timeout"
            break
        for key, _ in selector.select(timeout=left):
            chunk = os.read(key.fd, 65536)
            if not chunk:
                selector.unregister(key.fd)
                continue
            streams[key.fd] += chunk
            if key.fd == report and not ready and b"\n" in streams[report]:
                ready, deadline = True, time.monotonic() + limits.wall_s
            if key.fd == report and len(streams[report]) > report_cap:
                selector.unregister(report)
            elif len(streams[out]) + len(streams[err]) > limits.output_bytes:
                status = "output_limit"
    selector.close()
    if status is None:  # every pipe closed: the program's processes are gone, or it closed them; give it the rest
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            status = "timeout"
    _kill_group(process)
    lines = bytes(streams[report]).decode("utf-8", "replace").splitlines()
    if not lines or not lines[0].startswith("ready "):
        if status == "timeout":  # set-up never finished: the machine is overloaded, not the program
            return Unscored(f"sandbox: the child was not ready within {STARTUP_S} s")
        detail = bytes(streams[err])[-300:].decode("utf-8", "replace").strip()
        return Unscored(f"sandbox: the child failed to set itself up (exit {process.returncode}): {detail}")
    passed = {int(parts[2]) for parts in (line.split() for line in lines[1:])
              if len(parts) == 3 and parts[0] == "pass" and parts[1] == token and parts[2].isdigit()}
    code = process.returncode
    return Outcome(
        status=status or ("ok" if code == 0 else "error"), exit_code=code,
        stdout=bytes(streams[out]), stderr=bytes(streams[err]),
        passed={i for i in passed if i < tests}, enforced=json.loads(lines[0][len("ready "):]),
    )
