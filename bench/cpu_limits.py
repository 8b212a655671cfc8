"""Benchmark: what bounds a small model's training and decoding on this machine, and what torch.compile changes.

`throughput.py` measures whole steps; this probes the two stages it cannot push further at small sizes, on a random
Llama of one of its shapes (default 3m), in one process:

1. Matrix products. The square peak that `throughput.py`'s MFU is measured against, and the rate of the model's own
   training products at a micro batch of ``--tokens`` tokens: every linear layer's forward product and both backward
   products (input and weight gradients), FLOP-weighted.
2. Training. Forward and backward of micro batches shaped like the run's (the token budget filled by rows of a few
   lengths, some left-padded), eager and with every decoder layer under `torch.compile`, alternated. It prints the
   MFU on the real (unpadded) tokens, and from a profile of a warm eager pass the matrix products' share of the
   pass's wall time and their rate inside it: the rest is per-operation work (norms, rotary, activations,
   attention) and the Python between operations.
3. Decoding. One KV-cached decode step at 1 to 64 rows, eager and with the model under `torch.compile`: a step's
   fixed cost (1 row) against what each row adds, and the seconds the compiled model's first call of each batch
   size takes (compiling).

    python bench/cpu_limits.py                       # 3m, with the compile probes (~3 min on 2 cores)
    python bench/cpu_limits.py --size 30m --no-compile
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cli_runs import matmul_peak, train_flops
from throughput import SHAPES, VOCAB

WIDTHS = (80, 64, 48, 32)  # row lengths of the micro batches (prompt + response), as a young policy's vary
DECODE_ROWS = (1, 8, 32, 64)
CONTEXT = 40  # tokens already in the KV cache when a decode step is timed
LEFT_PAD = 3  # padding columns on the left of half the rows of a training micro batch


def random_llama(size: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, intermediate, heads = SHAPES[size]
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=512, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def timed(fn, repeats: int) -> float:
    """Seconds per call of ``fn`` (after one warm-up call), the median of ``repeats``."""
    return warm_and_timed(fn, repeats)[1]


def warm_and_timed(fn, repeats: int) -> tuple[float, float]:
    """(seconds of a first, warm-up call of ``fn``, the median seconds of ``repeats`` calls after it)."""
    warm = once(fn)
    return warm, statistics.median(once(fn) for _ in range(repeats))


def once(fn) -> float:
    """Seconds of one call of ``fn``."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def product_rate(shapes: list[tuple[int, int, int]], repeats: int = 20) -> float:
    """FLOP/s of the products ``x (M, K) @ w (K, N)`` for each shape, FLOP-weighted over all of them."""
    flops = seconds = 0.0
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        seconds += timed(lambda: a @ b, repeats)
        flops += 2 * m * k * n
    return flops / seconds


