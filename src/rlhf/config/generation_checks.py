"""Checks that span the generator, the schedule and the cluster, before any model loads (each part checks its own keys)."""

from __future__ import annotations

from rlhf.errors import require as _require
from rlhf.generators.base import sleep_overrides
from rlhf.config.spec import RunSpec
from rlhf.registry import schedule_trait


def _colocated(cfg, a: str, b: str) -> bool:
    return any(a in group and b in group for group in cfg.cluster.colocate)


def check_generation(spec: RunSpec, ranks: dict[str, int]) -> None:
    """Raise ConfigError naming the key and the fix; ``spec`` is the run, ``ranks`` the ranks per role from
    `validate_cluster`. The generator and the schedule check their own fit with the run (`check_run`); what spans
    them is checked here."""
    cfg, generator, schedule_part = spec.config, spec.generator, spec.schedule
    gen, schedule, backend = cfg.generator, cfg.schedule, cfg.cluster.backend
    check_run = generator.trait("check_run")
    if check_run is not None:
        check_run(generator.config, cfg, ranks)
    schedule_check = schedule_part.trait("check_run")
    if schedule_check is not None:
        schedule_check(schedule_part.config, spec)
    if schedule_trait(schedule, "sleeps_generator"):
        needed = sleep_overrides(generator.obj, generator.config)
        _require(
            needed == [],
            f"schedule={schedule.name} puts the generator to sleep while training; "
            + (f"set {' '.join(needed)}" if needed else f"generator={gen.name} cannot sleep (it has no `sleep`): use schedule=sync"),
        )
        _require(
            backend == "local" or _colocated(cfg, "policy", "generator"),
            f"schedule={schedule.name} shares the policy's devices with the generator: add both to one cluster.colocate group, "
            "e.g. cluster.colocate=[[policy,generator,reference]]",
        )
    if schedule_trait(schedule, "overlaps_generation"):
        _require(
            not (backend == "ray" and _colocated(cfg, "policy", "generator")),
            f"schedule={schedule.name} overlaps generation with training, but cluster.colocate puts the generator on the policy's "
            "devices; give the generator its own devices, or use schedule=hybrid",
        )
