"""The CLI on `cluster=ray_local`: a private Ray cluster, 2 training processes per trained model, learning on
the built-in task; a worker killed mid-run ends the run promptly with the role, rank and exit code 4; a SIGTERM to the
run's process group saves and exits 5, one to every process exits 4 within seconds, and `kill -9` takes the cluster
down."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
from test_cli import ALGORITHM_METRICS, COMMON_METRICS, run_cli, scalars

from rlhf.distributed.cluster import RELEASE_TIMEOUT_S

pytestmark = pytest.mark.slow

RAY_ENV = {"RAY_AUTH_MODE": "disabled"}


def descendants(pid: int) -> list[int]:
    """The processes started, directly or not, by process ``pid`` (its private Ray cluster's workers among them)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
        except OSError:  # the process ended meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        found.extend(kids := children.get(todo.pop(), []))
        todo.extend(kids)
    return found


def command_line(pid: int) -> bytes:
    """Process ``pid``'s command line (Ray's workers show their actor class there); empty once it has ended."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_ppo_on_ray_learns_with_two_training_processes_per_trained_model(tmp_path):
    """PPO on Ray: the policy (ddp) and the critic (fsdp2) each train on 2 processes, and the task is learned."""
    out = tmp_path / "run"
    proc = run_cli(
        "cluster=ray_local", "algorithm=ppo", "critic/strategy=fsdp2", "train.num_steps=40", "eval.every=20", "seed=3",
        f"hydra.run.dir={out}", cwd=tmp_path, env_extra=RAY_ENV,
    )
    log = proc.stdout + proc.stderr
    assert "placed on Ray: policy x2, reference x2" in log
    assert "policy rank 1/2: strategy ddp" in log
    assert "critic x2" in log and "critic rank 1/2: strategy fsdp2" in log
    assert_learned(out, "ppo")


def test_hybrid_grpo_on_ray_colocates_the_engines_with_the_deepspeed_policy_and_learns(tmp_path):
    """schedule=hybrid, GRPO on Ray: the policy trains on 2 processes under DeepSpeed ZeRO-2, two generator ranks
    share its bundles and sleep every step, and the task is learned."""
    out = tmp_path / "run"
    proc = run_cli(
        "cluster=ray_local", "algorithm=grpo", "policy/strategy=deepspeed", "policy.strategy.zero_stage=2",
        "schedule=hybrid", "schedule.offload_optimizer=true", "cluster.roles.generator.devices_per_node=2",
        "cluster.colocate=[[policy,reference,generator]]", "train.num_steps=40", "eval.every=20", "seed=3",
        f"hydra.run.dir={out}", cwd=tmp_path, env_extra=RAY_ENV,
    )
    log = proc.stdout + proc.stderr
    assert "placed on Ray: policy x2, reference x2, generator x2" in log
    assert "policy rank 1/2: strategy deepspeed" in log
    series = assert_learned(out, "grpo")
    freed = [v for _, v in series["memory/generator_freed_mb"]]
    assert len(freed) == 40 and min(freed) > 0


def assert_learned(out: Path, algorithm: str) -> dict[str, list[tuple[int, float]]]:
    """The run in ``out`` logged every metric of ``algorithm``, its eval improved from step 0 to step 40, and it saved
    its final model; its TensorBoard series."""
    series = scalars(out)
    missing = [m for m in COMMON_METRICS + ALGORITHM_METRICS[algorithm] if m not in series]
    assert not missing, f"metrics missing from TensorBoard: {missing}"
    sampled, greedy = dict(series["eval/sampled_correct_rate"]), dict(series["eval/greedy_correct_rate"])
    assert sampled[40] - sampled[0] >= 0.2, f"sampled correct rate {sampled}"
    assert greedy[40] - greedy[0] >= 0.3, f"greedy correct rate {greedy}"
    assert (out / "final_model" / "model.safetensors").is_file()
    return series


# A run long enough to be stopped midway. Most of its time is the private cluster's start (its workers import torch
# and load the model; steps take a fraction of a second), so it starts no reference (algorithm.beta=0): the stop
# ends the policy's two ranks and the engine, and the reference's two more workers would only lengthen each start.
STOPPABLE = ("train.num_steps=100000", "algorithm.beta=0", "eval.every=0", "eval.num_samples=1", "eval.greedy=false",
             "logging.tensorboard=false", "logging.log_every=1", "cluster.object_store_memory=200000000")


def start_until_step(run_dir, step: int, *overrides: str) -> tuple[subprocess.Popen, list[str]]:
    """`python -m rlhf.train cluster=ray_local <overrides>` as the leader of a process group of its own (as `timeout`
    and job schedulers start a job), read until it logs step ``step``; the process and the lines read."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **RAY_ENV}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlhf.train", "cluster=ray_local", *overrides, f"hydra.run.dir={run_dir}"],
        cwd=run_dir.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if f"step {step:4d}/" in line:
            break
    if not any(f"step {step:4d}/" in line for line in lines):
        proc.kill()
        raise AssertionError("".join(lines[-40:]))
    return proc, lines


def stop(proc: subprocess.Popen, lines: list[str], send: Callable[[], None]) -> tuple[str, float]:
    """``send()`` the run a stop, then wait for it to end: its whole console output and the seconds it took to end."""
    try:
        send()
        began = time.monotonic()
        rest, _ = proc.communicate(timeout=300)
        return "".join(lines) + (rest or ""), time.monotonic() - began
    finally:
        if proc.poll() is None:
            proc.kill()


