"""The trained policy (optimiser, LR schedule) and the frozen reference."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf import registry
from rlhf.generators.base import SamplingParams
from rlhf.models.logprobs import window_logprobs
from rlhf.training.optim import lr_lambda
from rlhf.training.policy import TorchPolicy
from rlhf.models.reference import FrozenReference

CPU = torch.device("cpu")


def reference_logprobs(reference: FrozenReference, batch) -> torch.Tensor:
    """The reference's logprobs of the whole batch in one forward, without gradients. Shape: (B, T)."""
    return reference.rollout_logprobs(batch, chunk=len(batch))


def make_policy(policy_cfg, model_cfg, train_cfg, total_steps: int = 10, **train_overrides) -> TorchPolicy:
    """A TorchPolicy on CPU for the tiny model."""
    train = train_cfg(**train_overrides)
    return TorchPolicy(policy_cfg, model_cfg, train, total_optimizer_steps=total_steps, device=CPU)


def train_step(policy: TorchPolicy, rollout) -> float:
    """One step raising the likelihood of the rollout's responses; returns the gradient norm."""
    logprobs, _ = policy.logprobs(rollout)
    policy.backward(-logprobs.sum() / rollout.loss_mask.sum())
    return policy.optimizer_step()


# --- lr_lambda ----------------------------------------------------------------------------------------


def test_lr_lambda_constant_is_one_everywhere():
    """Constant schedule without warm-up keeps the peak learning rate."""
    factor = lr_lambda("constant", warmup_steps=0, total_steps=10)
    assert [factor(s) for s in (0, 5, 9, 50)] == [1.0, 1.0, 1.0, 1.0]


def test_lr_lambda_linear_decays_to_zero():
    """Linear schedule falls from 1 at step 0 to 0 at the last step and stays at 0 after."""
    factor = lr_lambda("linear", warmup_steps=0, total_steps=10)
    assert factor(0) == pytest.approx(1.0)
    assert factor(5) == pytest.approx(0.5)
    assert factor(10) == pytest.approx(0.0)
    assert factor(12) == 0.0
    values = [factor(s) for s in range(11)]
    assert all(a > b for a, b in zip(values, values[1:]))


def test_lr_lambda_warmup_then_constant():
    """Warm-up rises linearly to 1 over warmup_steps, then stays at 1."""
    factor = lr_lambda("constant", warmup_steps=4, total_steps=10)
    assert [factor(s) for s in range(6)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])


def test_lr_lambda_warmup_then_linear_decay():
    """Warm-up, then linear decay over the remaining steps to 0 at total_steps."""
    factor = lr_lambda("linear", warmup_steps=2, total_steps=10)
    assert factor(0) == pytest.approx(0.5)
    assert factor(2) == pytest.approx(1.0)
    assert factor(6) == pytest.approx(0.5)
    assert factor(10) == pytest.approx(0.0)


# --- TorchPolicy --------------------------------------------------------------------------------------


def test_policy_is_registered():
    """The config name `torch` builds TorchPolicy."""
    assert registry.resolve("policy", "torch") is TorchPolicy
    assert registry.resolve("reference", "frozen") is FrozenReference


def test_optimizer_step_changes_weights_and_returns_grad_norm(policy_cfg, model_cfg, train_cfg, rollout):
    """A step moves the weights, clears the gradients and returns the finite pre-clip gradient norm."""
    policy = make_policy(policy_cfg, model_cfg, train_cfg, lr=1e-2, max_grad_norm=1e-3)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    logprobs, _ = policy.logprobs(rollout)
    policy.backward(-logprobs.sum())
    expected_norm = torch.linalg.vector_norm(
        torch.stack([p.grad.norm() for p in policy.model.parameters() if p.grad is not None])
    ).item()
    norm = policy.optimizer_step()
    assert math.isfinite(norm) and norm > 1e-3  # pre-clip: larger than the clip threshold
    assert norm == pytest.approx(expected_norm, rel=1e-4)
    after = policy.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in policy.model.parameters())


def test_training_raises_likelihood_of_rollout(policy_cfg, model_cfg, train_cfg, rollout):
    """A few steps on -logprob make the rollout's responses more likely."""
    policy = make_policy(policy_cfg, model_cfg, train_cfg, lr=1e-2)
    with torch.no_grad():
        start = policy.logprobs(rollout)[0].sum()
    for _ in range(3):
        train_step(policy, rollout)
    with torch.no_grad():
        assert policy.logprobs(rollout)[0].sum() > start


def test_policy_lr_follows_schedule(policy_cfg, model_cfg, train_cfg, rollout):
    """The optimiser's learning rate follows warm-up then linear decay, one value per optimizer_step."""
    policy = make_policy(policy_cfg, model_cfg, train_cfg, total_steps=4, lr=0.1, lr_schedule="linear", warmup_steps=2)
    seen = [policy.lr]
    for _ in range(4):
        train_step(policy, rollout)
        seen.append(policy.lr)
    assert seen == pytest.approx([0.05, 0.1, 0.1, 0.05, 0.0])


