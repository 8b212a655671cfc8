"""`--multirun`: a job's config error does not stop the sweep; the other jobs finish, and a summary at the end names
each job's outcome; the sweep exits with the failed job's code (`rlhf.run.sweep`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hydra.core.utils import JobReturn, JobStatus
from hydra.types import RunMode
from omegaconf import OmegaConf

from rlhf import exits
from rlhf.run import sweep

TINY = ["train.num_steps=1", "eval.num_samples=1", "eval.greedy=false", "logging.tensorboard=false"]


@pytest.mark.slow
def test_a_bad_job_fails_alone_and_the_summary_names_it(tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf.train", "--multirun", "train.lr=1e-3,-1,5e-4", *TINY, f"hydra.sweep.dir={sweep_dir}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    console = proc.stdout + proc.stderr
    assert proc.returncode == exits.CONFIG_ERROR, console[-3000:]
    assert (sweep_dir / "0" / "final_model").is_dir() and (sweep_dir / "2" / "final_model").is_dir(), "the good jobs ran"
    assert not (sweep_dir / "1" / "final_model").exists()

    summary = (sweep_dir / "summary.txt").read_text().splitlines()
    assert summary[0] == "sweep summary: 2 of 3 job(s) finished"
    assert summary[1].startswith("#0 train.lr=0.001 ") and summary[1].endswith(": finished")
    assert summary[2].startswith("#1 train.lr=-1 ")
    assert ": exit 2: config error: train.lr=-1.0 must be in (0, 1]" in summary[2]
    assert summary[3].startswith("#2 train.lr=0.0005 ") and summary[3].endswith(": finished")
    assert "#1 train.lr=-1" in console and "config error: train.lr=-1.0 must be in (0, 1]" in console, "printed too"

    jobs = json.loads((sweep_dir / "summary.json").read_text())
    assert [(job["job"], job["code"]) for job in jobs] == [(0, 0), (1, exits.CONFIG_ERROR), (2, 0)]
    assert "train.lr=-1" in jobs[1]["overrides"]


def job_config(sweep_dir, job: int):
    """The parts of a job's Hydra config that `SweepSummary` reads."""
    (sweep_dir / str(job)).mkdir(parents=True)
    hydra = {"mode": RunMode.MULTIRUN, "job": {"num": job}, "runtime": {"output_dir": str(sweep_dir / str(job))},
             "sweep": {"dir": str(sweep_dir)}}
    return OmegaConf.create({"hydra": hydra})


def end(callback, sweep_dir, job: int, overrides: list[str], code: int, reason: str, monkeypatch) -> None:
    """Job ``job`` ends with ``code`` as `main` ends it in a multirun, then Hydra calls `on_job_end`."""
    monkeypatch.setattr(sweep, "in_multirun", lambda: True)
    assert sweep.end_job(code, reason) is None, "in a multirun the job returns"
    callback.on_job_end(job_config(sweep_dir, job), JobReturn(overrides=overrides, status=JobStatus.COMPLETED))


def test_an_interrupted_job_stops_the_sweep_after_writing_the_summary(tmp_path, monkeypatch):
    callback = sweep.SweepSummary()
    end(callback, tmp_path, 0, ["seed=1"], exits.FINISHED, "finished", monkeypatch)
    with pytest.raises(SystemExit) as exited:
        end(callback, tmp_path, 1, ["seed=2"], exits.INTERRUPTED_SAVED, "interrupted at step 3, checkpoint saved", monkeypatch)
    assert exited.value.code == exits.INTERRUPTED_SAVED
    assert (tmp_path / "summary.txt").read_text().splitlines() == [
        "sweep summary: 1 of 2 job(s) finished; stopped after job #1 was interrupted",
        "#0 seed=1: finished",
        "#1 seed=2: exit 5: interrupted at step 3, checkpoint saved",
    ]


def test_the_sweep_exits_with_the_first_failed_jobs_code_and_a_reason_of_one_line(tmp_path, monkeypatch):
    callback = sweep.SweepSummary()
    end(callback, tmp_path, 0, ["seed=1"], exits.NON_FINITE, "training stopped: 3 steps\nin a row", monkeypatch)
    end(callback, tmp_path, 1, ["seed=2"], exits.WORKER_FAILED, "a worker failed: policy rank 1 died", monkeypatch)
    with pytest.raises(SystemExit) as exited:
        callback.on_multirun_end(job_config(tmp_path, 2))
    assert exited.value.code == exits.NON_FINITE
    assert "#0 seed=1: exit 3: training stopped: 3 steps\n" in (tmp_path / "summary.txt").read_text()


