"""Benchmark: the hf generator's decode paths side by side (eager loop, eager loop compiled, static cache, static
compiled, and on CUDA the static step replayed from CUDA graphs, with and without compile).

Each path is an `HFGenerator` with its `generator.*` keys, on the same model folder and prompts, timed in turns
(median of ``--repeats``, after a warm-up call that compiles and records). It prints seconds per call, real tokens
per second, the ratio to the eager loop, whether greedy decoding gave the eager loop's tokens, and on CUDA the
memory-bandwidth floor: per step the weights and the rows' cache read once, at the copy bandwidth measured in
this run.

    python bench/generate.py                         # CPU: the 3M model of bench/throughput.py, 64 rows x 64 tokens
    python bench/generate.py --shortest 16 --prompt-len 16   # prompts of 16 tokens each (default: 4 to 6, the built-in task's)
    python bench/generate.py --device cuda --shape qwen0.5b --rows 64,256 --new 256,1024 --shortest 16 --prompt-len 16

On the CPU the rows sample at temperature 1 from a random 32-token model and stop at EOS after a few dozen tokens,
like a young policy's in the GRPO step of `bench/throughput.py`; on CUDA (a 151,936-token vocabulary) rows
practically never stop, so every row decodes ``--new`` tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from cli_runs import save_random_llama, sync
from rlhf.config.schema import ModelConfig
from rlhf.generators.base import SamplingParams
from rlhf.generators.hf import HFGenerator, HfGeneratorConfig
from rlhf.generators.memory import kv_cache_bytes
from rlhf.models.loading import load_tokenizer

# hidden, layers, intermediate, heads, key/value heads
SHAPES = {"0.1m": (64, 2, 128, 2, 2), "3m": (256, 4, 512, 4, 4), "3m-gqa": (256, 4, 512, 8, 2), "qwen0.5b": (896, 24, 4864, 14, 2)}
PATHS = {  # name: generator keys
    "eager": dict(decode="eager"),
    "eager+compile": dict(decode="eager", compile=True),
    "static": dict(decode="static", graphs=False),
    "static+compile": dict(decode="static", compile=True, graphs=False),
    # transformers' SDPA: prompts prefilled as the padded batch, not packed (and grouped-query caches copied per head)
    "static+compile-padded": dict(decode="static", compile=True, graphs=False, grouped_decode=False),
    # rows padded to powers of 2, as with graphs (without them a batch runs at its own size)
    "static+compile-pow2": dict(decode="static", compile=True, graphs=False, buckets=[2**i for i in range(10)]),
    "graphs": dict(decode="static", graphs=True),
    "graphs+compile": dict(decode="static", compile=True, graphs=True),
    # transformers' SDPA as is: each key/value head copied to its query heads every step (grouped-query models only)
    "eager-ungrouped": dict(decode="eager", grouped_decode=False),
    "static-ungrouped": dict(decode="static", graphs=False, grouped_decode=False),
    "graphs-ungrouped": dict(decode="static", graphs=True, grouped_decode=False),
}
EAGER_MAX_NEW = 256  # the eager paths on CUDA take ~20-40 ms a token: longer responses are skipped (minutes each)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write), the best of five."""
    source = torch.empty(2**28, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(5):
        sync(device)
        start = time.perf_counter()
        target.copy_(source)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * source.numel() * 4 / best


def floor_seconds(model, rows: int, prompt: float, new: int, bandwidth: float) -> float:
    """The memory-bandwidth floor of decoding ``new`` tokens for ``rows`` rows of ``prompt`` prompt tokens (a mean):
    every step reads the weights once and each row's cache so far once."""
    config = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    read = sum(rows * (prompt + step) for step in range(new))  # cached positions read over the steps
    cache = kv_cache_bytes(config.num_hidden_layers, heads, head_dim, read, next(model.parameters()).element_size())
    return (new * weights + cache) / bandwidth


def measure(generators: dict[str, HFGenerator], prompts, sampling, repeats: int, device) -> tuple[dict, dict]:
    """(median seconds per `generate` call, real tokens of the warm-up call) of each generator, called in turns (the
    warm-up call first, which compiles and records)."""
    tokens = {}
    for name, generator in generators.items():
        began = time.perf_counter()
        tokens[name] = int(generator.generate(prompts, sampling).loss_mask.sum())
        print(f"{name}: warm-up call {time.perf_counter() - began:.1f} s", file=sys.stderr, flush=True)
    times = {name: [] for name in generators}
    for _ in range(repeats):
        for name, generator in generators.items():
            sync(device)
            start = time.perf_counter()
            generator.generate(prompts, sampling)
            sync(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}, tokens


def bench(folder: str, device: torch.device, sizes, paths, prompt_len: int, repeats: int,
          deadline: float = float("inf"), strict: bool = True, shortest: int | None = None) -> tuple[list[dict], dict[str, HFGenerator]]:
    """(one row of figures per (rows, new tokens) of ``sizes`` and path, the generators). Prompts have ``prompt_len``
    tokens, or from ``shortest`` to ``prompt_len`` (uniformly) where given. One generator per path
    serves every size (a compiled step compiles once per model, not once per size). Sizes are taken in the order
    given; one that would start past ``deadline`` is skipped. Not ``strict``: a path that raises is reported in a row
    of its own and left out of the sizes after, so one broken path costs only its own figures."""
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else None
    made = {name: path_generator(folder, device, name, max(r for r, _ in sizes)) for name in paths}
    results = []

    def broke(name: str, rows: int, new: int, error: Exception) -> None:
        if strict:
            raise error
        del made[name]
        results.append({"rows": rows, "new_tokens": new, "path": name, "error": f"{type(error).__name__}: {error}"[:600]})
        print(results[-1], file=sys.stderr, flush=True)

    for rows, new in sizes:
        if time.perf_counter() > deadline:
            results.append({"rows": rows, "new_tokens": new, "skipped": "out of time"})
            continue
        generator = torch.Generator().manual_seed(rows + new)
        lengths = torch.randint(shortest or prompt_len, prompt_len + 1, (rows,), generator=generator).tolist()
        prompts = [torch.randint(3, 30, (n,), generator=generator).tolist() for n in lengths]
        greedy = {}
        for name in [n for n in made if not (n.startswith("eager") and device.type == "cuda" and new > EAGER_MAX_NEW)]:
            try:
                began = time.perf_counter()
                greedy[name] = made[name].generate(prompts, SamplingParams(min(new, 32), greedy=True)).input_ids
                print(f"{name} {rows}x{new}: greedy call {time.perf_counter() - began:.1f} s", file=sys.stderr, flush=True)
            except Exception as error:  # noqa: BLE001 - reported as the path's row
                broke(name, rows, new, error)
        chosen = {name: made[name] for name in greedy}
        torch.manual_seed(0)
        seconds, tokens = measure(chosen, prompts, SamplingParams(new, temperature=1.0), repeats, device)
        floor = floor_seconds(next(iter(made.values())).model, rows, sum(lengths) / rows, new, bandwidth) if bandwidth else None
        base = seconds.get("eager")
        for name in chosen:
            row = {"rows": rows, "new_tokens": new, "path": name, "s_per_call": round(seconds[name], 4),
                   "tokens_per_s": round(tokens[name] / seconds[name]),
                   "vs_eager": round(base / seconds[name], 2) if base else "",
                   "greedy_same_as_eager": bool(torch.equal(greedy[name], greedy["eager"])) if "eager" in greedy else "",
                   "greedy_rows_same": same_rows(greedy[name], greedy["eager"]) if "eager" in greedy else ""}
            if floor is not None:
                row["floor_tokens_per_s"] = round(rows * new / floor)
            results.append(row)
            print(row, file=sys.stderr, flush=True)
    return results, made


def path_generator(folder: str, device: torch.device, name: str, rows: int, dtype: str | None = None) -> HFGenerator:
    """An hf generator of decode path ``name`` (`PATHS`) for up to ``rows`` rows, in ``dtype`` (default: bf16 on CUDA,
    float32 on CPU)."""
    dtype = dtype or ("bfloat16" if device.type == "cuda" else "float32")
    model_cfg = OmegaConf.structured(ModelConfig(name_or_path=folder, dtype=dtype))
    config = OmegaConf.structured(HfGeneratorConfig(name="hf", batch_size=rows, **PATHS[name]))
    return HFGenerator(config, model_cfg, load_tokenizer(folder), device)


def same_rows(a: torch.Tensor, b: torch.Tensor) -> float:
    """The share of rows whose greedy tokens are the same in ``a`` and ``b`` (B, L); rows of different widths compare
    over the shorter."""
    width = min(a.shape[1], b.shape[1])
    return round((a[:, :width] == b[:, :width]).all(dim=1).float().mean().item(), 3)


def follows_pushes(made: dict[str, HFGenerator], name: str, prompts) -> dict:
    """Whether generator ``name`` (a static path; on CUDA one that replays recorded graphs) decodes what the eager
    loop decodes after a weight push (in place: no recording again) and after a sleep and a wake with new weights;
    and how many tokens its nucleus step (top_p < 1, recorded too) sampled."""
    eager, other = made["eager"], made[name]
    greedy = SamplingParams(16, greedy=True)
    other.generate(prompts, greedy)  # this batch's bucket is recorded before the count
    recorded = len(other.static.recorded)
    pushed = {key: value * 0.5 for key, value in eager.model.state_dict().items()}
    for generator in (eager, other):
        generator.update_weights(pushed)
    after_push = torch.equal(other.generate(prompts, greedy).input_ids, eager.generate(prompts, greedy).input_ids)
    recorded_again = len(other.static.recorded) - recorded
    other.sleep()
    woken = {key: value * 2.0 for key, value in pushed.items()}
    for generator in (eager, other):
        generator.update_weights(woken)
    after_wake = torch.equal(other.generate(prompts, greedy).input_ids, eager.generate(prompts, greedy).input_ids)
    nucleus = other.generate(prompts, SamplingParams(16, temperature=0.8, top_p=0.9))
    return {"same_after_push": after_push, "graphs_recorded_by_the_push": recorded_again,
            "same_after_sleep_wake": after_wake, "nucleus_tokens": int(nucleus.loss_mask.sum())}


def float32_checks(folder: str, device: torch.device, paths, rows: int = 8, new: int = 32) -> list[dict]:
    """Whether each of ``paths`` decodes the eager loop's greedy tokens in float32, and still does after a weight push
    and after a sleep and a wake (`follows_pushes`). Float32, because in bf16 a random model's near-tied logits flip
    with the kernels' rounding: here a difference is a bug."""
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 30, (12 + row % 5,), generator=generator).tolist() for row in range(rows)]
    out = []
    for name in paths:
        eager, other = (path_generator(folder, device, path, rows, "float32") for path in ("eager", name))
        reference = eager.generate(prompts, SamplingParams(new, greedy=True)).input_ids
        ids = other.generate(prompts, SamplingParams(new, greedy=True)).input_ids
        row = {"path": name, "dtype": "float32", "rows": rows, "new_tokens": new,
               "greedy_same_as_eager": bool(torch.equal(ids, reference)), "greedy_rows_same": same_rows(ids, reference)}
        out.append(row | follows_pushes({"eager": eager, name: other}, name, prompts))
        other.static.free()
        del eager, other
    return out


