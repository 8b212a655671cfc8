"""Per-token logprobs (and entropies) straight from the last hidden states and the output layer, chunk by chunk.

The unfused path builds the full (tokens, V) float32 logits and keeps them (and their softmax) for backward; with a
large vocabulary that tensor dominates memory. Here forward and backward each hold one chunk of (chunk, V) logits at
a time: backward recomputes them from the saved hidden states and keeps only two float32 numbers per token.

Shapes: N = tokens (rows of the flattened hidden), d = hidden size, V = vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _chunk_bounds(n_tokens: int, chunk: int) -> list[tuple[int, int]]:
    """[start, end) row ranges of at most ``chunk`` rows; one range when chunk <= 0 or chunk >= n_tokens."""
    step = chunk if 0 < chunk < n_tokens else max(n_tokens, 1)
    return [(start, min(start + step, n_tokens)) for start in range(0, n_tokens, step)]


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for bf16, fp16 and float32 inputs; float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def _scaled_log_softmax(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float,
                        lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-softmax of one chunk's logits / temperature, in float32, and its logsumexp.

    Shape: h (n, d), weight (V, d), bias (V,) -> (n, V), (n,). The matmul runs in the inputs' dtype, like
    ``F.linear(h, weight, bias).float()``; a given ``lse`` (saved by forward) is reused, not recomputed.
    float64 inputs stay float64 (so gradcheck can test the backward).
    """
    z = F.linear(h, weight, bias)
    z = z.to(_stats_dtype(z.dtype))
    if temperature != 1.0:
        z = z.div_(temperature)
    if lse is None:
        lse = torch.logsumexp(z, dim=-1)
    return z.sub_(lse.unsqueeze(-1)), lse


