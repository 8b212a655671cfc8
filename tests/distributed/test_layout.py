"""Cluster layout, strategy checks and the pure helpers of the Ray backend: no Ray, no GPU, no models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from rlhf.config import ConfigError, compose_config, validate
from rlhf.config.schema import ClusterConfig, RoleConfig, RolesConfig, TrainConfig
from rlhf.algorithms import build_algorithm
from rlhf.distributed.layout import (
    PlacementSpec,
    bundle_resources,
    check_fits,
    placement_specs,
    used_roles,
    validate_cluster,
)
from rlhf.distributed.remote import even_slices
from rlhf.training.strategies import DeepSpeedConfig, deepspeed_config

PRESETS = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "conf" / "cluster").glob("*.yaml"))
# 8gpu_split trains on 7 ranks, which must divide the samples per step: 14 prompts x 8 (grpo) or x 4 (ppo)
SEVEN_RANKS = ["train.prompts_per_step=14", "train.micro_batch_size=56"]
REWARD_MODEL = ["reward=model", "reward.path=anything"]  # reward.path is only opened at build time


def algorithm_of(cfg):
    return build_algorithm(cfg.algorithm, cfg.generator.max_new_tokens)


def roles_of(cfg) -> list[str]:
    return used_roles(cfg, algorithm_of(cfg))


def specs_of(overrides: list[str]) -> list[tuple[tuple[str, ...], int, int]]:
    cfg = compose_config(overrides)
    validate(cfg)
    return [(s.roles, s.num_nodes, s.devices_per_node) for s in placement_specs(cfg.cluster, roles_of(cfg))]


def ray_cluster(device_type: str = "gpu", colocate=(), address=None, cpus_per_gpu: int = 4, **roles):
    shapes = {name: RoleConfig(*shape) for name, shape in roles.items()}
    return OmegaConf.structured(ClusterConfig(
        backend="ray", device_type=device_type, cpus_per_gpu=cpus_per_gpu, address=address,
        roles=RolesConfig(**shapes), colocate=[list(g) for g in colocate],
    ))


# ---- presets ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", [[], ["algorithm=ppo"], ["algorithm=ppo", *REWARD_MODEL]])
@pytest.mark.parametrize("preset", PRESETS)
def test_every_cluster_preset_composes_and_validates_without_a_gpu(preset, algorithm):
    extra = SEVEN_RANKS if preset == "8gpu_split" else []
    cfg = compose_config([f"cluster={preset}", *algorithm, *extra])
    assert cfg.cluster.name == preset
    validate(cfg)  # pure: the GPU presets validate on a CPU-only machine


def test_8gpu_split_with_a_batch_seven_ranks_cannot_share_names_the_keys():
    """open-instruct's 7 training GPUs (its 8-GPU PPO run) do not divide the default 16 x 8 = 128 samples: a clear error, not a hang."""
    with pytest.raises(ConfigError, match=r"cluster.roles.policy has 7 training ranks, which must divide the 128 samples"):
        validate(compose_config(["cluster=8gpu_split"]))


def test_multinode_70b_places_47_ranks_each_role_on_its_own():
    specs = specs_of(["cluster=multinode_70b", "algorithm=ppo", *REWARD_MODEL])
    assert specs == [(("policy",), 4, 8), (("reference",), 1, 8), (("critic",), 1, 4), (("reward",), 1, 1), (("generator",), 1, 2)]
    assert sum(n * d for _, n, d in specs) == 47


def test_8gpu_split_is_seven_colocated_gpus_and_one_generator():
    assert specs_of(["cluster=8gpu_split", "algorithm=ppo", *REWARD_MODEL, *SEVEN_RANKS]) == [
        (("policy", "reference", "critic", "reward"), 1, 7), (("generator",), 1, 1)]
    assert specs_of(["cluster=8gpu_split", *SEVEN_RANKS]) == [(("policy", "reference"), 1, 7), (("generator",), 1, 1)]


def test_single_gpu_and_8gpu_colocated_are_one_group_of_the_used_roles():
    assert specs_of(["cluster=single_gpu"]) == [(("policy", "reference", "generator"), 1, 1)]
    assert specs_of(["cluster=single_gpu", "algorithm=ppo", *REWARD_MODEL]) == [
        (("policy", "reference", "critic", "reward", "generator"), 1, 1)]
    assert specs_of(["cluster=8gpu_colocated", "algorithm=ppo"]) == [(("policy", "reference", "critic", "generator"), 1, 8)]


