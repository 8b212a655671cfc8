"""How far one RL step travels through the code: the `rlhf` files a sync GRPO step enters, and its calls between them.

    python bench/step_shape.py                 # the default run's config
    python bench/step_shape.py algorithm=ppo   # any overrides

Builds the run's components, takes one warm-up step, then traces the next one (`sys.setprofile`) and prints the
files entered and the distinct (caller function -> callee function) calls that cross a file boundary, both counted
over `src/rlhf` only (torch, transformers and the standard library are not counted), split into the files that call
into another file and the leaves (pure math, rule functions, small helpers: called, calling no other file). A reader following one step opens every file listed.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

from rlhf.run.build import build_components
from rlhf.config import compose_config, validate
from rlhf.run.state import RunState
from rlhf.schedules.sync import train_step
from rlhf.seeding import seed_everything

PACKAGE = Path(__import__("rlhf").__file__).resolve().parent


def package_file(code) -> str | None:
    """``code``'s file relative to the package, or None outside it."""
    path = Path(code.co_filename)
    return str(path.resolve().relative_to(PACKAGE)) if path.is_absolute() and path.resolve().is_relative_to(PACKAGE) else None


def trace(fn) -> tuple[Counter, set]:
    """(calls entered per file, distinct cross-file (caller file:function, callee file:function) pairs) of ``fn()``."""
    entered: Counter = Counter()
    crossings: set = set()

    def profile(frame, event, arg):
        if event != "call":
            return
        callee = package_file(frame.f_code)
        if callee is None:
            return
        entered[callee] += 1
        caller = frame.f_back
        while caller is not None and package_file(caller.f_code) is None:
            caller = caller.f_back  # through torch or the standard library, back to the package's own frame
        if caller is not None and (source := package_file(caller.f_code)) != callee:
            crossings.add((f"{source}:{caller.f_code.co_name}", f"{callee}:{frame.f_code.co_name}"))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return entered, crossings


def main(overrides: list[str]) -> None:
    cfg = compose_config(overrides)
    seed_everything(cfg.seed)
    c = build_components(validate(cfg))
    state = RunState()
    try:
        train_step(c.collector, c.learner, state.guard)  # warm-up: lazy imports and first-call set-up are not the step
        entered, crossings = trace(lambda: train_step(c.collector, c.learner, state.guard))
    finally:
        c.close()
    print(f"files entered by one sync step: {len(entered)}")
    for name, calls in sorted(entered.items(), key=lambda item: -item[1]):
        print(f"  {name:<36} {calls:>7} calls")
    pairs = {(a.split(':')[0], b.split(':')[0]) for a, b in crossings}
    callers = {caller for caller, _ in pairs}
    print(f"  of which {len(callers)} call into another file: {', '.join(sorted(callers))}")
    print(f"  and {len(entered) - len(callers)} are leaves (called, calling no other file of the package)")
    print(f"cross-file calls (distinct caller -> callee functions): {len(crossings)}, between {len(pairs)} file pairs")
    for caller, callee in sorted(crossings):
        print(f"  {caller} -> {callee}")


if __name__ == "__main__":
    main(sys.argv[1:])
