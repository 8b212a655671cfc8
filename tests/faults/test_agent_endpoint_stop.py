"""SIGTERM while agents play a step (`env=openai_agent`) stops the run within seconds, the last complete step saved
(exit 5), whatever the agents do. Before, the signal was acknowledged and never acted on: an async agent blocking its
event loop (`time.sleep`), one asking again until it got a non-empty answer (after `env.max_turns` every answer is
empty at once) and one making 1000 requests kept the step, and the process, running. The budgets are set out of reach
here, so only the signal can end these episodes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

AGENT = '''
import pathlib
import sys
import threading
import time

import openai

HOSTILE, STARTED = pathlib.Path({hostile!r}), pathlib.Path({started!r})
IN_EVAL_ONLY = {in_eval_only!r}


def evaluating():
    """Whether the run's main thread is in an evaluation (the agents play in threads of their own)."""
    frame = sys._current_frames()[threading.main_thread().ident]
    while frame is not None and frame.f_code.co_name != "run_eval":
        frame = frame.f_back
    return frame is not None


async def run(task, client):
    llm = openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0)
    asked = [{{"role": "user", "content": task.prompt}}]
    reply = await llm.chat.completions.create(model=client.model, messages=asked, max_tokens=4)
    text = reply.choices[0].message.content
    if not (evaluating() if IN_EVAL_ONLY else HOSTILE.exists()):
        return float(text.strip() == str(task.label))
    STARTED.touch()
{body}
'''

BODIES = {
    "blocks-its-loop": "    time.sleep(3600)  # blocks the agents' event loop",
    "asks-until-answered": """\
    while True:  # after env.max_turns every answer is empty: this never ends
        if text:
            asked += [{"role": "assistant", "content": text}, {"role": "user", "content": task.prompt}]
        reply = await llm.chat.completions.create(model=client.model, messages=asked, max_tokens=4)
        text = reply.choices[0].message.content""",
    "1000-requests": """\
    for _ in range(1000):
        await llm.chat.completions.create(model=client.model, messages=asked, max_tokens=4)
    return 0.0""",
}


def trained_a_step(run_dir) -> bool:
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return any(json.loads(line)["step"] >= 1 for line in lines if line.strip())


@pytest.mark.parametrize("kind, schedule", [(kind, "sync") for kind in BODIES] + [("blocks-its-loop", "async")])
def test_sigterm_while_agents_play_stops_within_seconds_with_the_last_step_saved(tmp_path, kind, schedule):
    """Under the async schedule the agents play in the producer's thread, a step ahead of training."""
    output, code, took = stopped_run(tmp_path, BODIES[kind], schedule, hostile_from_start=False)
    assert code == 5, output[-3000:]
    assert took < 60, took  # seconds in practice; generous for a loaded machine
    assert "abandoned" in output or schedule == "async", output[-3000:]  # async: training may reach the step's end first
    assert "with a checkpoint" in output or "the last complete step" in output, output[-3000:]
    assert list((tmp_path / "run" / "checkpoints").glob("step_*")), output[-3000:]


@pytest.mark.parametrize("hostile_in", ["the-parity-probe", "the-first-evaluation"])
def test_sigterm_while_agents_play_before_the_first_step_stops_with_nothing_to_save(tmp_path, hostile_in):
    output, code, took = stopped_run(tmp_path, BODIES["blocks-its-loop"], "sync", hostile_from_start=True,
                                     in_eval_only=hostile_in == "the-first-evaluation")
    assert code == 5 and took < 60, output[-3000:]
    assert "before the first step" in output and "nothing" in output and "Traceback" not in output, output[-3000:]
    assert not list((tmp_path / "run" / "checkpoints").glob("step_*"))


def stopped_run(tmp_path, body: str, schedule: str, hostile_from_start: bool, in_eval_only: bool = False) -> tuple[str, int, float]:
    """Run training with the agent ``body``, hostile after the first step (or from the start, or in evaluations
    only), SIGTERM it once the hostile agents play; (its output, its exit code, seconds from the signal to its exit)."""
    hostile, started, run_dir = tmp_path / "hostile", tmp_path / "started", tmp_path / "run"
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT.format(hostile=str(hostile), started=str(started), in_eval_only=in_eval_only, body=body))
    if hostile_from_start:
        hostile.touch()
    out = tmp_path / "out.txt"
    with out.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rlhf.train", "experiment=agent_tiny", f"env.path={agent}", "env.max_concurrency=8",
             "env.step_timeout_s=3600", "env.episode_timeout_s=3600", "env.max_requests=1000000", "train.num_steps=50",
             f"schedule={schedule}", "train.prompts_per_step=4", "algorithm.num_samples_per_prompt=2", "eval.every=0",
             "eval.max_prompts=2", "eval.num_samples=1", "logging.tensorboard=false", "checkpoint.save_final_model=false",
             f"hydra.run.dir={run_dir}"],
            stdout=log, stderr=subprocess.STDOUT, text=True,
        )
        try:
            deadline = time.monotonic() + 600  # generous: model set-up on a loaded machine
            while not (hostile.exists() or trained_a_step(run_dir)):
                assert proc.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
                time.sleep(0.2)
            hostile.touch()  # the next episodes' agents turn hostile
            while not started.exists():
                assert proc.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
                time.sleep(0.05)
            time.sleep(0.5)  # well inside the hostile phase
            proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            proc.wait(timeout=120)  # generous; before, it never came
            took = time.monotonic() - signalled
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return out.read_text(), proc.returncode, took
