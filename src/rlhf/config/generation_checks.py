"""Checks that span the generator, the schedule and the cluster, before any model loads (each part checks its own keys)."""

from __future__ import annotations

from omegaconf import DictConfig

from rlhf.errors import require as _require
from rlhf.generators.base import sleep_overrides
from rlhf.parts import Part
from rlhf.registry import schedule_trait


def _colocated(cfg, a: str, b: str) -> bool:
    return any(a in group and b in group for group in cfg.cluster.colocate)


def check_generation(cfg: DictConfig, ranks: dict[str, int], generator: Part, schedule_part: Part) -> None:
    """Raise ConfigError naming the key and the fix; ``ranks`` are the ranks per role from `validate_cluster`,
    ``generator`` and ``schedule_part`` the chosen parts. The generator checks its own fit with the run (`check_run`);
    what spans it and the schedule is checked here."""
    gen, schedule, backend = cfg.generator, cfg.schedule, cfg.cluster.backend
    check_run = generator.trait("check_run")
    if check_run is not None:
        check_run(generator.config, cfg, ranks)
    schedule_check = schedule_part.trait("check_run")
    if schedule_check is not None:
        schedule_check(schedule_part.config, cfg)
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
