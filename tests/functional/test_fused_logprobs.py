"""The chunked output-layer -> logprob (+ entropy) function against the unfused computation, and its memory."""

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

from rlhf.functional import fused_logprobs

B, T, D = 2, 5, 16  # 10 tokens


def unfused(hidden, weight, targets, temperature=1.0, bias=None):
    """The reference: full (..., V) logits, then log-softmax and entropy of the tempered distribution."""
    z = F.linear(hidden, weight, bias).float() / temperature
    logp = torch.log_softmax(z, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)
    return logp, entropy


def make_inputs(vocab, with_bias, dtype=torch.float32, shape=(B, T), d=D, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, d, generator=gen).to(dtype).requires_grad_()
    weight = (0.5 * torch.randn(vocab, d, generator=gen)).to(dtype).requires_grad_()
    bias = (0.3 * torch.randn(vocab, generator=gen)).to(dtype).requires_grad_() if with_bias else None
    targets = torch.randint(0, vocab, shape, generator=gen)
    return hidden, weight, bias, targets


def values_and_grads(fn, hidden, weight, bias, targets, with_entropy, entropy_grad, seed=1):
    """Outputs and the gradients of sum(a * logp + b * entropy) for random per-token weights a, b."""
    gen = torch.Generator().manual_seed(seed)
    a, b = torch.randn(targets.shape, generator=gen), torch.randn(targets.shape, generator=gen)
    logp, entropy = fn(hidden, weight, bias, targets)
    loss = (a * logp).sum()
    if with_entropy:
        loss = loss + (b * (entropy if entropy_grad else entropy.detach())).sum()
    inputs = [hidden, weight] + ([bias] if bias is not None else [])
    return logp, entropy, torch.autograd.grad(loss, inputs)


@pytest.mark.parametrize("vocab", [7, 50, 301])
@pytest.mark.parametrize("chunk", [1, 3, B * T, B * T + 5, 0])
def test_values_and_gradients_equal_the_unfused_path(vocab, chunk):
    """Every chunking, temperature, bias and entropy mode gives the unfused logp, entropy and gradients."""
    for temperature in (1.0, 0.7):
        for with_bias in (False, True):
            for with_entropy, entropy_grad in ((False, True), (True, True), (True, False)):
                hidden, weight, bias, targets = make_inputs(vocab, with_bias)

                def fused(h, w, b, y):
                    return fused_logprobs(h, w, y, temperature, bias=b, chunk=chunk, with_entropy=with_entropy,
                                          entropy_grad=entropy_grad)

                def reference(h, w, b, y):
                    return unfused(h, w, y, temperature, bias=b)

                logp, entropy, grads = values_and_grads(fused, hidden, weight, bias, targets, with_entropy,
                                                        entropy_grad)
                ref_logp, ref_entropy, ref_grads = values_and_grads(reference, hidden, weight, bias, targets,
                                                                    with_entropy, entropy_grad)
                assert logp.shape == (B, T) and logp.dtype == torch.float32
                assert_close(logp, ref_logp)
                if with_entropy:
                    assert entropy.shape == (B, T) and entropy.dtype == torch.float32
                    assert_close(entropy, ref_entropy)
                else:
                    assert entropy is None
                for grad, ref_grad in zip(grads, ref_grads, strict=True):
                    assert_close(grad, ref_grad)


def test_float64_gradients_pass_gradcheck():
    """Finite differences agree with the hand-written backward for hidden, weight and bias, through both outputs."""
    hidden, weight, bias, targets = make_inputs(5, True, torch.float64, shape=(2, 3), d=4)

    def fn(h, w, b):
        return fused_logprobs(h, w, targets, 0.7, bias=b, chunk=2, with_entropy=True)

    assert torch.autograd.gradcheck(fn, (hidden, weight, bias))


def test_bfloat16_inputs_match_float32_math_and_keep_their_dtype():
    """bf16 hidden/weight/bias: float32 outputs near the float32 computation; gradients come back in bf16."""
    hidden, weight, bias, targets = make_inputs(301, True, torch.bfloat16)
    with_entropy = entropy_grad = True

    def fused(h, w, b, y):
        return fused_logprobs(h, w, y, 0.7, bias=b, chunk=3, with_entropy=True)

    logp, entropy, grads = values_and_grads(fused, hidden, weight, bias, targets, with_entropy, entropy_grad)
    ref_inputs = [t.detach().float().requires_grad_() for t in (hidden, weight, bias)]
    ref_logp, ref_entropy, ref_grads = values_and_grads(lambda h, w, b, y: unfused(h, w, y, 0.7, bias=b),
                                                        *ref_inputs, targets, with_entropy, entropy_grad)
    assert logp.dtype == entropy.dtype == torch.float32
    assert_close(logp, ref_logp, atol=0.1, rtol=0.02)
    assert_close(entropy, ref_entropy, atol=0.05, rtol=0.02)
    for grad, ref_grad, inp in zip(grads, ref_grads, (hidden, weight, bias), strict=True):
        assert grad.dtype == inp.dtype == torch.bfloat16
        assert_close(grad.float(), ref_grad, atol=0.05, rtol=0.05)


