"""The memory plan of whole configs: placement, capacity, verdict, advice, and the check `rlhf.train` runs."""

from __future__ import annotations

import logging

import pytest
from transformers import AutoModelForCausalLM, LlamaConfig

from published_configs import LLAMA_3_1_8B, write_config
from rlhf import plan as plan_check
from rlhf.config import compose_config, validate
from rlhf.errors import ConfigError
from rlhf.plan import make_plan
from rlhf.plan.advice import advise, with_overrides
from rlhf.plan.memory import GENERATE, PHASES
from rlhf.train import train


@pytest.fixture(scope="module")
def llama8b(tmp_path_factory):
    return str(write_config(tmp_path_factory.mktemp("llama") / "llama-3.1-8b", LLAMA_3_1_8B))


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    """A 4-layer Llama with a 1024-row output layer (config and weights; the plan reads only the config)."""
    config = LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=320, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    folder = tmp_path_factory.mktemp("small") / "llama"
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return str(folder)


def tulu(llama8b, *extra):
    return compose_config(["experiment=ppo_tulu3_8b_ultrafeedback", f"model.name_or_path={llama8b}",
                           f"reward.path={llama8b}", "cluster.device_memory_gb=80", *extra])


def test_the_default_run_fits_this_machine_and_counts_every_role():
    cfg = compose_config([])
    plan = make_plan(cfg)
    assert plan.fits is True and plan.kind == "cpu" and plan.capacity.shared
    (group,) = plan.groups
    expected = {"policy", "reference", "generator"} if cfg.algorithm.beta > 0 else {"policy", "generator"}
    assert set(group.roles) == expected
    assert {i.role for i in group.items} >= {"policy", "generator", "runtime"}


def test_the_8gpu_split_preset_places_generation_on_its_own_device(llama8b):
    plan = make_plan(tulu(llama8b))
    shapes = {group.roles: group.count for group in plan.groups}
    assert shapes == {("policy", "reference", "critic", "reward"): 7, ("generator",): 1}
    train_device = next(g for g in plan.groups if "policy" in g.roles)
    weights = {i.role: i.bytes for i in train_device.items if i.what == "weights"}
    assert weights["reference"] == 8_030_261_248 * 2  # bf16 replica of the reference on every training GPU
    assert weights["policy"] == 8_030_261_248 * 2 // 7  # ZeRO-3: bf16 weights sharded over 7 ranks


def test_async_keeps_the_generator_busy_in_every_phase_and_hybrid_frees_it_while_training(small_model):
    base = [f"model.name_or_path={small_model}", "dataset.max_prompt_length=32"]
    for schedule, phases in (("async", PHASES), ("hybrid", (GENERATE,))):
        plan = make_plan(compose_config([*base, f"schedule={schedule}"]))
        weights = next(i for i in plan.groups[0].items if i.role == "generator" and i.what == "weights")
        assert weights.phases == phases, schedule


def test_a_run_that_cannot_fit_is_refused_before_any_weights_load_with_the_table_and_the_fix(small_model, tmp_path, monkeypatch):
    """Capacity between the plan with and without gradient checkpointing: the advice names it, and it is true."""
    base = [f"model.name_or_path={small_model}", "train.micro_batch_size=64", "generator.max_new_tokens=64",
            "dataset.max_prompt_length=32"]
    without = make_plan(compose_config(base))
    with_gc = make_plan(compose_config([*base, "policy.gradient_checkpointing=true"]))
    need_without, need_with = without.needed(without.worst), with_gc.needed(with_gc.worst)
    assert need_with < need_without
    capacity_gib = (need_with + need_without) / 2 / 0.9 / 2**30
    cfg = compose_config([*base, f"cluster.device_memory_gb={capacity_gib}"])

    def no_loading(*args, **kwargs):
        raise AssertionError("a model loaded before the plan refused the run")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_loading)
    with pytest.raises(ConfigError) as refused:
        train(cfg, tmp_path / "run")
    text = str(refused.value)
    assert "does not fit" in text and "plan.enforce=false" in text and "activations" in text
    line = next(line for line in text.splitlines() if "policy.gradient_checkpointing=true" in line)
    assert "->" in line and "GiB/device" in line
    assert make_plan(with_overrides(cfg, ["policy.gradient_checkpointing=true"])).fits


