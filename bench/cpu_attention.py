"""CPU attention of low-precision weights: torch's kernel in bfloat16 (and float16) against the same attention in
float32 (`rlhf.models.cpu_attention`: the inputs cast up, the output cast back), forward and backward.

    python bench/cpu_attention.py [--keys 24 71 128 256 512 1024 2048] [--calls 7]

Causal attention at SmolLM2-135M's heads (9 heads of 64; the key/value heads already repeated, as the packed path
runs them), rows x keys = 2048 tokens per call, so every length does the same token count. Prints, per length, the best
of ``calls`` of each path (alternated, after a warm-up) and the ratio low precision / float32: above 1 the float32
path is faster. `rlhf.models.cpu_attention.MAX_KEYS` is, per dtype, the longest row it is used for. Run it alone.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from rlhf.models.cpu_attention import MAX_KEYS

HEADS, DIM, TOKENS = 9, 64, 2048


def one_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, upcast: bool) -> float:
    """Seconds of one causal attention forward and backward, computed in float32 when ``upcast``."""
    start = time.perf_counter()
    if upcast:
        out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True).to(q.dtype)
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(grad)
    return time.perf_counter() - start


def compare(dtype: torch.dtype, keys: int, calls: int) -> tuple[float, float]:
    """(best seconds in ``dtype``, best seconds cast to float32) at ``keys`` keys a row."""
    rows = max(TOKENS // keys, 1)
    q, k, v = (torch.randn(rows, HEADS, keys, DIM, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(rows, HEADS, keys, DIM, dtype=dtype)
    one_call(q, k, v, grad, False), one_call(q, k, v, grad, True)  # warm-up
    native, upcast = float("inf"), float("inf")
    for _ in range(calls):
        native = min(native, one_call(q, k, v, grad, False))
        upcast = min(upcast, one_call(q, k, v, grad, True))
    return native, upcast


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, nargs="+", default=[24, 71, 128, 256, 512, 1024, 2048])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"])
    parser.add_argument("--calls", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    limits = ", ".join(f"{str(dtype).removeprefix('torch.')} {most or 'any'}" for dtype, most in MAX_KEYS.items())
    print(f"causal attention forward + backward, {HEADS} heads x {DIM}, {TOKENS} tokens a call; float32 up to: {limits}")
    print(f"{'dtype':>9} {'keys':>5} {'rows':>5} {'own kernel':>11} {'in float32':>11} {'ratio':>6}")
    for name in args.dtypes:
        for keys in args.keys:
            native, upcast = compare(getattr(torch, name), keys, args.calls)
            print(f"{name:>9} {keys:>5} {max(TOKENS // keys, 1):>5} {native * 1e3:>9.1f}ms {upcast * 1e3:>9.1f}ms "
                  f"{native / upcast:>5.2f}x", flush=True)


if __name__ == "__main__":
    main()
