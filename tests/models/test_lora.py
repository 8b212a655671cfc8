"""LoRA on the policy (rlhf.models.lora): merged weights, the adapters-off reference, adapter-only checkpoints,
partial weight pushes, and the bad inputs refused before training."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from rlhf.checks import weight_sync
from push_faults import inject_push_faults
from rlhf.config import ConfigError, compose_config, validate
from rlhf.config.schema import PolicyConfig
from rlhf.models import lora
from rlhf.training.policy import TorchPolicy
from rlhf.models.reference import FrozenReference
from rlhf.train import train

CPU = torch.device("cpu")
SHORT = ["train.num_steps=2", "eval.every=0", "logging.tensorboard=false", "checkpoint.save_final_model=false"]


def lora_policy(model_cfg, train_cfg, rank: int = 4, targets=("all-linear",), lr: float = 1e-2) -> TorchPolicy:
    cfg = OmegaConf.structured(PolicyConfig())
    cfg.lora.rank, cfg.lora.alpha, cfg.lora.target_modules = rank, 16.0, list(targets)
    return TorchPolicy(cfg, model_cfg, train_cfg(lr=lr), total_optimizer_steps=10, device=CPU)


def nudge_adapters(policy: TorchPolicy, seed: int = 0) -> None:
    """Give every B a random value (fresh adapters have B = 0 and change nothing)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))


def learn_once(policy: TorchPolicy, rollout) -> None:
    logp, _ = policy.logprobs(rollout)
    policy.backward(-logp.sum() / rollout.loss_mask.sum())
    policy.optimizer_step()


