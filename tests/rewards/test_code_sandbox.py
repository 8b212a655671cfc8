"""The sandbox (`rlhf.rewards.sandbox`) and the `code` reward: right code passes, hostile code fails its tests and
leaves the test process and the machine as they were, the sandbox's own failures are Unscored, bad config names
the key."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import pytest

from rlhf.errors import ConfigError
from rlhf.rewards import sandbox
from rlhf.rewards.code import code, extract_code, same_output
from rlhf.rewards.failure import Unscored, is_unscored
from rlhf.rewards.sandbox import Limits, run_program

LIMITS = Limits(cpu_s=2, memory_mb=256, wall_s=20.0, output_bytes=100_000, file_bytes=1 << 20)
SQUARE = "def square(x):\n    return x * x\n"
SQUARE_TESTS = ["assert square(3) == 9", "assert square(-2) == 4", "assert square(0) == 0"]


def enforced() -> dict:
    """What the sandbox enforces on this machine (network and PID namespaces, the uid), from one real run."""
    outcome = run_program("pass", LIMITS)
    assert not is_unscored(outcome), outcome
    return outcome.enforced


def still_fine() -> None:
    """The test process goes on: it can start processes, and the sandbox still scores right code."""
    assert subprocess.run([sys.executable, "-c", "print(1)"], capture_output=True, timeout=120).stdout == b"1\n"
    outcome = run_program(SQUARE, LIMITS, tests=SQUARE_TESTS)
    assert outcome.status == "ok" and outcome.passed == {0, 1, 2}


def test_right_code_passes_every_assert_and_wrong_code_only_those_that_hold():
    assert run_program(SQUARE, LIMITS, tests=SQUARE_TESTS).passed == {0, 1, 2}
    wrong = run_program("def square(x):\n    return x * 3\n", LIMITS, tests=SQUARE_TESTS)
    assert wrong.passed == {0, 2} and b"test 1 failed" in wrong.stderr


def test_a_program_reads_its_stdin_and_runs_in_its_own_empty_folder():
    outcome = run_program("import os\nprint(int(input()) * 2, os.listdir('.'))", LIMITS, stdin=b"21\n")
    assert outcome.status == "ok" and outcome.stdout == b"42 []\n"
    assert os.getcwd() not in outcome.stdout.decode()


@pytest.mark.parametrize("program, status", [
    ("while True:\n    pass\n", {"error", "timeout"}),  # loops forever: the CPU limit or the wall time
    ("import time\ntime.sleep(1000)\n", {"timeout"}),  # waits forever: the wall time
    ("xs = []\nwhile True:\n    xs.append(bytearray(10 ** 7))\n", {"error"}),  # allocates without bound
    ("import os\nwhile True:\n    os.fork()\n", {"error", "timeout"}),  # forks without bound
    ("f = open('big', 'wb')\nwhile True:\n    f.write(b'x' * (1 << 20))\n", {"error"}),  # writes gigabytes
    ("while True:\n    print('x' * 10000)\n", {"output_limit"}),  # prints megabytes
    ("input()\n", {"error"}),  # reads stdin: /dev/null, so EOFError
    ("import os\nos.killpg(os.getpgid(os.getppid()), 9)\n", {"error"}),  # kills its parent's process group
    ("import os\nos._exit(0)\n", {"ok"}),  # leaves before the asserts run: exit 0, but none passed
    ("import sys\nsys.exit(0)\n", {"ok"}),
])
def test_hostile_code_fails_its_tests_and_the_run_goes_on(program, status):
    limits = Limits(cpu_s=2, memory_mb=256, wall_s=4.0, output_bytes=100_000, file_bytes=1 << 20, processes=16)
    outcome = run_program(program + SQUARE, limits, tests=SQUARE_TESTS)
    assert not is_unscored(outcome), outcome
    assert outcome.status in status and outcome.passed == set()
    still_fine()


def test_killing_its_parent_harms_nothing_outside_the_run():
    """In a PID namespace the parent is a waiter the kernel protects (the signal is lost); elsewhere it dies and the
    run fails. Either way the test process goes on."""
    outcome = run_program("import os\nos.kill(os.getppid(), 9)\n" + SQUARE, LIMITS, tests=SQUARE_TESTS)
    assert not is_unscored(outcome)
    assert outcome.passed == ({0, 1, 2} if outcome.enforced["pid_namespace"] else set())
    still_fine()


def test_forged_pass_reports_count_for_nothing():
    """A program that writes "pass" lines to every descriptor it might guess does not know the run's token."""
    forger = "import os\nfor fd in range(3, 30):\n    try:\n        os.write(fd, b'pass 0 0\\npass x 1\\n')\n    except OSError:\n        pass\n"
    outcome = run_program(forger + "def square(x):\n    return 0\n", LIMITS, tests=["assert square(3) == 9", "assert square(1) == 1"])
    assert outcome.passed == set()


