"""LoRA under every training strategy, on CPU (gloo): the same step, the adapters-off reference, and checkpoints.

As `test_strategies.py` does for full fine-tuning: one GRPO mini batch of 32 samples with a rank-4 LoRA policy is
computed once in this process (the reference is the policy itself with its adapters off, no second model), the
single-process policy takes one optimiser step on it, and each remote strategy must take the same step (loss,
gradient norm, merged weights). The trained group then saves a checkpoint (adapters only, no base weights), takes a
second step, and a fresh group of the same strategy loads the checkpoint and must hold the same weights and take the
same second step (the optimiser moments and schedule came back too).
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import compose, max_weight_diff
from safetensors.torch import load_file
from test_strategies import strategy_overrides

from rlhf.run.build import build_components
from rlhf.micro_batches import as_budget
from rlhf.step.learner import accumulate_mini
from rlhf.config.validate import validate
from rlhf.distributed.layout import used_roles
from rlhf.models.lora import AdaptersOff
from rlhf.seeding import seed_everything

STEP = ["train.lr=1e-2", "train.adam_eps=1e-4", "algorithm.beta=0.05", "algorithm.kl_in_reward=false",
        "algorithm.reuse_training_logprobs=false"]  # old logprobs from a pass of their own: accumulate_mini is called directly
LORA = ["policy.lora.rank=4", "policy.lora.alpha=32"]
STRATEGIES = [("ddp", 2), ("fsdp2", 1), ("fsdp2", 2), ("deepspeed-2", 2), ("deepspeed-3", 2)]
TOLERANCE = 1e-5


def weights_of(policy) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in policy.state_dict().items()}


@pytest.fixture(scope="module")
def lora_step():
    """One local single-process LoRA step and a second one on the same batch: a dict of the batch, algorithm,
    denominator, the first step's metrics and gradient norm, the merged weights before, after one and after two
    steps, and the base model's logprobs (adapters off) after the first step."""
    cfg = compose("cluster=local", *STEP, *LORA)
    spec = validate(cfg)
    seed_everything(cfg.seed)  # as the training workers do before they build: the same random LoRA A matrices
    c = build_components(spec)
    assert isinstance(c.learner.reference, AdaptersOff)  # no second model: the policy with its adapters off
    examples = c.collector.prompts.next_batch(cfg.train.prompts_per_step)
    scored = c.collector.collect(examples)
    batch, _ = c.learner.prepare(scored)
    assert batch.ref_logp is not None
    initial = weights_of(c.learner.policy)
    denominator = c.learner.algorithm.denominator(batch)
    finite, metrics, _ = accumulate_mini(c.learner.policy, batch, c.learner.algorithm.policy_loss, denominator, as_budget(8))
    assert finite
    norm = c.learner.policy.optimizer_step()
    after_one = weights_of(c.learner.policy)
    base_logp = c.learner.policy.base_logprobs(batch, 8)
    # the base model did not move: its logprobs are still the batch's reference logprobs
    torch.testing.assert_close(base_logp, batch.ref_logp, rtol=0, atol=1e-6)
    assert accumulate_mini(c.learner.policy, batch, c.learner.algorithm.policy_loss, denominator, as_budget(8))[0]
    c.learner.policy.optimizer_step()
    return {
        "batch": batch, "algorithm": c.learner.algorithm, "denominator": denominator, "metrics": metrics, "norm": norm,
        "initial": initial, "after_one": after_one, "after_two": weights_of(c.learner.policy), "base_logp": base_logp,
    }


def folder_bytes(folder) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def deepspeed_weight_elements(folder) -> int:
    """How many weight elements the DeepSpeed checkpoint's model states hold, over every rank's file: the module's
    state dict (ZeRO-2: whole tensors; ZeRO-3: empty placeholders) plus the frozen parameters' ZeRO fragments, the
    two places the frozen base weights would go without exclude_frozen_parameters (our own files: plain unpickling)."""
    files = list(folder.rglob("*model_states.pt"))
    assert files, f"no DeepSpeed model states in {folder}"
    total = 0
    for f in files:
        state = torch.load(f, map_location="cpu", weights_only=False)
        total += sum(t.numel() for t in state["module"].values())
        total += sum(t.numel() for t in (state.get("frozen_param_fragments") or {}).values())
    return total


def check_adapter_only(model_dir) -> None:
    """``model_dir`` is a PEFT adapter folder: adapter config and adapter tensors, no full model weights."""
    files = {f.name for f in model_dir.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files, files
    assert not {"model.safetensors", "pytorch_model.bin", "model.safetensors.index.json"} & files, files
    saved = load_file(model_dir / "adapter_model.safetensors")
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved), sorted(saved)[:5]


