"""bf16 weights with float32 masters (`train.mixed_precision=master`): what the optimiser sees and steps, what a
checkpoint keeps, and that the CPU float32 path is untouched."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from omegaconf import OmegaConf

from rlhf.config.schema import TrainConfig
from rlhf.parts import choose
from rlhf.models.tiny import build_tiny_llama
from rlhf.training.master_weights import MasterWeights
from rlhf.training.strategies import MasterWeightsStrategy, SingleStrategy, build_strategy


def strategy(model, dtype=torch.bfloat16, **train):
    cfg = OmegaConf.structured(TrainConfig(**{"lr": 1e-2, "max_grad_norm": 0.0, **train}))
    return build_strategy(model, model, cfg, cfg.lr, 10, dtype, choose("strategy", {"name": "auto"}, "policy.strategy"), False)


def loss_of(model, ids):
    return model(input_ids=ids, labels=ids).loss


@pytest.fixture
def ids():
    return torch.randint(3, 16, (4, 12), generator=torch.Generator().manual_seed(1))


def test_bf16_weights_step_from_float32_masters_with_float32_accumulated_gradients(ids):
    torch.manual_seed(0)
    model = build_tiny_llama(16)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    s = strategy(model)
    assert isinstance(s, MasterWeightsStrategy)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(m.dtype == torch.float32 for m in s.master.masters)
    # the masters are the float32 weights as loaded, not their bf16 rounding
    assert torch.equal(s.master.masters[0], start["model.embed_tokens.weight"])
    # two micro batches: each bf16 gradient lands in float32 and is dropped from the bf16 parameter
    expected = None
    for half in ids.chunk(2):
        loss = loss_of(model, half) / 2
        grads = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
        grads = [g.float() for g in grads]
        expected = grads if expected is None else [e + g for e, g in zip(expected, grads)]
        s.backward(loss)
    assert all(p.grad is None for p in model.parameters())
    assert all(m.grad.dtype == torch.float32 for m in s.master.masters)
    for master, want in zip(s.master.masters, expected):
        torch.testing.assert_close(master.grad, want, rtol=0, atol=0)
    # the step: float32 AdamW on the masters, then the bf16 weights are the masters rounded
    reference = [m.detach().clone().requires_grad_(True) for m in s.master.masters]
    for r, g in zip(reference, expected):
        r.grad = g
    torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.0).step()  # train.weight_decay defaults to 0
    s.optimizer_step()
    for master, param, want in zip(s.master.masters, s.master.params, reference):
        assert torch.equal(master, want.detach())
        assert torch.equal(param.detach(), want.detach().to(torch.bfloat16))
        assert master.grad is None


def test_a_non_finite_gradient_changes_neither_masters_nor_weights(ids):
    torch.manual_seed(0)
    s = strategy(build_tiny_llama(16))
    masters = [m.clone() for m in s.master.masters]
    s.backward(loss_of(s.module, ids) * float("nan"))
    assert math.isnan(s.optimizer_step())  # the norm is NaN: nothing steps
    assert s.scheduler.last_epoch == 0 and all(m.grad is None for m in s.master.masters)
    assert all(torch.equal(a, b) for a, b in zip(masters, s.master.masters))
    assert all(torch.equal(p.detach(), m.to(torch.bfloat16)) for p, m in zip(s.master.params, masters))


def test_a_checkpoint_keeps_the_float32_masters_and_resumes_them_exactly(ids, tmp_path):
    torch.manual_seed(0)
    model = build_tiny_llama(16)
    twin = copy.deepcopy(model)
    s = strategy(model)
    s.backward(loss_of(model, ids))
    s.optimizer_step()
    s.save(tmp_path)
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "model" / "model.safetensors")
    assert {t.dtype for t in saved.values()} == {torch.float32}
    resumed = strategy(twin)
    resumed.load(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(s.master.masters, resumed.master.masters))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    # the next step is the same step: optimiser moments and schedule came back too
    for run in (s, resumed):
        run.backward(loss_of(run.module, ids))
        run.optimizer_step()
    assert all(torch.equal(a, b) for a, b in zip(s.master.masters, resumed.master.masters))


def test_float32_and_autocast_keep_the_plain_strategy():
    assert type(strategy(build_tiny_llama(16), torch.float32)) is SingleStrategy
    kept = build_tiny_llama(16)
    s = strategy(kept, torch.bfloat16, mixed_precision="autocast")
    assert type(s) is SingleStrategy and all(p.dtype == torch.float32 for p in kept.parameters())


def test_tied_weights_have_one_master_under_both_names():
    model = build_tiny_llama(16)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as Qwen2.5-0.5B's are
    master = MasterWeights(model, torch.bfloat16)
    named = master.by_name(model)
    assert named["lm_head.weight"] is named["model.embed_tokens.weight"]
    assert len(master.masters) == len({id(p) for p in model.parameters()})


def test_policy_and_critic_train_in_bf16_with_float32_masters(tiny_model_dir, train_cfg, rollout):
    """`model.dtype=bfloat16` on a CPU with bf16 arithmetic: the policy and the critic (its value head too) hold bf16
    weights, take float32 logprobs and values, and one step moves their masters and, rounded, their weights."""
    from rlhf.config.schema import CriticConfig, ModelConfig, PolicyConfig
    from rlhf.training.critic import TorchCritic
    from rlhf.training.policy import TorchPolicy

    model_cfg = OmegaConf.structured(ModelConfig(name_or_path=tiny_model_dir, dtype="bfloat16"))
    train = train_cfg(lr=1e-2)
    policy = TorchPolicy(OmegaConf.structured(PolicyConfig()), model_cfg, train, 10, torch.device("cpu"))
    critic = TorchCritic(OmegaConf.structured(CriticConfig()), model_cfg, tiny_model_dir, train, 10, torch.device("cpu"))
    for model, out in ((policy, lambda: policy.logprobs(rollout)[0]), (critic, lambda: critic.values(rollout))):
        assert isinstance(model.strategy, MasterWeightsStrategy)
        assert {p.dtype for p in model.module.parameters()} == {torch.bfloat16}
        before = [m.clone() for m in model.strategy.master.masters]
        value = out()
        model.backward((value * rollout.loss_mask).sum())
        assert math.isfinite(model.optimizer_step())
        moved = [not torch.equal(a, b) for a, b in zip(before, model.strategy.master.masters)]
        assert sum(moved) > len(moved) // 2
        assert all(torch.equal(p.detach(), m.to(torch.bfloat16)) for p, m in zip(model.strategy.master.params, model.strategy.master.masters))