def test_policy_logprobs_have_gradients_and_entropy(policy_cfg, model_cfg, train_cfg, rollout):
    """Policy logprobs carry gradients, are 0 outside the response mask, and entropy is returned on request."""
    policy = make_policy(policy_cfg, model_cfg, train_cfg)
    logprobs, entropy = policy.logprobs(rollout, with_entropy=True)
    assert logprobs.requires_grad and logprobs.shape == rollout.window_ids.shape
    assert logprobs[rollout.loss_mask == 0].eq(0).all()
    assert entropy.shape == logprobs.shape and entropy[rollout.loss_mask.bool()].gt(0).all()


def test_generator_sync_after_policy_step(policy_cfg, model_cfg, train_cfg, make_generator, tiny_model_dir, encode):
    """After a policy step and update_weights, generator logprobs are the trained policy's."""
    policy = make_policy(policy_cfg, model_cfg, train_cfg, lr=1e-2)
    generator = make_generator(tiny_model_dir)
    sampling = SamplingParams(max_new_tokens=5, temperature=0.8)
    rollout = generator.generate(encode(["1+2=", "33+4=", "5"]) * 3, sampling)
    train_step(policy, rollout)
    generator.update_weights(policy.state_dict())
    fresh = generator.generate(encode(["1+2=", "33+4=", "5"]) * 3, sampling)
    with torch.no_grad():
        expected, _ = window_logprobs(policy.model, fresh, 0.8)
        stale, _ = window_logprobs(make_generator(tiny_model_dir).model, fresh, 0.8)
    torch.testing.assert_close(fresh.gen_logp, expected, atol=1e-4, rtol=0)
    assert (fresh.gen_logp - stale).abs().max() > 1e-3


def test_policy_and_reference_take_logprobs_at_the_sampling_temperature(policy_cfg, model_cfg, train_cfg, reference_cfg, rollout):
    """Built with the generator's temperature (`generator.temperature`), the policy and the reference score at it:
    the logits divided by 0.7, not the model's plain distribution."""
    policy = TorchPolicy(policy_cfg, model_cfg, train_cfg(), total_optimizer_steps=1, device=CPU, temperature=0.7)
    reference = FrozenReference(reference_cfg(), model_cfg, CPU, temperature=0.7)
    with torch.no_grad():
        expected, _ = window_logprobs(policy.model, rollout, 0.7)
        plain, _ = window_logprobs(policy.model, rollout, 1.0)
        torch.testing.assert_close(policy.logprobs(rollout)[0], expected, atol=1e-6, rtol=0)
        torch.testing.assert_close(policy.rollout_logprobs(rollout, chunk=2)[0], expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(reference_logprobs(reference, rollout), expected, atol=1e-5, rtol=0)
    assert (expected - plain).abs().max() > 1e-3


# --- FrozenReference ----------------------------------------------------------------------------------


def test_reference_is_frozen_and_unaffected_by_training(policy_cfg, model_cfg, train_cfg, reference_cfg, rollout):
    """The reference has no trainable parameters and its logprobs stay put while the policy trains."""
    reference = FrozenReference(reference_cfg(), model_cfg, CPU)
    assert not any(p.requires_grad for p in reference.model.parameters())
    assert not reference.model.training
    policy = make_policy(policy_cfg, model_cfg, train_cfg, lr=1e-2)
    ref_before = reference_logprobs(reference, rollout)
    with torch.no_grad():
        torch.testing.assert_close(policy.logprobs(rollout)[0], ref_before, atol=1e-5, rtol=0)
    assert not ref_before.requires_grad
    for _ in range(3):
        train_step(policy, rollout)
    torch.testing.assert_close(reference_logprobs(reference, rollout), ref_before, atol=0, rtol=0)
    with torch.no_grad():
        assert (policy.logprobs(rollout)[0] - ref_before).abs().max() > 1e-3


def test_reference_loads_its_own_weights_when_named(model_cfg, reference_cfg, other_model_dir, tiny_model_dir, rollout):
    """reference.name_or_path picks other weights than the policy's starting point."""
    own = reference_logprobs(FrozenReference(reference_cfg(), model_cfg, CPU), rollout)
    other = reference_logprobs(FrozenReference(reference_cfg(name_or_path=other_model_dir), model_cfg, CPU), rollout)
    same = reference_logprobs(FrozenReference(reference_cfg(name_or_path=tiny_model_dir), model_cfg, CPU), rollout)
    torch.testing.assert_close(same, own, atol=0, rtol=0)
    assert (other - own).abs().max() > 1e-2