def test_ray_local_groups_and_ranks():
    cfg = compose_config(["cluster=ray_local", "algorithm=ppo", *REWARD_MODEL])
    validate(cfg)
    algorithm = algorithm_of(cfg)
    assert validate_cluster(cfg, algorithm, 64, 64) == {"policy": 2, "reference": 2, "critic": 2, "reward": 2, "generator": 1}
    assert [s.describe() for s in placement_specs(cfg.cluster, roles_of(cfg))] == [
        "policy+reference: 1 node(s) x 2 = 2", "critic+reward: 1 node(s) x 2 = 2", "generator: 1 node(s) x 1 = 1"]


def test_local_backend_is_one_rank_per_role():
    # role shapes and colocation are ray-only keys: on backend=local the ownership check refuses them
    cfg = compose_config([])
    validate(cfg)
    algorithm = algorithm_of(cfg)
    assert validate_cluster(cfg, algorithm, 128, 128) == {"policy": 1, "reference": 1, "generator": 1}


# ---- used_roles --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, roles", [
    ([], ["policy", "reference", "generator"]),
    (["algorithm.beta=0"], ["policy", "generator"]),
    (["algorithm=ppo"], ["policy", "reference", "critic", "generator"]),
    (["algorithm=ppo", "algorithm.beta=0"], ["policy", "critic", "generator"]),
    (REWARD_MODEL, ["policy", "reference", "reward", "generator"]),
    (["algorithm=ppo", *REWARD_MODEL], ["policy", "reference", "critic", "reward", "generator"]),
    (["algorithm=online_dpo"], ["policy", "reference", "generator"]),
])
def test_used_roles(overrides, roles):
    assert roles_of(compose_config(overrides)) == roles


# ---- placement_specs ---------------------------------------------------------------------------------------


def test_placement_specs_rejects_an_unknown_role():
    cluster = ray_cluster(colocate=[["policy", "reference"], ["critic", "value"]])
    with pytest.raises(ConfigError, match=r"cluster.colocate\[1\] names 'value'; roles are policy, reference, teacher, critic, reward, generator"):
        placement_specs(cluster, ["policy", "reference", "generator"])


def test_placement_specs_rejects_a_role_in_two_groups():
    cluster = ray_cluster(colocate=[["policy", "reference"], ["generator", "reference"]])
    with pytest.raises(ConfigError, match="cluster.colocate lists 'reference' in groups 0 and 1"):
        placement_specs(cluster, ["policy", "reference", "generator"])


def test_placement_specs_rejects_colocated_roles_of_different_shapes():
    cluster = ray_cluster(colocate=[["policy", "reference", "critic"]], policy=(2, 4), reference=(2, 4), critic=(1, 4))
    with pytest.raises(ConfigError) as err:
        placement_specs(cluster, ["policy", "reference", "critic", "generator"])
    assert "cluster.colocate groups policy+reference+critic" in str(err.value)
    assert "(got policy 2x4, reference 2x4, critic 1x4)" in str(err.value)


def test_placement_specs_ignores_unused_roles_and_keeps_the_rest_alone():
    # critic differs in shape but is unused (grpo): no error, and the group shrinks to the used roles
    cluster = ray_cluster(colocate=[["policy", "critic"], ["reward"]], policy=(1, 2), critic=(1, 3), generator=(1, 1))
    specs = placement_specs(cluster, ["policy", "reference", "generator"])
    assert specs == [PlacementSpec(("policy",), 1, 2), PlacementSpec(("reference",), 1, 1), PlacementSpec(("generator",), 1, 1)]
    assert [s.ranks for s in specs] == [2, 1, 1]


# ---- check_fits ----------------------------------------------------------------------------------------------


SPLIT = [PlacementSpec(("policy", "reference"), 1, 7), PlacementSpec(("generator",), 1, 1)]


def test_bundle_resources():
    assert bundle_resources(ray_cluster("gpu", cpus_per_gpu=4)) == {"GPU": 1.0, "CPU": 4.0}
    assert bundle_resources(ray_cluster("cpu", cpus_per_gpu=4)) == {"CPU": 1.0}


