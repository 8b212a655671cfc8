"""Where agents run, and the deadlines that bound every wait on them.

Async agents share one event loop, in a daemon thread of its own (so one `httpx.AsyncClient` can serve every
episode); a plain ``def run`` runs in a daemon thread, awaited from that loop. Neither the endpoint's loop (uvicorn's
thread) nor the serving thread (the caller's) runs agent code, so an agent that blocks cannot freeze them: the serving
thread checks each episode against its deadlines (`overdue`) and the loop against `env.step_timeout_s` (`AgentLoop`).
A loop an agent blocked (``time.sleep`` in an ``async def run``) is abandoned with the episodes on it, and the next
agents start on a fresh one.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from typing import Coroutine

from rlhf.agents.sessions import Session


class AgentLoop:
    """The agents' event loop in a daemon thread, and when it last ran (it ticks every `TICK_S` while free)."""

    TICK_S = 0.1

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.ticked = time.monotonic()
        threading.Thread(target=self._run, daemon=True, name="rlhf-agents").start()

    def _run(self) -> None:
        self.loop.create_task(self._tick())
        self.loop.run_forever()

    async def _tick(self) -> None:
        while True:
            self.ticked = time.monotonic()
            await asyncio.sleep(self.TICK_S)

    def stalled_s(self) -> float:
        """Seconds since the loop last ran: an agent is blocking it when this grows past a tick."""
        return time.monotonic() - self.ticked

    def submit(self, coroutine: Coroutine) -> Future:
        """Run ``coroutine`` on the loop; its outcome as a thread-safe future."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def close(self) -> None:
        """Cancel what runs on the loop and stop it once it is free (a blocked one stays blocked, in its daemon thread,
        until its agent returns)."""
        self.loop.call_soon_threadsafe(self._stop)

    def _stop(self) -> None:
        for task in asyncio.all_tasks(self.loop):
            task.cancel()
        self.loop.call_soon(self.loop.stop)  # after the cancelled tasks have taken their cancellation


def overdue(session: Session, now: float, waiting: bool, step_timeout_s: float, episode_timeout_s: float) -> str | None:
    """Why the running ``session`` is lost at ``now`` (monotonic seconds), or None: past its episode's wall time
    (`env.episode_timeout_s`, from its agent's start), or quiet for `env.step_timeout_s` while not ``waiting`` for a
    reply."""
    if now - session.started > episode_timeout_s:
        return (f"timed out: the episode ran past env.episode_timeout_s={episode_timeout_s:g} s (its agent's whole run, "
                f"waits for replies included); end run() sooner, or raise env.episode_timeout_s")
    if not waiting and now - session.active > step_timeout_s:
        return (f"timed out: no request, reply or reward for env.step_timeout_s={step_timeout_s:g} s (an async run() that "
                f"blocks the event loop, time.sleep instead of await asyncio.sleep, stalls every agent)")
    return None


def blocked_error(stalled_s: float) -> str:
    """Why the episodes on an agents' loop blocked for ``stalled_s`` seconds are lost."""
    return (f"timed out: the agents' event loop was blocked for {stalled_s:.0f} s (past env.step_timeout_s) by an async "
            f"run() that does not await: time.sleep or other blocking calls instead of await asyncio.sleep; make them "
            f"awaitable, or write a plain def run (it runs in a thread of its own)")


def no_reply_error(session: Session, max_tokens: int) -> str:
    """Why ``session`` has no reply to train on: its requests did not fit `env.max_tokens`, or it made none."""
    if session.unfit is None:
        return "the agent asked the endpoint for nothing: no reply to train on"
    return (
        f"no room for a reply: the agent's request rendered to {session.unfit} tokens, which fills env.max_tokens="
        f"{max_tokens} (tokens per episode, prompt included), so it was answered with an empty reply (finish_reason "
        f"length); raise env.max_tokens above {session.unfit} plus the reply tokens wanted"
    )


def error_kind(error: str) -> str:
    """The `env/*` count an episode lost for ``error`` adds to."""
    if error.startswith("timed out"):
        return "env/timed_out_episodes"
    if error.startswith("over budget"):
        return "env/over_budget_episodes"
    if error.startswith("no reward") or error.startswith("run returned"):
        return "env/no_reward_episodes"
    return "env/raised_episodes"