def test_a_single_run_still_exits_with_its_code():
    with pytest.raises(SystemExit) as exited:
        sweep.end_job(exits.CONFIG_ERROR, "config error: train.lr=-1.0 must be > 0")
    assert exited.value.code == exits.CONFIG_ERROR
    assert sweep.end_job(exits.FINISHED, "finished") is None


def test_a_sweep_value_that_cannot_compose_is_refused_before_any_job_starts(tmp_path):
    """`train.lr=fast,1e-3`: before, the sweep aborted at that job with Hydra's traceback and no summary; now the
    value is named with the reason, and no job starts (the good values are not half run)."""
    sweep_dir = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf.train", "--multirun", "train.lr=fast,1e-3", *TINY, f"hydra.sweep.dir={sweep_dir}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == exits.CONFIG_ERROR, (proc.stdout + proc.stderr)[-3000:]
    assert "config error: train.lr=fast in the sweep does not compose" in proc.stderr
    assert "could not be converted to Float" in proc.stderr and "no job was started" in proc.stderr
    assert not sweep_dir.exists()


def test_the_swept_keys_are_those_a_multirun_varies(monkeypatch, tmp_path):
    """From the sweep's multirun.yaml where Hydra's sweeper wrote one (command line and `hydra.sweeper.params`), else
    from the command line."""
    monkeypatch.setattr(sweep, "in_multirun", lambda: True)
    monkeypatch.setattr(sweep.HydraConfig, "get", lambda: OmegaConf.create({"sweep": {"dir": str(tmp_path)}}))
    argv = ["--multirun", "train.lr=1e-4,3e-4", "seed=range(1,3)", "train.num_steps=4", "hydra.sweep.dir=s", "algorithm=grpo,rloo",
            "+env.max_turns=1,2", "++train.micro_batch_size=4,8"]
    assert sweep.swept_keys(argv) == {"train.lr", "seed", "algorithm", "env.max_turns", "train.micro_batch_size"}
    recorded = {"hydra": {"overrides": {"task": ["seed=1,2", "train.num_steps=4"]},
                          "sweeper": {"params": {"dataset": "arith,counting", "train.kl_coef": "0.1"}}}}
    OmegaConf.save(OmegaConf.create(recorded), tmp_path / "multirun.yaml")
    assert sweep.swept_keys(["train.lr=3e-4"]) == {"seed", "dataset"}  # a job process's own argv is not read
    monkeypatch.setattr(sweep, "in_multirun", lambda: False)
    assert sweep.swept_keys(argv) == set()


@pytest.mark.slow
def test_a_sweep_defined_in_a_config_file_refuses_a_resume_whose_values_changed(tmp_path):
    """`hydra.sweeper.params` in a config file sweeps keys that are not on the command line (as a launcher that runs
    each job in a process of its own has another command line). A re-launch with `resume=auto` after the file's values
    changed refused the job whose value moved, as a command-line sweep does. Before, job 1 resumed the lr=0.002 run
    with lr=0.005, silently."""
    sweep_dir, experiment = tmp_path / "sweep", tmp_path / "conf" / "experiment" / "lr_sweep.yaml"
    experiment.parent.mkdir(parents=True)

    def launch(values: str, *extra: str) -> subprocess.CompletedProcess:
        experiment.write_text(f"# @package _global_\nhydra:\n  sweeper:\n    params:\n      train.lr: {values}\n")
        return subprocess.run(
            [sys.executable, "-m", "rlhf.train", "--multirun", f"--config-dir={tmp_path / 'conf'}", "experiment=lr_sweep",
             *TINY, "checkpoint.every=1", *extra, f"hydra.sweep.dir={sweep_dir}"],
            cwd=tmp_path, capture_output=True, text=True, timeout=600,
        )

    first = launch("1e-3,2e-3")
    assert first.returncode == exits.FINISHED, (first.stdout + first.stderr)[-3000:]
    again = launch("1e-3,5e-3", "train.num_steps=2", "resume=auto")
    summary = (sweep_dir / "summary.txt").read_text().splitlines()
    assert again.returncode == exits.CONFIG_ERROR, (again.stdout + again.stderr)[-3000:]
    assert summary[1].startswith("#0 train.lr=0.001 ") and summary[1].endswith(": finished")
    assert "in a sweep: this job's swept train.lr: 0.002 -> 0.005 differs" in summary[2]