def test_a_fork_bomb_leaves_no_process_behind():
    before = _processes_of(enforced()["uid"]) if enforced()["uid"] != os.getuid() else None
    outcome = run_program("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
                          Limits(cpu_s=2, wall_s=3.0, processes=16))
    assert outcome.status in {"timeout", "error"}
    if before is not None:  # the program ran as another user: its processes are gone once the kernel reaped them
        uid, waited = enforced()["uid"], time.monotonic()
        while _processes_of(uid) > before and time.monotonic() - waited < 60:
            time.sleep(0.1)
        assert _processes_of(uid) <= before
    still_fine()


def _processes_of(uid: int) -> int:
    return sum(1 for p in os.listdir("/proc") if p.isdigit() and _owner(p) == uid)


def _owner(pid: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def test_a_program_cannot_signal_a_process_outside_its_sandbox():
    if not (enforced()["pid_namespace"] or enforced()["uid"] != os.getuid()):
        pytest.skip("neither a PID namespace nor another uid here: the sandbox cannot keep signals in (documented)")
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        outcome = run_program(f"import os\nos.kill({victim.pid}, 9)\n", LIMITS)
        assert outcome.status == "error"
        assert victim.poll() is None  # still running
    finally:
        victim.kill()
        victim.wait()


def test_no_network_where_the_platform_allows_it():
    if not enforced()["network"]:
        pytest.skip("no network namespace here: the network is NOT cut off (documented)")
    interfaces = "[line.split(':')[0].strip() for line in open('/proc/self/net/dev').read().splitlines()[2:]]"
    outcome = run_program(f"print({interfaces})", LIMITS)
    assert outcome.stdout == b"['lo']\n"
    with open("/proc/self/net/dev") as own:  # the test process itself sees the machine's interfaces
        assert len(own.read().splitlines()[2:]) > 1 or pytest.skip("this machine has only a loopback")


def test_the_sandboxs_own_failures_are_unscored(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "gone"))  # no such folder: mkdtemp fails
    assert isinstance(run_program(SQUARE, LIMITS), Unscored)
    monkeypatch.undo()
    monkeypatch.setattr(sandbox, "INTERPRETER", str(tmp_path / "no-python"))  # nothing to start
    failed = run_program(SQUARE, LIMITS)
    assert isinstance(failed, Unscored) and "could not start" in failed.reason
    monkeypatch.undo()
    broken = tmp_path / "boot.py"
    broken.write_text("import sys\nsys.exit(3)\n")  # a child that dies before it is set up
    monkeypatch.setattr(sandbox, "BOOT", broken)
    failed = run_program(SQUARE, LIMITS)
    assert isinstance(failed, Unscored) and "exit 3" in failed.reason
    scores = code(prompts=["p"], responses=[f"```python\n{SQUARE}```"], ground_truths=[SQUARE_TESTS])
    assert isinstance(scores[0], Unscored) and scores.metrics["unscored"] == 1.0


def test_extract_and_compare():
    assert extract_code("Here:\n```python\nx = 1\n```\nand ```\ny\n```", "fenced") == "x = 1\n"
    assert extract_code("x = 1", "fenced") is None and extract_code("x = 1", "whole") == "x = 1"
    assert same_output(b"9  \n\n", "9") and not same_output(b"9\n10\n", "9")


def test_code_reward_scores_fraction_or_all_and_reports_metrics():
    right, half = f"```python\n{SQUARE}```", "```python\ndef square(x):\n    return x * 3\n```"
    kwargs = dict(prompts=["p"] * 3, ground_truths=[SQUARE_TESTS] * 3, workers=2)
    scores = code(responses=[right, half, "no code"], **kwargs)
    assert scores == [1.0, pytest.approx(2 / 3), 0.0]
    assert scores.metrics["no_code_rate"] == pytest.approx(1 / 3)
    assert scores.metrics["pass_rate"] == pytest.approx(5 / 9) and scores.metrics["all_pass_rate"] == pytest.approx(1 / 3)
    assert code(responses=[right, half, "no code"], score="all", **kwargs) == [1.0, 0.0, 0.0]