def test_only_the_adapters_train_and_the_base_stays_put(model_cfg, train_cfg, rollout):
    policy = lora_policy(model_cfg, train_cfg)
    trainable = {n for n, p in policy.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert sum(len(g["params"]) for g in policy.optimizer.param_groups) == len(trainable)
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    learn_once(policy, rollout)
    after = dict(policy.model.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before if n not in trainable)
    assert any(not torch.equal(before[n], after[n]) for n in trainable)


def test_merged_weights_equal_peft_merge_and_unload(model_cfg, train_cfg):
    policy = lora_policy(model_cfg, train_cfg)
    nudge_adapters(policy)
    merged = policy.state_dict()
    expected = lora.add_adapters(
        FrozenReference(OmegaConf.create({"name_or_path": None}), model_cfg, CPU).model, policy.lora
    )
    expected.load_state_dict(lora.adapter_state(policy.model.state_dict()), strict=False)
    plain = expected.merge_and_unload().state_dict()
    assert set(merged) == set(plain)
    assert max((merged[k] - plain[k]).abs().max().item() for k in merged) < 1e-6
    adapted = policy.state_dict(adapted_only=True)
    assert set(adapted) < set(merged) and all(torch.equal(adapted[k], merged[k]) for k in adapted)
    assert not any("embed_tokens" in k or "norm" in k for k in adapted)


def test_an_adapted_only_push_carries_the_siblings_an_engine_fuses(model_cfg, train_cfg):
    """Adapters on q_proj and down_proj only: the push also carries k/v/o and gate/up (vLLM fuses q/k/v and gate/up)."""
    policy = lora_policy(model_cfg, train_cfg, targets=("q_proj", "down_proj"))
    names = set(policy.state_dict(adapted_only=True))
    layer = "model.layers.0."
    assert {f"{layer}self_attn.{p}_proj.weight" for p in "qkvo"} <= names
    assert {f"{layer}mlp.{p}_proj.weight" for p in ("gate", "up", "down")} <= names
    assert not any("layernorm" in n for n in names)


def test_the_reference_is_the_base_model_with_adapters_off(model_cfg, train_cfg, rollout):
    policy = lora_policy(model_cfg, train_cfg)
    base = FrozenReference(OmegaConf.create({"name_or_path": None}), model_cfg, CPU).rollout_logprobs(rollout, 8)
    learn_once(policy, rollout)
    assert torch.allclose(policy.base_logprobs(rollout, 8), base, atol=1e-6)
    trained = policy.rollout_logprobs(rollout, 8)[0]
    assert (trained - base).abs().max() > 1e-3  # the adapters do change the policy; the reference ignores them


def test_a_checkpoint_holds_the_adapters_only_and_restores_them_exactly(model_cfg, train_cfg, rollout, tmp_path):
    policy = lora_policy(model_cfg, train_cfg)
    learn_once(policy, rollout)
    policy.save_checkpoint(tmp_path / "ckpt")
    saved = tmp_path / "ckpt" / "model"
    assert lora.is_adapter_folder(saved) and not (saved / "model.safetensors").exists()
    fresh = lora_policy(model_cfg, train_cfg)
    fresh.load_checkpoint(tmp_path / "ckpt")
    for a, b in ((policy, fresh),):
        assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    learn_once(policy, rollout)
    learn_once(fresh, rollout)  # same optimiser moments: the same next step
    assert all(torch.equal(x, y) for x, y in zip(policy.state_dict().values(), fresh.state_dict().values()))


def test_a_full_checkpoint_does_not_load_into_adapters(model_cfg, train_cfg, rollout, tmp_path):
    full = TorchPolicy(OmegaConf.structured(PolicyConfig()), model_cfg, train_cfg(), total_optimizer_steps=10, device=CPU)
    full.save_checkpoint(tmp_path / "full")
    with pytest.raises(ValueError, match="does not match the model's LoRA adapters"):
        lora_policy(model_cfg, train_cfg).load_checkpoint(tmp_path / "full")


def test_the_hf_generator_takes_a_partial_push_and_refuses_foreign_names(make_generator, tiny_model_dir, model_cfg, train_cfg):
    generator = make_generator(tiny_model_dir)
    policy = lora_policy(model_cfg, train_cfg)
    nudge_adapters(policy)
    generator.update_weights(policy.state_dict(adapted_only=True))
    held = generator.model.state_dict()
    assert all(torch.equal(held[k], v) for k, v in policy.state_dict().items())
    with pytest.raises(KeyError, match="no weights named"):
        generator.update_weights({"model.layers.0.self_attn.q_proj.lora_A.default.weight": torch.zeros(4, 64)})


def test_a_partial_push_still_catches_a_tensor_that_never_arrived(monkeypatch, tmp_path):
    inject_push_faults(monkeypatch, missed="model.layers.0.mlp.up_proj.weight")
    with pytest.raises(weight_sync.WeightSyncError, match=r"push after step 2: the generator holds a different `model\.layers\.0\.mlp\.up_proj"):
        train(compose_config(["policy.lora.rank=4", "train.num_steps=3", *SHORT[1:]]), tmp_path / "run")


@pytest.mark.parametrize(("overrides", "message"), [
    (["policy.lora.rank=0"], r"policy\.lora\.rank=0: a LoRA rank must be a positive integer"),
    (["policy.lora.rank=-4"], r"policy\.lora\.rank=-4"),
    (["policy.lora.rank=8", "policy.lora.alpha=0"], r"policy\.lora\.alpha=0\.0 must be > 0"),
    (["policy.lora.rank=8", "policy.lora.dropout=1.0"], r"policy\.lora\.dropout=1\.0: dropout makes"),
    (["policy.lora.rank=8", "policy.lora.dropout=0.1"], r"policy\.lora\.dropout=0\.1: dropout makes the trainer's logprobs random .* set policy\.lora\.dropout=0$"),
    (["policy.lora.rank=8", "policy.lora.target_modules=[]"], r"policy\.lora\.target_modules is empty"),
])
def test_bad_lora_values_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose_config(overrides))


def test_a_rank_past_the_narrowest_adapted_layer_is_refused_before_any_weights_load(tmp_path, monkeypatch):
    """`policy.lora.rank=100000` on the 64-wide built-in model (217.6M adapter parameters were accepted before)."""
    loaded = []
    monkeypatch.setattr("rlhf.training.policy.load_causal_lm", lambda *a, **k: loaded.append(a) or pytest.fail("loaded"))
    cfg = compose_config(["policy.lora.rank=100000", *SHORT])
    with pytest.raises(ConfigError, match=r"policy.lora.rank=100000 is past the width of the adapted layer .* \(64\) of "
                                          r"builtin:tiny_arith.*set policy.lora.rank <= 64"):
        train(cfg, tmp_path / "run")
    assert not loaded


