"""Checks of `generator.*` and `schedule.*` that need no model: engine counts, memory shares, schedule needs."""

from __future__ import annotations

from omegaconf import DictConfig

from rlhf.errors import require as _require
from rlhf.registry import schedule_trait


def _colocated(cfg, a: str, b: str) -> bool:
    return any(a in group and b in group for group in cfg.cluster.colocate)


def check_generation(cfg: DictConfig, ranks: dict[str, int]) -> None:
    """Raise ConfigError naming the key and the fix; ``ranks`` are the ranks per role from `validate_cluster`."""
    gen, schedule, backend = cfg.generator, cfg.schedule, cfg.cluster.backend
    _require(gen.num_engines >= 1, f"generator.num_engines={gen.num_engines} must be >= 1")
    _require(gen.tensor_parallel_size >= 1, f"generator.tensor_parallel_size={gen.tensor_parallel_size} must be >= 1")
    _require(0 < gen.gpu_memory_utilization <= 1, f"generator.gpu_memory_utilization={gen.gpu_memory_utilization} must be in (0, 1]")
    _require(
        gen.kv_cache_memory_bytes is None or gen.kv_cache_memory_bytes > 0,
        f"generator.kv_cache_memory_bytes={gen.kv_cache_memory_bytes} must be > 0 or null",
    )
    longest = cfg.dataset.max_prompt_length + gen.max_new_tokens
    _require(
        gen.max_model_len is None or gen.max_model_len >= longest,
        f"generator.max_model_len={gen.max_model_len} is shorter than dataset.max_prompt_length + generator.max_new_tokens "
        f"= {longest}; raise it or set it to null",
    )
    if gen.name == "vllm":
        if backend == "local":
            _require(
                cfg.cluster.device in ("auto", "cpu", "cuda", "cuda:0"),
                f"cluster.device={cfg.cluster.device}: vLLM always starts on the first visible GPU; select the GPU with "
                f"CUDA_VISIBLE_DEVICES and set cluster.device=cuda",
            )
            _require(
                gen.num_engines == 1,
                f"generator.num_engines={gen.num_engines}: the local backend runs one engine; use cluster=ray_local (or ray) "
                f"with cluster.roles.generator giving one rank per engine",
            )
        else:
            _require(
                gen.num_engines == ranks["generator"],
                f"generator.num_engines={gen.num_engines} but cluster.roles.generator has {ranks['generator']} ranks; "
                f"each engine is one generator rank, so make them equal",
            )
            _require(
                gen.tensor_parallel_size == 1,
                f"generator.tensor_parallel_size={gen.tensor_parallel_size}: on cluster.backend=ray every engine is one "
                f"rank on one device for now; raise generator.num_engines instead, or use the local backend",
            )
    _require(schedule.max_staleness >= 0, f"schedule.max_staleness={schedule.max_staleness} must be >= 0")
    if schedule_trait(schedule, "sleeps_generator"):
        _require(
            gen.name != "vllm" or gen.enable_sleep,
            f"schedule={schedule.name} puts the generator to sleep while training; set generator.enable_sleep=true",
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
