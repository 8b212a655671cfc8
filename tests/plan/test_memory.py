"""The plan's arithmetic by hand (rlhf.plan.memory)."""

from __future__ import annotations

from rlhf.generators.memory import generate_logits_bytes, kv_cache_bytes
from rlhf.plan.memory import GENERATE, SCORE, TRAIN, Item, Sharding, host_bytes, peak, trained_state

P = 1_000_000  # parameters


def by_what(items):
    return {i.what: (i.bytes, i.on_host) for i in items}


def test_one_process_keeps_float32_weights_gradients_and_two_moments():
    assert by_what(trained_state("policy", P, Sharding("single", 1), bf16=True)) == {
        "weights": (4 * P, False), "gradients": (4 * P, False), "optimizer": (8 * P, False),
    }


def test_ddp_adds_a_gradient_bucket_and_shards_nothing():
    items = by_what(trained_state("policy", P, Sharding("ddp", 4), bf16=False))
    assert items["weights"] == (4 * P, False) and items["optimizer"] == (8 * P, False)
    assert items["gradient buckets"] == (4 * P, False)


def test_fsdp2_shards_weights_gradients_and_optimizer_over_ranks():
    items = by_what(trained_state("policy", P, Sharding("fsdp2", 4, offload_optimizer=True), bf16=True))
    assert items == {"weights": (P, False), "gradients": (P, False), "optimizer": (2 * P, True)}


def test_zero_stages_shard_optimizer_then_gradients_then_weights():
    """DeepSpeed bf16: 2-byte weights and gradients, 12 bytes of fp32 master copy and moments per parameter."""
    n = 8
    stage = {s: by_what(trained_state("policy", P, Sharding("deepspeed", n, zero_stage=s), bf16=True)) for s in (1, 2, 3)}
    assert stage[1] == {"weights": (2 * P, False), "gradients": (2 * P, False), "optimizer": (12 * P // n, False)}
    assert stage[2]["gradients"] == (2 * P // n, False) and stage[2]["weights"] == (2 * P, False)
    assert stage[3]["weights"] == (2 * P // n, False)


def test_offloaded_state_counts_on_the_host_not_the_device():
    items = trained_state("policy", P, Sharding("deepspeed", 2, zero_stage=3, offload_optimizer=True, offload_params=True), bf16=False)
    assert host_bytes(items) == 4 * P // 2 + 12 * P // 2
    assert peak(items) == (4 * P // 2, TRAIN)  # only the sharded gradients stay on the device


def test_kv_cache_and_generation_logits():
    # Qwen2.5-0.5B: 24 layers, 2 KV heads of 64; 8 rows of 1024 tokens in bf16
    assert kv_cache_bytes(24, 2, 64, 8 * 1024, 2) == 2 * 24 * 2 * 64 * 8192 * 2 == 100_663_296
    assert generate_logits_bytes(8, 100, 151936) == 8 * 100 * 151936 * 4


def test_the_peak_is_the_largest_phase_not_the_sum():
    items = [Item("policy", "weights", 10), Item("policy", "activations", 50, (TRAIN,)),
             Item("generator", "kv_cache", 70, (GENERATE,)), Item("reference", "scoring temporaries", 20, (SCORE,))]
    assert peak(items) == (80, GENERATE)


def test_bf16_master_weights_hold_bf16_weights_and_float32_masters_gradients_and_moments():
    items = by_what(trained_state("policy", P, Sharding("single", 1), bf16=True, master=True))
    assert items == {"weights": (2 * P, False), "master weights": (4 * P, False), "gradients": (4 * P, False),
                     "optimizer": (8 * P, False)}
    fsdp2 = by_what(trained_state("policy", P, Sharding("fsdp2", 4), bf16=True, master=True))
    assert fsdp2 == {"weights": (P, False), "gradients": (P, False), "optimizer": (2 * P, False)}  # float32 shards