def test_check_fits_passes_an_exact_fit():
    check_fits(SPLIT, ray_cluster(), {"GPU": 8.0, "CPU": 32.0}, [{"GPU": 8.0, "CPU": 32.0}])


def test_check_fits_names_the_gpus_needed_and_offered():
    with pytest.raises(ConfigError) as err:
        check_fits(SPLIT, ray_cluster(), {"GPU": 6.0, "CPU": 64.0}, [{"GPU": 6.0, "CPU": 64.0}])
    msg = str(err.value)
    assert "the placement needs 8 GPU" in msg and "offers 6" in msg
    assert "policy+reference: 1 node(s) x 7 = 7; generator: 1 node(s) x 1 = 1" in msg
    assert "num_cpus" not in msg


def test_check_fits_names_the_cpus_needed_and_offered():
    # 8 bundles x 4 CPUs = 32 CPUs beside the GPUs
    with pytest.raises(ConfigError, match=r"needs 32 CPU .*x4 CPU each.* offers 20; .*\(or raise cluster.num_cpus\)"):
        check_fits(SPLIT, ray_cluster(), {"GPU": 8.0, "CPU": 20.0}, [{"GPU": 8.0, "CPU": 20.0}])
    with pytest.raises(ConfigError) as err:  # a joined cluster has no num_cpus to raise
        check_fits(SPLIT, ray_cluster(address="auto"), {"GPU": 8.0, "CPU": 20.0}, [{"GPU": 8.0, "CPU": 20.0}])
    assert "needs 32 CPU" in str(err.value) and "num_cpus" not in str(err.value)


def test_check_fits_cpu_slots():
    cluster = ray_cluster("cpu")
    specs = [PlacementSpec(("policy", "reference"), 1, 2), PlacementSpec(("critic", "reward"), 1, 2), PlacementSpec(("generator",), 1, 1)]
    check_fits(specs, cluster, {"CPU": 5.0}, [{"CPU": 5.0}])
    with pytest.raises(ConfigError, match="needs 5 CPU .* offers 4"):
        check_fits(specs, cluster, {"CPU": 4.0}, [{"CPU": 4.0}])


def test_check_fits_rejects_more_devices_per_node_than_the_largest_node():
    specs = [PlacementSpec(("policy",), 1, 8)]
    nodes = [{"GPU": 4.0, "CPU": 64.0}] * 4
    with pytest.raises(ConfigError, match="policy: 1 node\\(s\\) x 8 = 8: 8 devices per node x 1 GPU exceed the largest node's 4 GPU"):
        check_fits(specs, ray_cluster(), {"GPU": 16.0, "CPU": 256.0}, nodes)


def test_check_fits_rejects_more_nodes_than_have_a_device():
    specs = [PlacementSpec(("policy",), 3, 2)]
    nodes = [{"GPU": 8.0, "CPU": 64.0}, {"GPU": 8.0, "CPU": 64.0}, {"CPU": 64.0}]  # a CPU-only head node
    with pytest.raises(ConfigError, match="spans 3 nodes but only 2 node\\(s\\) have a free GPU"):
        check_fits(specs, ray_cluster(), {"GPU": 16.0, "CPU": 192.0}, nodes)
    check_fits([PlacementSpec(("policy",), 2, 2)], ray_cluster(), {"GPU": 16.0, "CPU": 192.0}, nodes)


