"""Plan before launch: will this run fit its devices? Memory per role and per device, from config.json files alone.

`python -m rlhf.plan <overrides>` prints the plan; `rlhf.train` runs `check` after composing the config and
before loading any weights, and refuses a run that cannot fit (`plan.enforce=false` warns instead).
"""

from __future__ import annotations

import logging

from rlhf.errors import ConfigError
from rlhf.plan.advice import advise
from rlhf.plan.memory import gib
from rlhf.config.spec import RunSpec
from rlhf.plan.planner import Plan, make_plan, plan_of
from rlhf.plan.report import render

log = logging.getLogger("rlhf")

__all__ = ["Plan", "check", "make_plan", "plan_of", "render"]


def check(spec: RunSpec) -> Plan | None:
    """Plan the run ``spec``; ConfigError with the table and the changes that fit when it cannot fit and
    `plan.enforce`.

    A plan that cannot be made for reasons of its own (an architecture the tracer cannot run) is logged and
    skipped: the estimate must never be what stops a run that would fit."""
    try:
        plan = plan_of(spec)
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 -- see the docstring
        log.warning("memory plan skipped: %s: %s", type(err).__name__, err)
        return None
    if plan.fits is False:
        text = render(plan, advise(plan))
        if spec.plan.enforce:
            raise ConfigError(f"this run does not fit its devices (plan.enforce=false starts it anyway):\n{text}")
        log.warning("plan.enforce=false: starting a run the plan says cannot fit:\n%s", text)
        return plan
    needed = plan.needed(plan.worst)
    room = f"of {gib(plan.usable)} usable" if plan.usable else "(capacity unknown)"
    log.info("memory plan: %s GiB (%d MiB) %s on the fullest device (python -m rlhf.plan <overrides> prints the "
             "table)", gib(needed), needed // 2**20, room)
    return plan