def training_products(config, tokens: int) -> list[tuple[int, int, int]]:
    """(M, K, N) of every product one training micro batch of ``tokens`` tokens runs in the linear layers: per layer
    q, k, v, o, gate, up, down, each forward (T x in @ in x out), input gradient (T x out @ out x in) and weight
    gradient (out x T @ T x in)."""
    d, inner = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * (d // config.num_attention_heads)
    shapes = []
    for fan_in, fan_out in [(d, d), (d, kv), (d, kv), (d, d), (d, inner), (d, inner), (inner, d)]:
        shapes += [(tokens, fan_in, fan_out), (tokens, fan_out, fan_in), (fan_out, tokens, fan_in)]
    return shapes * config.num_hidden_layers


def micro_batches(tokens: int) -> list[tuple[int, int]]:
    """(rows, width) of micro batches that fill a ``tokens`` budget with rows of each of `WIDTHS`."""
    return [(max(1, tokens // width), width) for width in WIDTHS]


def train_pass(model, shapes: list[tuple[int, int]]) -> None:
    """Forward and backward of a token-mean logprob loss on each (rows, width) micro batch; gradients dropped."""
    for rows, width in shapes:
        ids = torch.randint(3, VOCAB, (rows, width))
        mask = torch.ones(rows, width, dtype=torch.long)
        mask[: rows // 2, :LEFT_PAD] = 0  # left padding on half the rows, as prompts of different lengths leave
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        logp = logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        (-(logp * mask[:, 1:]).sum() / mask[:, 1:].sum()).backward()
    model.zero_grad(set_to_none=True)


def product_time(model, shapes: list[tuple[int, int]]) -> tuple[float, float]:
    """(seconds in matrix products, wall seconds) of one warm eager training pass, under the torch profiler."""
    from torch.profiler import ProfilerActivity, profile

    train_pass(model, shapes)  # warm: the first pass allocates what later ones reuse
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        train_pass(model, shapes)
        wall = time.perf_counter() - start
    products = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in ("aten::mm", "aten::addmm", "aten::bmm"))
    return products / 1e6, wall


def decode_step_time(model, rows: int, repeats: int) -> tuple[float, float]:
    """(seconds of the first, seconds of a later KV-cached decode step) of ``rows`` rows after `CONTEXT` cached
    tokens."""
    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.randint(3, VOCAB, (rows, CONTEXT)), past_key_values=cache, use_cache=True)
        token, mask = torch.randint(3, VOCAB, (rows, 1)), torch.ones(rows, CONTEXT + 1, dtype=torch.long)
        position = torch.full((rows, 1), CONTEXT)

        def step() -> None:
            model(input_ids=token, attention_mask=mask, position_ids=position, past_key_values=cache, use_cache=True)
            cache.crop(-1)  # back to the same context, so every timed step does the same work

        return warm_and_timed(step, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="3m", help=f"model shape, of {', '.join(SHAPES)}")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per training micro batch (throughput.py's budget)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats of each measurement")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile variants (compiling takes 10-60 s)")
    args = parser.parse_args()
    model = random_llama(args.size)
    config = model.config
    compiling = not args.no_compile

    peak = matmul_peak(torch.device("cpu"), (512, 1024, 2048), torch.float32)
    own = product_rate(training_products(config, args.tokens))
    print(f"matrix products: square peak {peak / 1e9:.0f} GFLOP/s; this model's training products at {args.tokens} "
          f"tokens {own / 1e9:.0f} GFLOP/s ({own / peak:.0%} of the peak)", flush=True)

    shapes = micro_batches(args.tokens)
    real = sum(rows * width - rows // 2 * LEFT_PAD for rows, width in shapes)  # the left padding of `train_pass` left out
    flops = train_flops(config, real, real, sum(rows * width**2 for rows, width in shapes))
    in_products, wall = product_time(model, shapes)
    padded = sum(rows * width for rows, width in shapes)
    product_flops = sum(2 * m * k * n for m, k, n in training_products(config, padded))
    eager = timed(lambda: train_pass(model, shapes), args.repeats)
    print(f"training, {len(shapes)} micro batches of {args.tokens} tokens: eager {eager:.3f} s, MFU {flops / eager / peak:.0%} "
          f"on real tokens; matrix products {in_products / wall:.0%} of the time, at {product_flops / in_products / 1e9:.0f} "
          f"GFLOP/s inside the pass", flush=True)
    if compiling:
        compiled = random_llama(args.size)
        for layer in compiled.model.layers:
            layer.compile(dynamic=True)
        warm = once(lambda: train_pass(compiled, shapes))
        pairs = [(once(lambda: train_pass(model, shapes)), once(lambda: train_pass(compiled, shapes))) for _ in range(args.repeats)]
        plain, fused = (statistics.median(p[i] for p in pairs) for i in (0, 1))
        print(f"training with each decoder layer compiled: {fused:.3f} s against eager {plain:.3f} s alternated "
              f"({plain / fused:.2f}x; MFU {flops / fused / peak:.0%}); compiling took {warm:.0f} s", flush=True)

    print("\n| rows | decode step, eager (ms) |" + (" compiled (ms) | speed-up | first compiled call (s) |" if compiling else ""))
    print("|---|---|" + ("---|---|---|" if compiling else ""))
    whole = None
    if compiling:
        whole = random_llama(args.size).eval()
        whole.forward = torch.compile(whole.forward, dynamic=True)
    model.eval()
    for rows in DECODE_ROWS:
        plain = decode_step_time(model, rows, args.repeats * 10)[1]
        line = f"| {rows} | {plain * 1e3:.2f} |"
        if whole is not None:
            first, fused = decode_step_time(whole, rows, args.repeats * 10)
            line += f" {fused * 1e3:.2f} | {plain / fused:.2f}x | {first:.1f} |"
        print(line, flush=True)


if __name__ == "__main__":
    main()
