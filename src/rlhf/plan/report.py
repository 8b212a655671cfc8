"""The plan as text: a table per device group, the phase totals, the verdict and the changes that make it fit."""

from __future__ import annotations

from rlhf.plan.memory import PHASES, gib, host_bytes
from rlhf.plan.planner import DeviceGroup, Plan
from rlhf.generators.memory import ENGINE_SHARE

COLUMNS = {  # column -> the Item.what values it sums
    "weights": ("weights",),
    "grads": ("gradients", "gradient buckets"),
    "optimizer": ("optimizer",),
    "activations": ("activations", "backward temporaries", "gathered weights"),
    "generation": ("kv_cache", "logits", ENGINE_SHARE, "merged weights"),  # merged: a LoRA push, made before generating
    "scoring": ("scoring temporaries",),
    "other": ("CUDA context", "process (python, torch, libraries)"),
}
ROLE_WIDTH = 10
WIDTH = 12


def render(plan: Plan, advice: list[str] | None = None) -> str:
    """The whole plan: every device group, the capacity, the verdict, and ``advice`` lines when it does not fit."""
    unit = "MiB" if max(plan.needed(g) for g in plan.groups) < 2**30 else "GiB"
    lines = [f"memory plan, {unit} per device (from config.json only, no weights loaded; {plan.kind})"]
    for group in plan.groups:
        lines += [""] + group_table(group, unit)
    lines += ["", capacity_line(plan)]
    lines += verdict_lines(plan, advice or [])
    return "\n".join(lines)


def amount(n: int, unit: str) -> str:
    """``n`` bytes in the table's unit."""
    return gib(n) if unit == "GiB" else f"{n / 2**20:.1f}"


def group_table(group: DeviceGroup, unit: str = "GiB") -> list[str]:
    """One device group's table: a row per role, a column per kind of memory, then the phase totals."""
    title = f"{group.count} device(s) holding {' + '.join(group.roles)}:"
    header = "role".ljust(ROLE_WIDTH) + "".join(name.rjust(WIDTH) for name in COLUMNS) + "on host".rjust(WIDTH)
    rows = [title, "  " + header]
    for role in dict.fromkeys(i.role for i in group.items):
        mine = [i for i in group.items if i.role == role]
        cells = [sum(i.bytes for i in mine if i.what in whats and not i.on_host) for whats in COLUMNS.values()]
        cells.append(host_bytes(mine))
        rows.append("  " + role.ljust(ROLE_WIDTH) + "".join((amount(c, unit) if c else "-").rjust(WIDTH) for c in cells))
    totals = {phase: sum(i.bytes for i in group.items if phase in i.phases and not i.on_host) for phase in PHASES}
    peak, phase = group.peak
    rows.append("  phases: " + ", ".join(f"{p} {amount(totals[p], unit)}" for p in PHASES)
                + f"; peak {amount(peak, unit)} ({phase})")
    return rows


def capacity_line(plan: Plan) -> str:
    cap = plan.capacity
    if cap.bytes is None:
        return f"capacity: {cap.source}"
    shared = " (shared by every process of this machine)" if cap.shared else ""
    return (f"capacity: {gib(cap.bytes)} GiB per device{shared} ({cap.source}); usable {gib(plan.usable)} "
            f"with plan.headroom={plan.headroom:g}")


def verdict_lines(plan: Plan, advice: list[str]) -> list[str]:
    fits = plan.fits
    if fits is None:
        return ["verdict: unknown (no capacity to compare with)"]
    needed = plan.needed(plan.worst)
    if fits:
        return [f"verdict: fits ({gib(needed)} of {gib(plan.usable)} GiB usable on the fullest device)"]
    lines = [f"verdict: does NOT fit: {' + '.join(plan.worst.roles)} needs {gib(needed)} GiB, {gib(plan.usable)} usable"]
    if advice:
        lines.append("changes that make it fit, cheapest first:")
        lines += [f"  {line}" for line in advice]
    else:
        lines.append("no single change found makes it fit: use more devices, a smaller model or shorter sequences")
    return lines