def test_a_compiled_policy_that_does_not_fit_is_advised_an_activation_memory_budget_first(small_model, monkeypatch):
    """A compiled policy keeps less at a smaller activation memory budget: the advice names the budget that fits
    before any costlier change, and the plan with it fits. The process's resident memory (the plan's runtime row) is
    held still: the capacity sits between two plans, and a test worker's memory grows between them."""
    monkeypatch.setattr("rlhf.plan.planner.resident_bytes", lambda: 300 * 2**20)
    base = [f"model.name_or_path={small_model}", "train.micro_batch_size=64", "generator.max_new_tokens=64",
            "dataset.max_prompt_length=32", "policy.compile=true"]
    needs = [make_plan(compose_config([*base, *extra])) for extra in ([], ["policy.activation_memory_budget=0.5"],
                                                                      ["policy.activation_memory_budget=0.3"])]
    unbudgeted, half, lean = (plan.needed(plan.worst) for plan in needs)
    assert lean < half < unbudgeted
    cfg = compose_config([*base, f"cluster.device_memory_gb={(lean + half) / 2 / 0.9 / 2**30}"])
    lines = advise(make_plan(cfg))
    assert lines[0].startswith("policy.activation_memory_budget=0.3: ") and "->" in lines[0], lines
    assert not any("activation_memory_budget=0.5" in line for line in lines)  # it does not fit: not named
    assert make_plan(with_overrides(cfg, ["policy.activation_memory_budget=0.3"])).fits
    already = compose_config([*base, "policy.activation_memory_budget=0.3", "cluster.device_memory_gb=0.001"])
    assert not any("activation_memory_budget" in line for line in advise(make_plan(already)))


def test_enforce_false_warns_and_lets_the_run_start(small_model, caplog):
    cfg = compose_config([f"model.name_or_path={small_model}", "cluster.device_memory_gb=0.01", "plan.enforce=false"])
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        plan = plan_check.check(validate(cfg))
    assert plan.fits is False
    assert "plan.enforce=false" in caplog.text and "does NOT fit" in caplog.text


@pytest.mark.parametrize("start, typed", [
    (["policy.strategy.offload_optimizer=false", "critic.strategy.offload_optimizer=false"], True),
    (["policy/strategy=ddp", "critic/strategy=ddp", "~policy.strategy.zero_stage", "~policy.strategy.offload_optimizer",
      "~critic.strategy.zero_stage", "~critic.strategy.offload_optimizer"], False),  # unsharded: the advice re-chooses
])
def test_every_change_the_advice_names_makes_the_8b_preset_fit(llama8b, start, typed):
    """Each line's overrides fit, applied as the advice applies them and (``typed``) typed after the run's own."""
    base = ["policy.gradient_checkpointing=false", "critic.gradient_checkpointing=false", *start]
    cfg = tulu(llama8b, *base)
    plan = make_plan(cfg)
    assert plan.fits is False
    lines = advise(plan)
    assert lines
    for line in lines:
        overrides = line.split(":")[0].removeprefix("together, ").split()
        assert make_plan(with_overrides(cfg, overrides)).fits, line
        assert not typed or make_plan(tulu(llama8b, *base, *overrides)).fits, line


def test_a_preset_with_fewer_devices_than_its_roles_names_the_keys(llama8b):
    with pytest.raises(ConfigError, match=r"cluster\.num_nodes=1 x cluster\.devices_per_node=4 gives 4"):
        make_plan(tulu(llama8b, "cluster.devices_per_node=4"))


@pytest.mark.parametrize(("override", "key"), [
    ("plan.headroom=1.5", "plan.headroom"),
    ("cluster.device_memory_gb=0", "cluster.device_memory_gb"),
    ("model.dtype=float8", "model.dtype"),
])
def test_bad_plan_keys_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        cfg = compose_config([override])
        validate(cfg)
        make_plan(cfg)


def test_an_unknown_capacity_gives_no_verdict_rather_than_a_guess(llama8b):
    plan = make_plan(compose_config(["experiment=ppo_tulu3_8b_ultrafeedback", f"model.name_or_path={llama8b}",
                                     f"reward.path={llama8b}"]))
    assert plan.capacity.bytes is None and plan.fits is None  # ray GPUs, none here, no cluster.device_memory_gb


def test_lora_drops_the_reference_and_the_full_gradients_and_counts_the_adapters_and_the_merged_push(llama8b):
    """Llama-3.1-8B, rank 16 on every attention and MLP linear layer: 16 x (in + out) per layer, 32 layers."""
    one_gpu = ["algorithm=grpo", "cluster=single_gpu", "reward.path=null", "policy/strategy=single",
               "~policy.strategy.zero_stage", "~policy.strategy.offload_optimizer"]  # the preset's deepspeed keys
    full, lora = make_plan(tulu(llama8b, *one_gpu)), make_plan(tulu(llama8b, *one_gpu, "policy.lora.rank=16"))
    sizes = {"q": (4096, 4096), "k": (4096, 1024), "v": (4096, 1024), "o": (4096, 4096),
             "gate": (4096, 14336), "up": (4096, 14336), "down": (14336, 4096)}
    adapters = 32 * sum(16 * (i + o) for i, o in sizes.values())
    bytes_of = lambda plan, what: {i.role: i.bytes for i in plan.groups[0].items if i.what == what}  # noqa: E731
    assert "reference" in full.groups[0].roles and "reference" not in lora.groups[0].roles  # the base with adapters off
    assert bytes_of(lora, "gradients")["policy"] == 4 * adapters and bytes_of(lora, "optimizer")["policy"] == 8 * adapters
    assert bytes_of(lora, "weights")["policy"] == bytes_of(full, "weights")["policy"]
    assert bytes_of(lora, "merged weights")["policy"] == 4 * 32 * sum(i * o for i, o in sizes.values())
    assert lora.groups[0].peak[0] < full.groups[0].peak[0]