def test_code_reward_runs_stdin_stdout_pairs():
    pairs = [{"input": "3\n", "output": "9\n"}, {"input": "4\n", "output": "16"}]
    program = "n = int(input())\nprint(n * n)\n"
    scores = code(prompts=["p"] * 2, responses=[program, "print(9)"], ground_truths=[pairs] * 2, extract="whole")
    assert scores == [1.0, 0.5]


@pytest.mark.parametrize("args, key", [
    ({"extract": "first"}, "args.extract"), ({"score": "mean"}, "args.score"), ({"workers": 0}, "args.workers"),
    ({"wall_s": 0}, "args.wall_s"), ({"memory_mb": 8}, "args.memory_mb"),
])
def test_bad_args_name_the_key(args, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        code(prompts=["p"], responses=["x"], ground_truths=[SQUARE_TESTS], **args)


def test_malformed_tests_are_found_before_any_model_loads():
    from rlhf.rewards.code import check_truths
    check_truths([SQUARE_TESTS, [{"input": "1", "output": "1"}]], ["a line 1", "a line 2"])
    for bad in ([], "assert x", ["assert (("], [{"input": "1"}], ["assert 1", {"input": "1", "output": "1"}]):
        with pytest.raises(ConfigError, match=r"the row at a line 2: .*dataset\.ground_truth_format=json"):
            check_truths([SQUARE_TESTS, bad], ["a line 1", "a line 2"])


UNPRIVILEGED = """
import sys
sys.path.insert(0, {src!r})
from rlhf.rewards.sandbox import Limits, run_program
limits = Limits(cpu_s=2, wall_s=5.0)
right = run_program("def f(x):\\n    return x + 1\\n", limits, tests=["assert f(1) == 2", "assert f(1) == 3"])
net = run_program("import socket\\nsocket.create_connection(('192.0.2.1', 80), timeout=5)", limits)
print(sorted(right.passed), right.enforced["network"], right.enforced["pid_namespace"], net.status, b"unreachable" in net.stderr)
"""


def test_a_sandbox_started_by_an_unprivileged_user_uses_user_namespaces():
    """Where the tests run as root: the trainer as another user (uid 12345, the system interpreter, readable by all)
    gets its isolation from a user namespace instead."""
    if os.geteuid() != 0 or not os.path.exists("/usr/bin/setpriv") or not os.path.exists("/usr/bin/python3"):
        pytest.skip("needs root, setpriv and /usr/bin/python3 to start the sandbox as another user")
    src = str(sandbox.BOOT.parents[2])
    proc = subprocess.run(["/usr/bin/setpriv", "--reuid=12345", "--regid=12345", "--clear-groups", "/usr/bin/python3",
                           "-c", UNPRIVILEGED.format(src=src)], capture_output=True, text=True, timeout=300, cwd="/tmp",
                          env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"})
    if proc.returncode != 0 and "Permission denied" in proc.stderr:
        pytest.skip(f"another user cannot read the checkout here: {proc.stderr[-200:]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    passed, network, pids, status, unreachable = proc.stdout.split()
    assert passed == "[0]"
    if network == "True":  # user namespaces open to unprivileged users here
        assert pids == "True" and status == "error" and unreachable == "True"


@pytest.mark.parametrize("override, message", [
    ("reward.functions.0.args.workers=0", r"reward\.functions\[0\]\.args\.workers=0 must be a whole number >= 1"),
    ("reward.functions.0.args.extract=last", r"reward\.functions\[0\]\.args\.extract='last'; choose fenced or whole"),
    ("+reward.functions.0.args.wall_seconds=3", r"reward\.functions\[0\]\.args\.wall_seconds: .*did you mean reward\.functions\[0\]\.args\.wall_s\?"),
])
def test_a_bad_preset_value_stops_the_run_before_models_load_naming_the_key(override, message):
    """Keys are checked by validation, values when the reward set is built (before any model loads)."""
    from rlhf.config.compose import compose_config
    from rlhf.config.validate import validate
    from rlhf.rewards.combine import RewardSet
    with pytest.raises(ConfigError, match=message):
        cfg = compose_config(["dataset=code_tasks", "reward=code", override])
        validate(cfg)
        RewardSet(cfg.reward)