def decode_profile(generator: HFGenerator, prompts, new: int, top: int = 16) -> list[dict]:
    """Where one call of ``generator`` (a path without graphs, whose kernels the profiler sees one by one) spends its
    time: the ``top`` kernels (CUDA) or operators (CPU) by their own time, with their share and count."""
    cuda = next(generator.model.parameters()).device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    generator.generate(prompts, SamplingParams(new))  # buffers allocated outside the profile
    with torch.profiler.profile(activities=activities) as profile:
        generator.generate(prompts, SamplingParams(new))
        sync(next(generator.model.parameters()).device)
    own = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = [e for e in profile.key_averages() if getattr(e, own) > 0 and (cuda or not e.key.startswith("ProfilerStep"))]
    total = sum(getattr(e, own) for e in events)
    events.sort(key=lambda e: getattr(e, own), reverse=True)
    return [{"name": e.key[:80], "ms": round(getattr(e, own) / 1e3, 2), "share": round(getattr(e, own) / total, 3),
             "calls": e.count} for e in events[:top]]


def model_folder(root: Path, shape: str) -> str:
    hidden, layers, intermediate, heads, kv_heads = SHAPES[shape]
    return str(save_random_llama(root / shape, hidden, layers, intermediate, 32, heads, positions=2048, kv_heads=kv_heads))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", default="3m", choices=sorted(SHAPES))
    parser.add_argument("--rows", default="64")
    parser.add_argument("--new", default="64")
    parser.add_argument("--prompt-len", type=int, default=6, help="the longest prompt, in tokens (default: the built-in task's)")
    parser.add_argument("--shortest", type=int, default=4, help="the shortest prompt; lengths spread uniformly between the two (default: the built-in task's)")
    parser.add_argument("--paths", default=None, help=f"comma-separated subset of {list(PATHS)} (default: all this device runs)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    paths = args.paths.split(",") if args.paths else [
        p for p in PATHS if (device.type == "cuda" or not p.startswith("graphs")) and not p.endswith("ungrouped")]
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        sizes = [(int(r), int(n)) for r in args.rows.split(",") for n in args.new.split(",")]
        results, _ = bench(model_folder(Path(tmp), args.shape), device, sizes, paths, args.prompt_len, args.repeats,
                           shortest=args.shortest)
    keys = list(dict.fromkeys(k for r in results for k in r))
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for row in results:
        print("| " + " | ".join(str(row.get(k, "")) for k in keys) + " |")


if __name__ == "__main__":
    main()