def test_the_plan_follows_the_trainer_precision_the_fused_output_layer_and_compiled_blocks(small_model):
    """On CUDA in bf16: master weights beside bf16 weights; the fused output layer's scoring temporaries are one
    chunk's, not the whole window's logits; compiled blocks keep `COMPILED_ACTIVATIONS` of the eager activations."""
    from rlhf.plan.roles import COMPILED_ACTIVATIONS

    base = [f"model.name_or_path={small_model}", "dataset.max_prompt_length=32", "cluster.device=cuda",
            "cluster.device_memory_gb=80", "model.dtype=bfloat16", "train.micro_batch_size=64", "generator.max_new_tokens=64"]

    def policy(*extra):
        (group,) = make_plan(compose_config([*base, *extra])).groups
        return {i.what: i.bytes for i in group.items if i.role == "policy"}

    fused, plain, autocast, compiled = policy(), policy("model.logprob_chunk=0"), policy("train.mixed_precision=autocast"), policy("policy.compile=true")
    assert fused["weights"] * 2 == fused["master weights"] and "master weights" not in autocast
    assert fused["scoring temporaries"] < plain["scoring temporaries"]
    assert compiled["activations"] == int(fused["activations"] * COMPILED_ACTIVATIONS)
    # an activation memory budget keeps less, as measured; between the measured budgets the share is interpolated
    budgets = [policy("policy.compile=true", f"policy.activation_memory_budget={b}")["activations"]
               for b in (0.1, 0.3, 0.4, 0.5, 1.0)]
    assert budgets == [int(fused["activations"] * share) for share in (0.48, 0.48, 0.495, 0.51, COMPILED_ACTIVATIONS)]


def test_a_micro_batch_above_the_mini_batch_is_planned_as_the_mini_batch(capsys):
    """`python -m rlhf.plan train.micro_batch_size=1000000`: the run trains and scores in micro batches of at most a
    step's 128 samples, so the plan does too (before, it planned a million-row scoring forward, then crashed on the
    advice's train.micro_batch_size=122, a value the user never gave)."""
    from rlhf.plan.__main__ import main

    assert main(["train.micro_batch_size=1000000"]) == 0
    assert "verdict: fits" in capsys.readouterr().out


def test_the_micro_batch_advice_halves_the_micro_batch_the_run_uses(small_model):
    """Advice from the mini batch the run trains on (128 samples), never a size the run would refuse."""
    base = [f"model.name_or_path={small_model}", "generator.max_new_tokens=64", "dataset.max_prompt_length=32"]
    full, half = (make_plan(compose_config([*base, f"train.micro_batch_size={n}"])) for n in (128, 64))
    assert half.needed(half.worst) < full.needed(full.worst)
    capacity_gib = (half.needed(half.worst) + full.needed(full.worst)) / 2 / 0.9 / 2**30
    cfg = compose_config([*base, "train.micro_batch_size=1000000", f"cluster.device_memory_gb={capacity_gib}"])
    lines = advise(make_plan(cfg))
    sizes = [int(line.split("train.micro_batch_size=")[1].split(":")[0]) for line in lines if "micro_batch_size" in line]
    assert sizes and sizes[0] == 64 and all(128 % size == 0 for size in sizes), lines


def sized_items(plan) -> list[tuple]:
    """(role, what, bytes) of every item but the runtime's (this process's, measured)."""
    return [(i.role, i.what, i.bytes) for g in plan.groups for i in g.items if i.role != "runtime"]


def test_an_environment_named_by_import_path_is_planned_as_a_registered_one(tmp_path, monkeypatch):
    """Its node holds `name` and the keys given with `+`; the plan reads the node typed by its class (the shared keys'
    defaults filled), as for env=arith_retry. Before, the plan was skipped with a warning (`env.max_tokens` not in struct)."""
    (tmp_path / "plan_envs.py").write_text(
        "from dataclasses import dataclass\nfrom rlhf.envs.base import EnvConfig\n\n\n"
        "@dataclass\nclass OwnConfig(EnvConfig):\n    level: int = 1  # a key of its own\n\n\n"
        "class Own:\n    config = OwnConfig\n    uses_dataset = False\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    own = make_plan(compose_config(["env.name=plan_envs.Own", "+env.max_tokens=48", "+env.num_parallel=3"]))
    registered = make_plan(compose_config(["env=arith_retry", "env.max_tokens=48", "env.num_parallel=3"]))
    assert (own.workload.seq_len, own.workload.window) == (48, 48)
    assert own.workload == registered.workload
    assert sized_items(own) == sized_items(registered)
    defaults = make_plan(compose_config(["env.name=plan_envs.Own"])).workload  # EnvConfig's defaults
    assert defaults.seq_len == 256