# ---- validate: strategies and cluster keys -----------------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    (["policy/strategy=ddp"], r"policy/strategy=ddp runs one process per device, which the run starts as Ray actors \(not torchrun\): it needs cluster.backend=ray"),
    (["policy/strategy=fsdp2"], "it needs cluster.backend=ray"),
    (["cluster=ray_local", "policy/strategy=single"],
     "policy/strategy=single trains on one device but cluster.roles.policy has 2 ranks"),
    (["policy.strategy.name=megatron"], r"unknown strategy 'megatron' \(config key `policy.strategy.name`\). Registered: auto, ddp, deepspeed, fsdp2, single"),
    (["algorithm=ppo", "critic.strategy.name=megatron"], "config key `critic.strategy.name`"),
    (["algorithm=ppo", "cluster=ray_local", "critic/strategy=single"], "cluster.roles.critic has 2 ranks"),
    (["cluster=ray_local", "policy/strategy=deepspeed", "policy.strategy.zero_stage=4"],
     "policy.strategy.zero_stage=4 must be 1, 2 or 3"),
    (["cluster=ray_local", "policy/strategy=deepspeed", "policy.strategy.zero_stage=0"],
     r"policy.strategy.zero_stage=0 must be 1, 2 or 3 \(for plain data parallelism choose policy/strategy=ddp\)"),
    (["cluster=ray_local", "policy/strategy=deepspeed", "policy.strategy.offload_params=true"],
     r"policy.strategy.offload_params needs policy.strategy.zero_stage=3 \(got 2\)"),
    (["cluster=ray_local", "cluster.colocate=[]", "cluster.roles.policy.devices_per_node=3"],
     "cluster.roles.policy has 3 training ranks, which must divide the 128 samples per step and the 128 units"),
    (["cluster=ray_local", "cluster.roles.policy.devices_per_node=3", "cluster.roles.reference.devices_per_node=3"],
     r"cluster.roles.policy has 3 training ranks.*give cluster.roles.policy a number of ranks \(num_nodes x "
     r"devices_per_node\) that divides both, or make both multiples of 3"),
    (["cluster=ray_local", "cluster.object_store_memory=1000"],
     r"cluster.object_store_memory=1000 is under Ray's minimum of 78643200 bytes \(75 MiB\)"),
    (["cluster=ray_local", "train.num_mini_batches=128"], "must divide the 128 samples per step and the 1 units of a mini batch"),
    (["cluster=ray_local", "algorithm=ppo", "cluster.colocate=[]", "cluster.roles.critic.devices_per_node=3"],
     "cluster.roles.critic has 3 training ranks, which must divide the 64 samples per step"),
    (["cluster=ray_local", "cluster.roles.policy.devices_per_node=4"],
     r"cluster.colocate groups policy\+reference, .*\(got policy 1x4, reference 1x2\)"),
    (["cluster=ray_local", "cluster.colocate=[[policy],[reference,policy]]"], "cluster.colocate lists 'policy' in groups 0 and 1"),
    (["cluster.backend=slurm"], "cluster.backend='slurm'; choose local or ray"),
    (["cluster=ray_local", "cluster.device_type=tpu"], "cluster.device_type='tpu'; choose gpu or cpu"),
    (["cluster=ray_local", "cluster.roles.policy.num_nodes=0"],
     "cluster.roles.policy: num_nodes=0 and devices_per_node=2 must be >= 1"),
    (["cluster=ray_local", "cluster.roles.reward.devices_per_node=0"],  # checked even for an unused role
     "cluster.roles.reward: num_nodes=1 and devices_per_node=0 must be >= 1"),
    (["cluster=ray_local", "cluster.timeout_s=0"], "cluster.timeout_s=0.0 and cluster.placement_timeout_s=60.0 must be > 0"),
    (["cluster=ray_local", "cluster.setup_timeout_s=0"], r"cluster.setup_timeout_s=0.0 must be > 0"),
])
def test_validate_rejects(overrides, message):
    cfg = compose_config(overrides)
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


@pytest.mark.parametrize("overrides", [
    ["policy/strategy=single"],
    ["cluster=single_gpu", "policy/strategy=single"],
    ["cluster=ray_local", "policy/strategy=ddp"],
    ["cluster=ray_local", "policy/strategy=fsdp2", "policy.strategy.offload_params=true", "policy.strategy.offload_optimizer=true"],
    ["cluster=ray_local", "policy/strategy=deepspeed", "policy.strategy.zero_stage=3", "policy.strategy.offload_params=true"],
    ["cluster=ray_local", "policy/strategy=deepspeed", "policy.strategy.zero_stage=1", "policy.strategy.offload_optimizer=true"],
    ["cluster=ray_local", "cluster.colocate=[]", "cluster.roles.policy.devices_per_node=4"],
])
def test_validate_accepts(overrides):
    validate(compose_config(overrides))


# ---- even_slices ---------------------------------------------------------------------------------------------------