def test_target_modules_that_match_nothing_are_refused_before_any_weights_load(tmp_path, monkeypatch):
    loaded = []
    monkeypatch.setattr("rlhf.training.policy.load_causal_lm", lambda *a, **k: loaded.append(a) or pytest.fail("loaded"))
    cfg = compose_config(["policy.lora.rank=8", "policy.lora.target_modules=[q_proj,qkv_proj]", *SHORT])
    with pytest.raises(ConfigError, match=r"target_modules: \['qkv_proj'\] match no linear layer .* end in \[.*'q_proj'"):
        train(cfg, tmp_path / "run")
    assert not loaded


def test_a_model_folder_holding_only_an_adapter_is_refused_naming_its_base(tmp_path):
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "Qwen/Qwen2.5-0.5B", "r": 8}))
    with pytest.raises(ConfigError, match=r"model\.name_or_path=.*holds a LoRA adapter .* no base model weights.*Qwen/Qwen2\.5-0\.5B"):
        train(compose_config([f"model.name_or_path={folder}", *SHORT]), tmp_path / "run")


@pytest.mark.parametrize(("first", "then", "message"), [
    (["policy.lora.rank=4"], [], r"holds LoRA adapters \(rank 4\) but this run trains every weight .* set policy\.lora\.rank=4"),
    (["policy.lora.rank=4"], ["policy.lora.rank=8"], r"the checkpoint's LoRA rank is 4, policy\.lora\.rank=8"),
    ([], ["policy.lora.rank=4"], r"holds fully fine-tuned weights but this run trains LoRA adapters .* policy\.lora\.rank=null"),
])
def test_resuming_across_lora_and_full_fine_tuning_is_refused(first, then, message, tmp_path):
    out = tmp_path / "run"
    train(compose_config([*first, *SHORT, "checkpoint.every=2"]), out)
    with pytest.raises(ConfigError, match=message):
        train(compose_config([*then, *SHORT, "checkpoint.every=2", "resume=auto"]), out)


def test_a_lora_critic_trains_adapters_and_its_head_and_resumes_exactly(tmp_path):
    """PPO with LoRA on the policy and the critic: only adapters (and the critic's value head) train; a run resumed from
    its step-2 checkpoint repeats steps 3-4 of the uninterrupted run exactly."""
    run = ["algorithm=ppo", "policy.lora.rank=4", "critic.lora.rank=4", "train.num_steps=4", "eval.every=0",
           "logging.tensorboard=false", "checkpoint.save_final_model=false", "checkpoint.every=2", "checkpoint.keep_last=0"]
    train(compose_config(run), tmp_path / "a")
    step_2 = sorted((tmp_path / "a" / "checkpoints").glob("step_*"))[0]
    critic_files = load_file(step_2 / "critic" / "model" / "adapter_model.safetensors")
    assert critic_files and all(".lora_" in k or ".score." in k for k in critic_files)
    assert any(".score." in k for k in critic_files)  # the value head is trained, so saved
    train(compose_config([*run, f"resume={step_2}"]), tmp_path / "b")
    a, b = (records(tmp_path / name) for name in ("a", "b"))
    for step in (3, 4):
        for key in ("loss/value_avg", "critic/grad_norm", "loss/policy_avg", "objective/scores"):
            assert a[step][key] == b[step][key], (step, key)


def test_a_lora_critic_under_a_sharded_strategy_is_refused():
    with pytest.raises(ConfigError, match=r"critic\.lora with critic/strategy=fsdp2: a LoRA critic trains under single or ddp"):
        validate(compose_config(["algorithm=ppo", "critic.lora.rank=4", "critic/strategy=fsdp2"]))
    with pytest.raises(ConfigError, match=r"critic\.lora\.rank=0"):
        validate(compose_config(["algorithm=ppo", "critic.lora.rank=0"]))


def records(run_dir) -> dict[int, dict]:
    """metrics.jsonl rows with training metrics, by step."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows if "loss/value_avg" in row}
