"""A synchronous agent `step` that never returns (`env=agent_func`, `env.step_timeout_s`): its episode is lost at the
timeout and the process can still exit (before, the call ran in a non-daemon executor thread, the timeout was printed,
and the process never exited)."""

from __future__ import annotations

import subprocess
import sys

import pytest

HANGING_AGENT = '''
import threading


def step(state, action, label=None, **_):
    threading.Event().wait()  # never returns
'''


BLOCKING_ASYNC_AGENT = '''
import threading


async def step(state, action, label=None, **_):
    threading.Event().wait()  # blocks the event loop it runs on, forever (no await)
'''


@pytest.mark.parametrize("agent", [HANGING_AGENT, BLOCKING_ASYNC_AGENT], ids=["sync-never-returns", "async-blocks-its-loop"])
def test_an_agent_step_that_never_returns_ends_the_run_instead_of_hanging_the_process(tmp_path, agent):
    """Also an `async def step` that blocks its event loop (before: step_timeout_s never fired, nothing was printed,
    and SIGTERM was acknowledged and ignored): environment coroutines run on a loop of their own, in a daemon thread,
    so the waiting loop still times the call out."""
    (tmp_path / "hang_agent.py").write_text(agent)
    (tmp_path / "tasks.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n' * 8)
    done = subprocess.run(
        [sys.executable, "-m", "rlhf.train", "env=agent_func", f"env.path={tmp_path / 'hang_agent.py'}",
         "env.step_timeout_s=1", "env.max_tokens=64", "dataset=jsonl", f"dataset.path={tmp_path / 'tasks.jsonl'}",
         "dataset.ground_truth_key=label", "dataset.chat_template='{{ messages[0].content }}'",
         "dataset.max_prompt_length=16", "train.num_steps=2", "eval.every=0", "logging.tensorboard=false",
         f"hydra.run.dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=600,  # generous: the process must end; a hang would reach this
    )
    output = done.stdout + done.stderr
    assert done.returncode == 6, output[-3000:]
    assert "step() did not return within env.step_timeout_s=1 s" in output
