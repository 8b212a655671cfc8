"""SIGTERM while `env=agent_func` steps are running stops the run within seconds, the last complete step saved (exit
5), as it does for `env=openai_agent`. Before, the signal was acknowledged and the run waited on the steps until
`env.step_timeout_s` (set out of reach here, so only the signal can end them)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

AGENT = '''
import asyncio
import pathlib
import time

HOSTILE, STARTED = pathlib.Path({hostile!r}), pathlib.Path({started!r})


{define} step(state, action, label=None, **_):
    if HOSTILE.exists():  # after the first step: sleep far past any signal
        STARTED.touch()
        {sleep}
    return 1.0, state + action, True, {{}}
'''

KINDS = {
    "sync-sleeps": ("def", "time.sleep(3600)"),
    "async-sleeps": ("async def", "await asyncio.sleep(3600)"),
}


def trained_a_step(run_dir) -> bool:
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return any(json.loads(line)["step"] >= 1 for line in lines if line.strip())


@pytest.mark.parametrize("kind", KINDS)
def test_sigterm_while_agent_functions_run_stops_within_seconds_with_the_last_step_saved(tmp_path, kind):
    define, sleep = KINDS[kind]
    hostile, started, run_dir = tmp_path / "hostile", tmp_path / "started", tmp_path / "run"
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT.format(hostile=str(hostile), started=str(started), define=define, sleep=sleep))
    (tmp_path / "tasks.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n' * 8)
    out = tmp_path / "out.txt"
    with out.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rlhf.train", "env=agent_func", f"env.path={agent}", "env.step_timeout_s=3600",
             "env.max_tokens=64", "dataset=jsonl", f"dataset.path={tmp_path / 'tasks.jsonl'}",
             "dataset.ground_truth_key=label", "dataset.chat_template='{{ messages[0].content }}'",
             "dataset.max_prompt_length=16", "train.num_steps=50", "eval.every=0", "logging.tensorboard=false",
             "checkpoint.save_final_model=false", f"hydra.run.dir={run_dir}"],
            stdout=log, stderr=subprocess.STDOUT, text=True,
        )
        try:
            deadline = time.monotonic() + 600  # generous: model set-up on a loaded machine
            while not trained_a_step(run_dir):
                assert proc.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
                time.sleep(0.2)
            hostile.touch()  # the next steps sleep
            while not started.exists():
                assert proc.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
                time.sleep(0.05)
            time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            proc.wait(timeout=120)  # generous; before, it waited for env.step_timeout_s
            took = time.monotonic() - signalled
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    output = out.read_text()
    assert proc.returncode == 5, output[-3000:]
    assert took < 60, took  # seconds in practice; generous for a loaded machine
    assert "abandoned" in output and "Traceback" not in output, output[-3000:]
    assert list((run_dir / "checkpoints").glob("step_*")), output[-3000:]
