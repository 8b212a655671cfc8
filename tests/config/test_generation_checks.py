"""Config checks of the generator and schedule keys, and the one-override switch between generator backends."""

from __future__ import annotations

import pytest

from rlhf.config import ConfigError, validate
from rlhf.config.compose import compose_config

SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p", "stop_token")


@pytest.mark.parametrize("experiment", [None, "grpo_arith_qwen2_5_0_5b", "ppo_tldr_pythia1b"])
def test_switching_to_vllm_changes_the_backend_and_nothing_else(experiment):
    """`generator=vllm` keeps every sampling setting, the experiment's included."""
    base = [f"experiment={experiment}"] if experiment else []
    hf, vllm = compose_config([*base, "generator=hf"]), compose_config([*base, "generator=vllm"])
    assert hf.generator.name == "hf" and vllm.generator.name == "vllm"
    for key in SAMPLING_KEYS:
        assert vllm.generator[key] == hf.generator[key], key


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["generator=vllm", "generator.num_engines=2"], r"generator.num_engines=2: the local backend runs one engine"),
        (["generator=vllm", "cluster=ray_local", "generator.num_engines=2"], r"cluster.roles.generator has 1 ranks"),
        (["generator=vllm", "cluster=ray_local", "generator.tensor_parallel_size=2"], r"tensor_parallel_size=2: on cluster.backend=ray"),
        (["generator=vllm", "generator.gpu_memory_utilization=1.5"], r"generator.gpu_memory_utilization=1.5 must be in \(0, 1\]"),
        (["generator=vllm", "generator.kv_cache_memory_bytes=0"], r"generator.kv_cache_memory_bytes=0 must be > 0"),
        (["generator=vllm", "generator.max_model_len=16"], r"generator.max_model_len=16 is shorter than dataset.max_prompt_length \+ generator.max_new_tokens = 20"),
        (["schedule=async", "schedule.max_staleness=-1"], r"schedule.max_staleness=-1 must be >= 0"),
        (["generator=vllm", "cluster.device=cuda:1"], r"cluster.device=cuda:1: vLLM always starts on the first visible GPU"),
        (["schedule=hybrid", "generator=vllm"], r"schedule=hybrid puts the generator to sleep while training; set generator.enable_sleep=true"),
        (["schedule=hybrid", "cluster=ray_local"], r"schedule=hybrid shares the policy's devices with the generator"),
        (
            ["schedule=async", "cluster=ray_local", "cluster.roles.generator.devices_per_node=2", "cluster.colocate=[[policy,reference,generator]]"],
            r"schedule=async overlaps generation with training, but cluster.colocate puts the generator on the policy's devices",
        ),
    ],
)
def test_bad_generation_settings_fail_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose_config(overrides))


def test_good_generation_settings_validate():
    for overrides in (
        ["generator=vllm", "schedule=async", "algorithm/rollout_correction=token_tis"],
        ["generator=vllm", "generator.enable_sleep=true", "schedule=hybrid", "schedule.offload_optimizer=true"],
        ["generator=vllm", "cluster=ray_local"],
        ["schedule=hybrid", "cluster=ray_local", "cluster.roles.generator.devices_per_node=2", "cluster.colocate=[[policy,reference,generator]]"],
    ):
        validate(compose_config(overrides))


SLEEPING_SCHEDULE = '''
from rlhf.schedules.hybrid import run as hybrid


def run(c, cfg, sizes, tracker, state, stop):
    return hybrid(c, cfg, sizes, tracker, state, stop)


run.sleeps_generator = True  # what the checks ask, not the schedule's name
'''


def test_a_users_schedule_gets_the_checks_of_the_traits_it_declares(tmp_path, monkeypatch):
    """A schedule named by import path that declares `sleeps_generator` is checked as hybrid is; one that declares
    nothing is checked as sync is."""
    (tmp_path / "my_schedules.py").write_text(SLEEPING_SCHEDULE + "\n\ndef plain(*args):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"schedule=my_schedules.run shares the policy's devices with the generator"):
        validate(compose_config(["schedule.name=my_schedules.run", "cluster=ray_local"]))
    validate(compose_config(["schedule.name=my_schedules.plain", "cluster=ray_local"]))


def test_vllm_on_the_cpu_with_heads_too_narrow_for_its_kernels_is_refused_at_validation(tmp_path, save_llama):
    """head_dim 16 (64 wide, 4 heads): vLLM's CPU engine would fail after starting; refused before, naming the width."""
    from rlhf.config import ConfigError, compose_config, validate

    narrow = save_llama(tmp_path / "narrow", seed=0, num_attention_heads=4, head_dim=16)
    cfg = compose_config(["generator=vllm", f"model.name_or_path={narrow}", "cluster.device=cpu"])
    with pytest.raises(ConfigError, match=r"generator=vllm on the CPU: .* has attention heads of 16 dimensions, and "
                                          r"vLLM's CPU attention kernels need at least 32; use generator=hf"):
        validate(cfg)
    validate(compose_config(["generator=vllm", "cluster.device=cpu"]))  # the built-in model's heads are 32 wide