def kill_workers(proc: subprocess.Popen) -> None:
    """SIGKILL every role worker of this run (another run's, e.g. a parallel test's, are not among its descendants)."""
    workers = [pid for pid in descendants(proc.pid) if b"ray::RoleWorker" in command_line(pid)]
    assert workers, "no Ray worker processes found"
    for pid in workers:
        os.kill(pid, signal.SIGKILL)


def test_killed_worker_ends_the_run_with_role_rank_and_exit_code_4(tmp_path):
    proc, lines = start_until_step(tmp_path / "run", 5, *STOPPABLE, "cluster.timeout_s=60")
    log, elapsed = stop(proc, lines, lambda: kill_workers(proc))
    assert proc.returncode == 4, log[-3000:]
    assert "a worker failed:" in log and " rank " in log and "died" in log, log[-3000:]
    assert elapsed < 90


def test_sigterm_to_the_runs_process_group_with_its_console_gone_saves_and_exits_5(tmp_path):
    """`timeout 2h python -m rlhf.train cluster=ray_local | tee log`, then the job's SIGTERM (`kill -TERM -<pgid>`):
    the signal reaches the whole process group, tee ends at once, and the run finishes its step and saves into a
    closed pipe.
    - The private cluster's processes lead groups of their own, so the signal reaches the driver alone: it saves and
      shuts the cluster down. Before, the GCS died with the group, and the driver hung 60 s in Ray's shutdown and
      exited 1.
    - Ray's shutdown prints its workers' last lines into the closed pipe (BrokenPipeError); the stop is still exit 5,
      the checkpoint written, as with a console. Before, exit 6 ('the run raised BrokenPipeError')."""
    run_dir = tmp_path / "run"
    proc, lines = start_until_step(run_dir, 3, *STOPPABLE)
    cluster = descendants(proc.pid)

    def term_group_and_hang_up() -> None:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.stdout.close()  # the reader is gone: every later write to the console fails

    _, elapsed = stop(proc, lines, term_group_and_hang_up)
    log = (run_dir / "train.log").read_text()
    assert proc.returncode == 5, log[-3000:]
    assert "SIGTERM received: stopped after step" in log and sorted((run_dir / "checkpoints").glob("step_*"))
    assert elapsed < 45, elapsed  # 60 s of Ray waiting for a dead GCS before
    assert not [pid for pid in cluster if command_line(pid)], "the run's shutdown left Ray processes behind"


def test_sigterm_to_every_process_of_the_job_ends_promptly_with_exit_4(tmp_path):
    """SLURM's preemption signals every process of the job, Ray's included: the step in progress dies with its
    workers. The run says so and exits 4 within seconds. Before, it hung 60 s in Ray's shutdown, then exited 1 (or
    crashed with SIGSEGV once the shutdown was skipped)."""
    proc, lines = start_until_step(tmp_path / "run", 3, *STOPPABLE)

    def term_every_process() -> None:
        for pid in [proc.pid, *descendants(proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    log, elapsed = stop(proc, lines, term_every_process)
    assert proc.returncode == 4, log[-3000:]
    assert "the private Ray cluster does not answer" in log and "--signal=B:TERM" in log, log[-3000:]
    assert elapsed < 45, elapsed


def test_a_stop_while_the_clusters_head_is_frozen_saves_and_exits_5_without_waiting_for_it(tmp_path):
    """The head (GCS) still accepts connections but answers nothing: stopped (SIGSTOP), or still going down after a
    signal to every process (the race behind a SLURM preemption). The step and its save need only the workers, so
    the run saves; the release the head does not answer is given up after `RELEASE_TIMEOUT_S`, and the run exits 5.
    Before, Ray waited 60 s for the head and ended the process with exit 1."""
    run_dir = tmp_path / "run"
    proc, lines = start_until_step(run_dir, 3, *STOPPABLE)
    (head,) = [pid for pid in descendants(proc.pid) if b"gcs_server" in command_line(pid)]
    os.kill(head, signal.SIGSTOP)
    log, elapsed = stop(proc, lines, lambda: proc.send_signal(signal.SIGTERM))
    assert proc.returncode == 5, log[-3000:]
    assert "checkpoint saved" in log and "the private Ray cluster does not answer" in log, log[-3000:]
    assert elapsed < RELEASE_TIMEOUT_S + 30, elapsed
    deadline = time.monotonic() + 30  # the frozen head still dies with the run (SIGKILL reaches a stopped process)
    while command_line(head) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not command_line(head)


def test_kill_9_of_the_run_takes_its_private_cluster_down(tmp_path):
    """The cluster's processes lead their own process groups, and still die with the driver (Ray ties each to it):
    no GCS, raylet or worker outlives a `kill -9` of the run. (Ray's dashboard and runtime-env agents, started by the
    raylet, see it die but wait up to 60 s for the dead GCS before they exit, as they did before; they hold no
    resources of the run.)"""
    proc, lines = start_until_step(tmp_path / "run", 2, *STOPPABLE)
    cluster = [pid for pid in descendants(proc.pid) if b"Agent" not in command_line(pid)]
    assert cluster and {os.getpgid(pid) for pid in cluster} != {proc.pid}  # groups of their own
    stop(proc, lines, proc.kill)
    deadline = time.monotonic() + 30
    while (alive := [command_line(pid)[:40] for pid in cluster if command_line(pid)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive, alive