@pytest.mark.slow
@pytest.mark.parametrize("name,ranks", STRATEGIES, ids=[f"{n}-ws{r}" for n, r in STRATEGIES])
def test_lora_step_reference_and_checkpoint_agree(started, lora_step, tmp_path, name, ranks):
    import ray

    s = lora_step
    batch, algorithm, denominator = s["batch"], s["algorithm"], s["denominator"]
    cfg = compose(*STEP, *LORA, *strategy_overrides(name, ranks))
    validate(cfg)  # the cluster.roles.reference overrides are harmless though no ref role starts
    assert "reference" not in used_roles(cfg, algorithm)

    # 1. the same step as the single process
    trainer = started.trainer(cfg, ranks)
    finite, remote_metrics, _ = accumulate_mini(trainer, batch, algorithm.policy_loss, denominator, as_budget(8))
    assert finite
    assert remote_metrics["loss/policy_avg"] == pytest.approx(s["metrics"]["loss/policy_avg"], abs=1e-6)
    assert remote_metrics["loss/kl_avg"] == pytest.approx(s["metrics"]["loss/kl_avg"], abs=1e-6)
    remote_norm = trainer.optimizer_step()
    assert math.isfinite(remote_norm) and remote_norm == pytest.approx(s["norm"], rel=1e-4)
    after_one = ray.get(trainer.state_dict())
    assert max_weight_diff(after_one, s["after_one"]) < TOLERANCE
    assert max_weight_diff(after_one, s["initial"]) > 100 * TOLERANCE  # the step moved the merged weights
    pushed = ray.get(trainer.state_dict(True))  # what a step pushes: the adapted layers (and their siblings) only
    assert set(pushed) < set(after_one) and max_weight_diff(pushed, {k: after_one[k] for k in pushed}) == 0

    # 2. the reference: the base weights with the adapters off (under fsdp2 and ZeRO-3 the base weights are sharded too)
    torch.testing.assert_close(trainer.base_logprobs(batch, 8), s["base_logp"], rtol=0, atol=TOLERANCE)

    # 3. checkpoint: adapters (and their optimiser state) only
    path = tmp_path / "ckpt"
    trainer.save_checkpoint(path)
    check_adapter_only(path / "model")
    if name.startswith("deepspeed"):  # exclude_frozen_parameters: a full checkpoint would hold every base weight
        base_elements = sum(t.numel() for t in s["initial"].values())
        assert deepspeed_weight_elements(path / "deepspeed") < base_elements / 4, "the frozen base weights were saved"
        assert folder_bytes(path / "deepspeed") < 4 * base_elements  # all of it, optimiser state included
    assert accumulate_mini(trainer, batch, algorithm.policy_loss, denominator, as_budget(8))[0]
    trainer.optimizer_step()
    after_two = ray.get(trainer.state_dict())
    assert max_weight_diff(after_two, s["after_two"]) < TOLERANCE
    assert max_weight_diff(after_two, after_one) > 100 * TOLERANCE  # the second step moved them too

    # a fresh group of the same strategy resumes from the checkpoint: same weights, then the same second step (a
    # fresh AdamW, moments lost, would land ~4e-2 away from it on this batch)
    resumed = started.trainer(cfg, ranks)
    resumed.load_checkpoint(path)
    assert max_weight_diff(ray.get(resumed.state_dict()), after_one) < 1e-6
    assert resumed.lr == pytest.approx(trainer.lr)
    assert accumulate_mini(resumed, batch, algorithm.policy_loss, denominator, as_budget(8))[0]
    resumed.optimizer_step()
    assert max_weight_diff(ray.get(resumed.state_dict()), after_two) < 1e-6


@pytest.mark.slow
def test_a_lora_critic_takes_the_same_value_step_under_ddp(started, tmp_path):
    """PPO's critic with LoRA adapters on its backbone (its value head trained whole): one value-loss step at world size
    2 under DDP equals the single process's, and its checkpoint holds the adapters and the head only."""
    ppo = ["algorithm=ppo", *STEP, "critic.lora.rank=4", "critic.lora.alpha=32"]
    cfg = compose("cluster=local", *ppo)
    spec = validate(cfg)
    seed_everything(cfg.seed)
    c = build_components(spec)
    examples = c.collector.prompts.next_batch(cfg.train.prompts_per_step)
    scored = c.collector.collect(examples)
    batch, _ = c.learner.prepare(scored)
    denominator = c.learner.algorithm.denominator(batch)
    finite, metrics, _ = accumulate_mini(c.learner.critic, batch, c.learner.algorithm.value_loss, denominator, as_budget(8))
    assert finite
    norm = c.learner.critic.optimizer_step()
    local = {k: v.detach().clone() for k, v in c.learner.critic.full_state_dict().items()}

    remote_cfg = compose(*ppo, "critic/strategy=ddp", "cluster.roles.critic.devices_per_node=2")
    critic = started.trainer(remote_cfg, 2, role="critic")
    finite, remote_metrics, _ = accumulate_mini(critic, batch, c.learner.algorithm.value_loss, denominator, as_budget(8))
    assert finite
    assert remote_metrics["loss/value_avg"] == pytest.approx(metrics["loss/value_avg"], abs=1e-6)
    assert critic.optimizer_step() == pytest.approx(norm, rel=1e-4)
    assert max_weight_diff(critic.full_state_dict(), local) < TOLERANCE
    trained = [k for k in local if ".lora_" in k or ".modules_to_save." in k]
    assert any("modules_to_save" in k for k in trained)  # the value head trains
    critic.save_checkpoint(tmp_path / "critic")
    saved = load_file(tmp_path / "critic" / "model" / "adapter_model.safetensors")
    assert len(saved) == len(trained) and all(".lora_" in k or "score" in k for k in saved)
