"""The sandbox's child side: run as a script (``python -I sandbox_boot.py <job fd> <report fd>``) by
`rlhf.rewards.sandbox`, never imported by the trainer.

It reads its job (the program, the assert lines if any, the run's token and the limits) as JSON from the job pipe,
then closes that pipe; walls itself off as far as the platform lets it (new network and PID namespaces, and a new
user namespace where it does not run as root); drops root for the unprivileged ``nobody`` (65534) where it runs as
root; sets its resource limits; forks, and waits; where there is a new PID namespace, its process 1 forks the
program's process (in a process group of its own) and waits (when process 1 exits, the kernel kills every process
left in the namespace); and reports on the report pipe:
``ready <what was enforced, JSON>`` once set up, and, for assert tests, ``pass <token> <index>`` for each assert
that held. The token is never in the program's reach as text on disk or in its arguments, so an early
``os._exit(0)`` or ``sys.exit(0)`` passes nothing.

Standard library only, and nothing from `rlhf`: it starts in a bare interpreter for every run.
"""

import ctypes
import json
import os
import resource
import sys

CLONE_NEWNET, CLONE_NEWPID, CLONE_NEWUSER = 0x40000000, 0x20000000, 0x10000000
NOBODY = 65534  # the unprivileged user a sandbox started as root runs as
# imported before root is dropped when `nobody` cannot read the standard library (an interpreter under /root): the
# modules simple programs use; any other import then fails as the program's error
PRELOAD = (
    "math", "cmath", "random", "re", "string", "collections", "itertools", "functools", "operator", "heapq", "bisect",
    "typing", "dataclasses", "fractions", "decimal", "statistics", "copy", "array", "json", "time", "datetime",
)


def _unshare(flags: int) -> bool:
    """Whether unshare(2) with ``flags`` worked (it needs root, or user namespaces open to all users)."""
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.unshare(ctypes.c_int(flags)) == 0


def _wall_off() -> dict:
    """New network and PID namespaces where allowed; what took effect."""
    own = 0 if os.geteuid() == 0 else CLONE_NEWUSER
    for flags in (CLONE_NEWNET | CLONE_NEWPID, CLONE_NEWNET, CLONE_NEWPID):
        if _unshare(own | flags):
            return {"network": bool(flags & CLONE_NEWNET), "pid_namespace": bool(flags & CLONE_NEWPID)}
    return {"network": False, "pid_namespace": False}


def _readable_by_all(path: str) -> bool:
    """Whether every folder from / down to ``path`` lets any user through, and ``path`` lets any user read."""
    parts = os.path.abspath(path).split(os.sep)
    folders = [os.sep + os.path.join(*parts[1:i]) for i in range(2, len(parts) + 1)]
    return all(os.stat(f).st_mode & 0o001 for f in folders) and bool(os.stat(path).st_mode & 0o004)


def _drop_root() -> bool:
    """As root: become ``nobody``, owning the working folder (the process's only writable place); whether the
    standard library had to be preloaded (PRELOAD) because ``nobody`` cannot read it."""
    if os.geteuid() != 0:
        return False
    preload = not _readable_by_all(os.path.dirname(os.__file__))
    if preload:
        for name in PRELOAD:
            __import__(name)
    os.chown(".", NOBODY, NOBODY)
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    return preload


def _processes_of(uid: int) -> int:
    """How many processes ``uid`` runs now (RLIMIT_NPROC counts them all, not only this sandbox's)."""
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                count += os.stat(f"/proc/{entry}").st_uid == uid
            except OSError:
                pass
    return count


def _limit(which: int, value: int) -> None:
    resource.setrlimit(which, (value, value))


def _set_limits(limits: dict, uid: int) -> None:
    """The resource limits (`rlhf.rewards.sandbox.Limits`), soft = hard so the program cannot raise them."""
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))  # SIGXCPU, then SIGKILL
    _limit(resource.RLIMIT_AS, limits["memory_mb"] << 20)
    _limit(resource.RLIMIT_FSIZE, limits["file_bytes"])
    _limit(resource.RLIMIT_NOFILE, limits["open_files"])
    _limit(resource.RLIMIT_CORE, 0)
    _limit(resource.RLIMIT_NPROC, _processes_of(uid) + limits["processes"])


def _run_asserts(source: str, tests: list[str], token: str, report: int) -> None:
    """The program, then each assert line in its namespace; a line that held is reported with the token."""
    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    exec(compile(source, "solution.py", "exec"), scope)
    for index, line in enumerate(tests):
        try:
            exec(compile(line, f"test_{index}.py", "exec"), scope)
        except Exception as err:  # a failed assert, or one that raised: this test fails, the next runs
            print(f"test {index} failed: {type(err).__name__}: {err}"[:300], file=sys.stderr)
            continue
        os.write(report, f"pass {token} {index}\n".encode())


def _fork_and_wait(report: int) -> None:
    """Fork; the parent waits for the child and exits as it did (128 + the signal that killed it); the child returns."""
    pid = os.fork()
    if pid:
        os.close(report)
        _, status = os.waitpid(pid, 0)
        os._exit(os.waitstatus_to_exitcode(status) % 256 if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


def main() -> None:
    job_fd, report = int(sys.argv[1]), int(sys.argv[2])
    with os.fdopen(job_fd, "rb") as job_file:
        job = json.loads(job_file.read())
    uid = os.getuid() if os.geteuid() != 0 else NOBODY  # as the machine counts it, before any user namespace
    enforced = _wall_off()
    enforced["uid"] = uid
    enforced["preloaded_stdlib"] = _drop_root()
    _set_limits(job["limits"], enforced["uid"])
    _fork_and_wait(report)  # this process waits outside; the rest runs in the new PID namespace, if any
    if enforced["pid_namespace"]:
        _fork_and_wait(report)  # process 1 of the namespace waits (and, exiting, takes every process left with it)
        os.setpgid(0, 0)  # the program's own group: killing "its parent's group" reaches no waiter
    os.write(report, f"ready {json.dumps(enforced)}\n".encode())
    source, tests, token = job["source"], job["tests"], job["token"]
    del job
    sys.argv = ["solution.py"]
    if tests is None:  # stdin/stdout: the program is the whole run
        os.close(report)
        exec(compile(source, "solution.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    else:
        _run_asserts(source, tests, token, report)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