def test_even_slices_exact():
    assert even_slices(5, 3) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    assert even_slices(2, 4) == [slice(0, 1), slice(1, 2), slice(2, 2), slice(2, 2)]
    assert even_slices(0, 2) == [slice(0, 0), slice(0, 0)]


@pytest.mark.parametrize("n", [0, 1, 2, 7, 8, 13, 64])
@pytest.mark.parametrize("parts", [1, 2, 3, 7, 8, 20])
def test_even_slices_cover_the_range_evenly(n, parts):
    slices = even_slices(n, parts)
    assert len(slices) == parts
    sizes = [sl.stop - sl.start for sl in slices]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 0
    assert [i for sl in slices for i in range(n)[sl]] == list(range(n))  # contiguous, in order, no overlap
    assert sum(size == 0 for size in sizes) == max(parts - n, 0)


# ---- deepspeed_config --------------------------------------------------------------------------------------------


def ds(strategy: dict, max_grad_norm: float = 1.0, dtype: torch.dtype = torch.float32) -> dict:
    return deepspeed_config(DeepSpeedConfig(name="deepspeed", **strategy),
                            OmegaConf.structured(TrainConfig(max_grad_norm=max_grad_norm)), dtype)


def test_deepspeed_config_stage_and_offload():
    pin = torch.cuda.is_available()
    assert ds({"zero_stage": 2})["zero_optimization"] == {"stage": 2}
    assert ds({"zero_stage": 3, "offload_optimizer": True, "offload_params": True})["zero_optimization"] == {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": pin},
        "offload_param": {"device": "cpu", "pin_memory": pin},
    }
    assert ds({"zero_stage": 1, "offload_optimizer": True})["zero_optimization"] == {
        "stage": 1, "offload_optimizer": {"device": "cpu", "pin_memory": pin}}


def test_deepspeed_config_clipping_precision_and_accumulation():
    config = ds({}, max_grad_norm=0.5, dtype=torch.bfloat16)
    assert config["gradient_clipping"] == 0.5
    assert config["bf16"] == {"enabled": True}
    assert config["managed_gradient_accumulation"] is False
    assert config["gradient_accumulation_steps"] == 1 and config["train_micro_batch_size_per_gpu"] == 1
    assert config["zero_force_ds_cpu_optimizer"] is False
    assert ds({}, max_grad_norm=0.0)["gradient_clipping"] == 0.0
    assert ds({}, max_grad_norm=-1.0)["gradient_clipping"] == 0.0
    assert ds({}, dtype=torch.float32)["bf16"] == {"enabled": False}
    assert ds({}, dtype=torch.float16)["bf16"] == {"enabled": False}


@pytest.mark.parametrize("overrides, message", [
    (["cluster=ray_local", "policy/strategy=ddp", "policy.strategy.offload_params=true"],
     r"policy.strategy.offload_params is not a key of strategy ddp .*it is a key of policy/strategy=deepspeed or fsdp2; "
     r"choose that part, or remove the key \(from the command line; ~policy.strategy.offload_params removes one a YAML file sets\)"),
    (["cluster=ray_local", "policy.strategy.name=deepspeed", "policy.strategy.zero_stage=3"],
     r"policy.strategy.zero_stage: .*policy.strategy.name=deepspeed renames that node without bringing deepspeed's keys; "
     r"choose the part with policy/strategy=deepspeed \(then policy.strategy.zero_stage=3\)"),
])
def test_a_strategy_key_outside_its_strategys_node_is_refused_naming_the_choice(overrides, message):
    """Each strategy's keys live in its own node (`policy/strategy=deepspeed` brings zero_stage and the offloads)."""
    with pytest.raises(ConfigError, match=message):
        compose_config(overrides)


def test_strategy_nodes_hold_only_their_own_keys():
    assert OmegaConf.to_container(compose_config([]).policy.strategy) == {"name": "auto"}
    node = compose_config(["cluster=ray_local", "policy/strategy=deepspeed", "policy.strategy.zero_stage=3"]).policy.strategy
    assert OmegaConf.to_container(node) == {"name": "deepspeed", "zero_stage": 3, "offload_optimizer": False, "offload_params": False}
    assert OmegaConf.to_container(compose_config(["policy/strategy=fsdp2"]).policy.strategy) == {
        "name": "fsdp2", "offload_optimizer": False, "offload_params": False}