def test_under_autocast_backward_recomputes_the_logits_in_the_autocast_dtype():
    """float32 weights under bf16 autocast (train.mixed_precision=autocast): values and the hidden-state gradient equal
    the unfused path's (same bf16 matmuls); the weight and bias gradients differ only by bf16 rounding (the unfused
    path rounds one matmul over all tokens to bf16, this one each chunk's, summed in float32)."""
    hidden, weight, bias, targets = make_inputs(301, True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, entropy, grads = values_and_grads(
            lambda h, w, b, y: fused_logprobs(h, w, y, 0.7, bias=b, chunk=3, with_entropy=True),
            hidden, weight, bias, targets, True, True)
        ref_logp, ref_entropy, ref_grads = values_and_grads(lambda h, w, b, y: unfused(h, w, y, 0.7, bias=b),
                                                            hidden, weight, bias, targets, True, True)
    assert_close(logp, ref_logp)
    assert_close(entropy, ref_entropy)
    assert grads[0].dtype == torch.float32
    assert_close(grads[0], ref_grads[0])
    for grad, ref_grad in zip(grads[1:], ref_grads[1:], strict=True):
        assert grad.dtype == torch.float32
        assert_close(grad, ref_grad, atol=0.05, rtol=0.02)


class _LargestTensor(TorchDispatchMode):
    """Records the largest numel among the outputs of every op run under it (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _saved_numels(fn):
    """Numel of every tensor saved for backward while ``fn`` runs."""
    numels = []

    def pack(t):
        numels.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return numels, out


def test_no_tokens_by_vocab_tensor_is_saved_or_built():
    """64 tokens, V = 5000, chunk 8: nothing saved has 64 * V elements and no op, forward or backward, makes more
    than 8 * V; the unfused path saves and builds such tensors (so these checks can fail)."""
    tokens, vocab, chunk = 64, 5000, 8
    hidden, weight, bias, targets = make_inputs(vocab, True, shape=(4, 16), d=4)

    def run(fused):
        if fused:
            logp, entropy = fused_logprobs(hidden, weight, targets, 0.7, bias=bias, chunk=chunk, with_entropy=True)
        else:
            logp, entropy = unfused(hidden, weight, targets, 0.7, bias=bias)
        return (logp + 0.1 * entropy).sum()

    for fused in (True, False):
        with _LargestTensor() as mode:
            numels, loss = _saved_numels(lambda fused=fused: run(fused))
            loss.backward()
        if fused:
            assert max(numels) < tokens * vocab
            assert mode.largest <= chunk * vocab
        else:
            assert max(numels) >= tokens * vocab
            assert mode.largest >= tokens * vocab


def test_empty_input_gives_empty_outputs_and_zero_gradients():
    """No tokens: (2, 0) outputs and all-zero gradients of the right shapes."""
    hidden, weight, bias, targets = make_inputs(7, True, shape=(2, 0))
    logp, entropy = fused_logprobs(hidden, weight, targets, bias=bias, chunk=4, with_entropy=True)
    assert logp.shape == entropy.shape == (2, 0)
    (logp.sum() + entropy.sum()).backward()
    assert hidden.grad.shape == (2, 0, D)
    assert_close(weight.grad, torch.zeros_like(weight))
    assert_close(bias.grad, torch.zeros_like(bias))


def test_entropy_without_grad_is_a_detached_metric():
    """entropy_grad=False: the entropy carries no graph, the logp still does, and only logp drives the gradient."""
    hidden, weight, bias, targets = make_inputs(50, False)
    logp, entropy = fused_logprobs(hidden, weight, targets, chunk=3, with_entropy=True, entropy_grad=False)
    assert entropy.grad_fn is None and not entropy.requires_grad
    assert logp.requires_grad
    ref_logp, ref_entropy = unfused(hidden, weight, targets)
    assert_close(entropy, ref_entropy.detach())
    grads = torch.autograd.grad(logp.sum(), (hidden, weight))
    ref_grads = torch.autograd.grad(ref_logp.sum(), (hidden, weight))
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        assert_close(grad, ref_grad)


def test_flat_tokens_and_a_mismatched_target_shape():
    """hidden (N, d) works as well as (B, T, d); targets that do not match hidden's leading dims are refused."""
    hidden, weight, _, targets = make_inputs(7, False, shape=(6,))
    logp, _ = fused_logprobs(hidden, weight, targets, chunk=4)
    assert_close(logp, unfused(hidden, weight, targets)[0])
    with pytest.raises(ValueError, match="leading dims"):
        fused_logprobs(hidden, weight, targets[:5])


@pytest.mark.slow
def test_the_compiled_chunk_kernels_give_the_eager_values_and_gradients(monkeypatch):
    """On CUDA each chunk's softmax work runs compiled (`COMPILE_ON_CUDA`); compiled here on the CPU, the same
    functions give the eager values and gradients, for two chunk sizes (dynamic shapes)."""
    import sys

    fused = sys.modules["rlhf.functional.fused_logprobs"]  # the module (the package re-exports its function)

    hidden, weight, bias, targets = make_inputs(301, with_bias=True)

    def run(chunk):
        fn = lambda h, w, b, y: fused.fused_logprobs(h, w, y, 0.7, b, chunk, with_entropy=True)  # noqa: E731
        logp, entropy, grads = values_and_grads(fn, hidden, weight, bias, targets, True, True)
        return [logp, entropy, *grads]

    eager = {chunk: run(chunk) for chunk in (3, 7)}
    compiled = {}
    monkeypatch.setattr(fused, "_kernel", lambda fn, device: compiled.setdefault(fn, torch.compile(fn, dynamic=True)))
    for chunk, want in eager.items():
        for got, expected in zip(run(chunk), want):
            assert_close(got, expected, rtol=1e-4, atol=1e-5)  # float32 sums in another order
    assert len(compiled) == 2  # the forward and the gradient kernels both ran compiled
