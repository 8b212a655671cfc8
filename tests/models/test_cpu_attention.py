"""Attention of low-precision weights on the CPU in float32 (`rlhf.models.cpu_attention`): where it applies, that it
computes float32's attention, and that packed and shared-prefix training forwards of a bfloat16 model reach it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

from rlhf.models import cpu_attention, packing
from rlhf.models.logprobs import window_logprobs
from test_shared_prefix import grouped_rows


def qkv(dtype: torch.dtype, keys: int = 12, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 4, keys, 16, generator=g).to(dtype).requires_grad_() for _ in range(3)]


def test_only_low_precision_on_the_cpu_over_short_rows_upcasts():
    q, k, _ = qkv(torch.bfloat16)
    assert cpu_attention.upcasts(q, k)
    assert cpu_attention.upcasts(q.half(), k.half())
    assert not cpu_attention.upcasts(q.float(), k.float())
    long_keys = torch.zeros(3, 4, cpu_attention.MAX_KEYS[torch.bfloat16] + 1, 16, dtype=torch.bfloat16)
    assert not cpu_attention.upcasts(q, long_keys)
    assert cpu_attention.upcasts(q.half(), long_keys.half())  # float16's kernel is slower at every length


def test_float32_attention_is_torch_s_own_bit_for_bit():
    q, k, v = qkv(torch.float32)
    assert torch.equal(cpu_attention.sdpa(q, k, v, is_causal=True), F.scaled_dot_product_attention(q, k, v, is_causal=True))


@pytest.mark.parametrize("mask", ["causal", "boolean", "additive"])
def test_bfloat16_attention_is_float32_s_cast_back_and_its_gradients_reach_the_bf16_inputs(mask):
    q, k, v = qkv(torch.bfloat16)
    allowed = torch.rand(3, 1, 12, 12, generator=torch.Generator().manual_seed(2)) > 0.3
    allowed[..., 0] = True  # every query sees at least one key
    kwargs = {
        "causal": {"is_causal": True}, "boolean": {"attn_mask": allowed},
        "additive": {"attn_mask": torch.zeros(allowed.shape, dtype=torch.bfloat16).masked_fill(~allowed, float("-inf"))},
    }[mask]
    out = cpu_attention.sdpa(q, k, v, **kwargs)
    exact_kwargs = {key: (value.float() if key == "attn_mask" and value.is_floating_point() else value) for key, value in kwargs.items()}
    exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **exact_kwargs)
    assert out.dtype == torch.bfloat16 and torch.equal(out, exact.to(torch.bfloat16))
    out.float().square().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.bfloat16 and t.grad.abs().sum() > 0 for t in (q, k, v))


class AttentionDtypes(TorchDispatchMode):
    """The input dtypes of every SDPA kernel call."""

    def __init__(self):
        super().__init__()
        self.dtypes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in str(func) and "backward" not in str(func):
            self.dtypes.append(args[0].dtype)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("share", [False, True], ids=["packed", "shared-prefix"])
def test_a_bfloat16_model_s_training_forward_attends_in_float32_unless_rows_are_long(monkeypatch, share):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=40, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
    )).to(torch.bfloat16)
    assert packing.enable(model)
    batch = grouped_rows([5, 7], [[3, 6], [4, 2]])

    def forward() -> tuple[list[torch.dtype], torch.Tensor]:
        with AttentionDtypes() as seen:
            logp = window_logprobs(model, batch, 1.0, share=share)[0]
        return seen.dtypes, logp

    dtypes, upcast = forward()
    assert dtypes and set(dtypes) == {torch.float32}
    upcast.sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in model.parameters() if p.requires_grad)
    monkeypatch.setattr(cpu_attention, "MAX_KEYS", {})  # no dtype upcast: bf16's own kernel
    dtypes, native = forward()
    assert set(dtypes) == {torch.bfloat16}
    mask = batch.loss_mask.bool()
    # the same logprobs up to bf16's attention rounding, and not the same computation
    torch.testing.assert_close(upcast.detach()[mask], native.detach()[mask], rtol=0, atol=0.1)
    assert not torch.equal(upcast.detach(), native.detach())
