"""Benchmark: one decode step of a grouped-query model with transformers' SDPA (each key/value head copied to its
query heads, as it does whenever a mask is given) against `rlhf.models.grouped_attention` (the cache read as it is),
side by side on the same model, cache and mask.

    python bench/grouped_decode.py                              # CPU: Qwen2.5-0.5B's attention shape, 4 layers
    python bench/grouped_decode.py --device cuda --layers 24 --rows 64,256 --columns 320,1088

The model has Qwen2.5-0.5B's widths (14 query heads, 2 key/value heads of 64) and a small vocabulary; ``--layers``
sets its depth. Each row attends to a random 90% of ``--columns`` cached positions.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

from cli_runs import sync
from rlhf.models.grouped_attention import NAME


def step_seconds(model, rows: int, columns: int, device, repeats: int) -> float:
    """Median seconds of one one-token forward over a cache of ``columns`` positions for ``rows`` rows."""
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    cache = DynamicCache()
    for layer in range(config.num_hidden_layers):
        kv = torch.randn(rows, config.num_key_value_heads, columns, head_dim, device=device, dtype=model.dtype)
        cache.update(kv, kv.clone(), layer)
    attend = torch.rand(rows, 1, 1, columns + 1, device=device) < 0.9
    attend[:, :, :, -1] = True
    ids = torch.randint(3, config.vocab_size, (rows, 1), device=device)
    position = torch.full((rows, 1), columns, device=device)
    times = []
    with torch.no_grad():
        for _ in range(repeats + 1):  # the first call warms up
            sync(device)
            start = time.perf_counter()
            model(input_ids=ids, position_ids=position, attention_mask=attend, past_key_values=cache, use_cache=True)
            sync(device)
            times.append(time.perf_counter() - start)
            cache.crop(-1)  # the step's own position out again
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", default="64")
    parser.add_argument("--columns", default="320,1088")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=512, hidden_size=896, intermediate_size=4864, num_hidden_layers=args.layers,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = Qwen2ForCausalLM(config).to(device, dtype).eval()
    print("| rows | cached columns | sdpa, copied heads (ms) | grouped (ms) | speed-up |\n|---|---|---|---|---|")
    for rows in [int(r) for r in args.rows.split(",")]:
        for columns in [int(c) for c in args.columns.split(",")]:
            model.set_attn_implementation("sdpa")
            copied = step_seconds(model, rows, columns, device, args.repeats)
            model.set_attn_implementation(NAME)
            grouped = step_seconds(model, rows, columns, device, args.repeats)
            print(f"| {rows} | {columns} | {copied * 1e3:.1f} | {grouped * 1e3:.1f} | {copied / grouped:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