def _logit_grad(logq: torch.Tensor, y: torch.Tensor, g_logp: torch.Tensor, entropy: torch.Tensor | None,
                g_entropy: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """Gradient of the loss with respect to one chunk's unscaled logits, in float32 (overwrites ``logq``).

    Shape: logq (n, V), y, g_logp, entropy, g_entropy (n,) -> (n, V). With p = softmax(z):
    d logp(y)/dz = onehot(y) - p and dH/dz = -p (z - E_p[z]) = -p (log p + H); dz/dlogits = 1 / temperature.
    """
    p = logq.exp()
    if g_entropy is not None:
        entropy_term = logq.add_(entropy.unsqueeze(-1)).mul_(p).mul_(-g_entropy.unsqueeze(-1))
    grad = p.mul_(-g_logp.unsqueeze(-1)).scatter_add_(1, y.unsqueeze(-1), g_logp.unsqueeze(-1))
    if g_entropy is not None:
        grad.add_(entropy_term)
    return grad.div_(temperature) if temperature != 1.0 else grad


def _chunk_forward(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, temperature: float,
                   with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk's (logp, lse, entropy or None). Shapes: h (n, d), y (n,) -> (n,) each."""
    logq, lse = _scaled_log_softmax(h, weight, bias, temperature)
    logp = logq.gather(1, y.unsqueeze(-1)).squeeze(-1)
    # -sum p log p rather than lse - E[z]: no cancellation when one token takes nearly all the mass
    entropy = -logq.exp().mul_(logq).sum(-1) if with_entropy else None
    return logp, lse, entropy


def _chunk_grad(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lse: torch.Tensor, y: torch.Tensor,
                g_logp: torch.Tensor, entropy: torch.Tensor | None, g_entropy: torch.Tensor | None,
                temperature: float) -> torch.Tensor:
    """One chunk's gradient with respect to its unscaled logits, in float32, from the recomputed logits. Shapes:
    h (n, d), the rest (n,) -> (n, V)."""
    logq, _ = _scaled_log_softmax(h, weight, bias, temperature, lse)
    return _logit_grad(logq, y, g_logp, entropy, g_entropy, temperature)


COMPILE_ON_CUDA = True  # CUDA: each chunk's softmax work compiled into a few fused passes over its (chunk, V) logits
_COMPILED: dict = {}


def _kernel(fn, device: torch.device):
    """``fn`` compiled (dynamic shapes, once per process) on CUDA with `COMPILE_ON_CUDA`, else ``fn`` itself (the CPU
    stays eager: the same arithmetic as the unfused path)."""
    if device.type != "cuda" or not COMPILE_ON_CUDA:
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=True)
    return _COMPILED[fn]


def _autocast_state(device_type: str) -> tuple[str, torch.dtype | None]:
    """The device type and its autocast dtype, None when autocast is off (backward must recompute alike)."""
    return device_type, torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


class _FusedLogprobs(torch.autograd.Function):
    """Autograd for `fused_logprobs` on flattened tokens; outputs logp (N,) and, if asked, entropy (N,)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk, with_entropy, entropy_grad):
        n_tokens = hidden.shape[0]
        lse = hidden.new_empty(n_tokens, dtype=_stats_dtype(hidden.dtype))
        logp = torch.empty_like(lse)
        entropy = torch.empty_like(lse) if with_entropy else None
        forward = _kernel(_chunk_forward, hidden.device)
        for start, end in _chunk_bounds(n_tokens, chunk):
            rows = slice(start, end)
            logp[rows], lse[rows], chunk_entropy = forward(hidden[rows], weight, bias, targets[rows], temperature, with_entropy)
            if with_entropy:
                entropy[rows] = chunk_entropy
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.device_type, ctx.autocast_dtype = _autocast_state(hidden.device.type)
        ctx.entropy_grad = with_entropy and entropy_grad
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy if ctx.entropy_grad else None)
        ctx.set_materialize_grads(False)  # an output the loss does not use arrives as None: skip its work
        if not with_entropy:
            return logp
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy=None):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        if g_logp is None:
            g_logp = lse.new_zeros(lse.shape)
        if not ctx.entropy_grad:
            g_entropy = None
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=_stats_dtype(weight.dtype)) if need_weight else None
        grad_bias = torch.zeros_like(bias, dtype=_stats_dtype(bias.dtype)) if need_bias else None
        # recompute the logits in forward's precision: under autocast, in its dtype, as the unfused linear did
        with torch.autocast(ctx.device_type, dtype=ctx.autocast_dtype, enabled=ctx.autocast_dtype is not None):
            logit_grad = _kernel(_chunk_grad, hidden.device)
            for start, end in _chunk_bounds(hidden.shape[0], ctx.chunk):
                rows = slice(start, end)
                grad_z = logit_grad(hidden[rows], weight, bias, lse[rows], targets[rows], g_logp[rows],
                                    None if g_entropy is None else entropy[rows],
                                    None if g_entropy is None else g_entropy[rows], ctx.temperature)
                if need_bias:
                    grad_bias += grad_z.sum(0)
                grad_z = grad_z.to(hidden.dtype)  # the linear's backward: inputs' (or autocast's) dtype, as unfused
                if need_hidden:
                    grad_hidden[rows] = grad_z @ weight
                if need_weight:
                    grad_weight += grad_z.t() @ hidden[rows]
        grad_weight = grad_weight.to(weight.dtype) if need_weight else None
        grad_bias = grad_bias.to(bias.dtype) if need_bias else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def fused_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   bias: torch.Tensor | None = None, chunk: int = 1024, with_entropy: bool = False,
                   entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of each target (and the entropy) under softmax((hidden @ weight.T + bias) / temperature), in float32
    (float64 for float64 inputs).

    Shape: hidden (..., d), weight (V, d), bias (V,) or None, targets (...) int64 -> logp (...), entropy (...) or
    None. Equal to the unfused ``log_softmax(F.linear(hidden, weight, bias).float() / temperature)`` gathered at the
    targets, but no (tokens, V) tensor is built or saved: ``chunk`` tokens at a time (<= 0: all at once). The
    entropy is returned only with ``with_entropy``; with ``entropy_grad=False`` it is a detached metric.
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"targets {tuple(targets.shape)} must match hidden's leading dims {tuple(hidden.shape[:-1])}")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    out = _FusedLogprobs.apply(flat_hidden, weight, bias, targets.reshape(-1), float(temperature), int(chunk),
                               with_entropy, entropy_grad)
    logp, entropy = out if with_entropy else (out, None)
    return logp.view(targets.shape), None if entropy is None else entropy.view(targets.shape)
