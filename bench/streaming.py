"""Benchmark: sync, async and stream on the long-tail counting task, side by side in one run.

The same GRPO work (`experiment=stream_count_tiny`: correct responses of 1 to 60 tokens, most of them short) trains
the same number of steps, so the same number of samples, under each schedule through the real CLI, the schedules
alternated `--repeats` times so machine noise hits them alike. Step 1 is a warm-up and is left out of the speeds.
Prints per schedule: seconds per step, samples and generated tokens per second, the generator's share of busy time,
and the learning over the same sample budget (the training score over the last quarter of the steps, and the
evaluation at the end against the start); for stream, the policy versions per row and the token staleness. Then
the throughput ratios stream / async and stream / sync.

`--engine` measures a generator alone instead (`--generator hf|vllm`, one thread, no training): rows per second
decoding the task's prompts batch by batch (8 prompts x 8 samples a generate call, as sync and async do) against
continuous batching (rows join as others finish, `--widths` rows in flight) through the generator's own
`continue_rows` (rows kept between calls: hf's slot cache, vLLM's requests) and through a new generate call each
chunk on the rows' tokens so far (`continue_by_generate`).

Examples:
  python bench/streaming.py --engine                       # the decode alone: batch at a time vs continuous
  python bench/streaming.py --engine --generator vllm      # the same on a vLLM engine
  python bench/streaming.py                                # HF generator, one process (generator thread + trainer)
  python bench/streaming.py --ray                          # generator and trainer in separate Ray workers
  python bench/streaming.py --ray -- generator=vllm generator.kv_cache_memory_bytes=67108864
  python bench/streaming.py --ray --max-staleness 2 --schedules async,stream -- generator=vllm generator.kv_cache_memory_bytes=67108864
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from cli_runs import train_records

SCHEDULES = {"sync": ["schedule=sync"], "async": ["schedule=async"], "stream": ["schedule=stream"]}
BOUNDED = ("async", "stream")  # the schedules `--max-staleness` sets
COMMON = ["experiment=stream_count_tiny", "logging.tensorboard=false", "checkpoint.save_final_model=false"]
# Ray: one trainer rank (the reference beside it) and one generation engine, each its own process (the two cores)
RAY = ["cluster=ray_local", "cluster.roles.policy.devices_per_node=1", "cluster.roles.reference.devices_per_node=1",
       "cluster.colocate=[[policy,reference]]", "cluster.num_cpus=2"]


def summary(records: list[dict], first: dict, last: dict) -> dict[str, float]:
    """Speeds over the steps after the warm-up, learning over all of them (``first``/``last``: the eval rows)."""
    steps = sorted({r["step"] for r in records})
    by_step = {r["step"]: r for r in records}
    seconds = statistics.median(by_step[s]["time/step"] for s in steps)
    rows = statistics.mean(by_step[s]["episode"] / s for s in steps)
    lengths = statistics.mean(by_step[s]["val/sequence_lengths"] for s in steps)
    tail = steps[-max(1, len(steps) // 4):]
    out = {
        "s/step": seconds,
        "samples/s": rows / seconds,
        "tokens/s": rows * lengths / seconds,
        "generation share": statistics.median(by_step[s]["time/generation"] / by_step[s]["time/step"] for s in steps),
        "score (last quarter)": statistics.mean(by_step[s]["objective/scores"] for s in tail),
        "eval correct start": first.get("eval/greedy_correct_rate", float("nan")),
        "eval correct end": last.get("eval/greedy_correct_rate", float("nan")),
        "eval sampled score end": last.get("eval/sampled_scores", float("nan")),
    }
    if "async/versions_per_row" in by_step[steps[0]]:
        out["versions/row"] = statistics.mean(by_step[s]["async/versions_per_row"] for s in steps)
        out["token staleness"] = statistics.mean(by_step[s]["async/token_staleness_mean"] for s in steps)
    return out


def run(name: str, steps: int, extra: list[str], folder: Path) -> dict[str, float]:
    overrides = [*COMMON, *SCHEDULES[name], f"train.num_steps={steps}", f"eval.every={steps}", *extra]
    records = train_records(name, overrides, folder, keep_eval=True)
    evals = [r for r in records if "eval/greedy_correct_rate" in r]
    steps_only = [r for r in records if "time/step" in r and r["step"] > 1]
    return summary(steps_only, evals[0], evals[-1])


def engine(name: str, widths: list[int], chunk: int, rows: int, repeats: int) -> None:
    """Rows per second of generator ``name`` (hf or vllm) on the counting prompts: batch at a time, then at each width
    continuously by the generator's own `continue_rows` (rows kept between calls) and by `continue_by_generate` (each
    chunk a new generate call on the rows' tokens so far), the paths alternated ``repeats`` times."""
    import os
    import random
    import time

    import torch
    from omegaconf import OmegaConf

    from rlhf.config.schema import ModelConfig
    from rlhf.data.count import count_problems
    from rlhf.generators.base import SamplingParams
    from rlhf.generators.continuous import continue_by_generate
    from rlhf.models.loading import load_tokenizer
    from rlhf.step.inflight import Row, advance

    torch.set_num_threads(1)
    torch.manual_seed(0)
    tokenizer = load_tokenizer("builtin:tiny_count")
    model = OmegaConf.structured(ModelConfig(name_or_path="builtin:tiny_count"))
    if name == "vllm":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from rlhf.generators.vllm import VLLMGenerator, VllmGeneratorConfig

        generator = VLLMGenerator(VllmGeneratorConfig(name="vllm", kv_cache_memory_bytes=1 << 26), model, tokenizer, torch.device("cpu"))
    else:
        from rlhf.generators.hf import HFGenerator, HfGeneratorConfig

        generator = HFGenerator(HfGeneratorConfig(name="hf", decode="eager"), model, tokenizer, torch.device("cpu"))
    prompts = [tokenizer(prompt)["input_ids"] for prompt, _ in count_problems(60)]
    sampling = SamplingParams(64)

    class ByGenerate:  # each chunk a new generate call on the rows' tokens so far
        def continue_rows(self, requests, sampling, steps):
            return continue_by_generate(generator, requests, sampling, steps)

    def batches() -> tuple[float, float]:
        rng, start, done, tokens = random.Random(0), time.perf_counter(), 0, 0
        while done < rows:
            out = generator.generate([p for _ in range(8) for p in [rng.choice(prompts)] * 8], sampling)
            done, tokens = done + len(out), tokens + int(out.loss_mask.sum())
        seconds = time.perf_counter() - start
        return done / seconds, tokens / seconds

    def continuous(decoder, width: int) -> tuple[float, float]:
        rng, start, done, tokens, flight = random.Random(0), time.perf_counter(), 0, 0, []
        while done < rows:
            while len(flight) + 8 <= width:
                flight += [Row(tuple(p)) for p in [rng.choice(prompts)] * 8]
            tokens += advance(decoder, flight, sampling, chunk, 0)
            done += sum(row.done(64) for row in flight)
            flight = [row for row in flight if not row.done(64)]
        seconds = time.perf_counter() - start
        generator.continue_rows([], sampling, 1)  # let the rows still in flight go
        return done / seconds, tokens / seconds

    paths = {"batch at a time (64 rows a call)": batches}
    for width in widths:
        paths[f"continuous, {width} rows in flight, {chunk}-token chunks"] = lambda w=width: continuous(generator, w)
        paths[f"each chunk a new generate call, {width} rows in flight"] = lambda w=width: continuous(ByGenerate(), w)
    figures: dict[str, list[tuple[float, float]]] = {path: [] for path in paths}
    for _ in range(repeats):
        for path, measure in paths.items():
            figures[path].append(measure())
    base = statistics.median(r for r, _ in figures["batch at a time (64 rows a call)"])
    print(f"generator={name}, {rows} rows per measurement, median of {repeats}")
    print("| decode | rows/s | tokens/s | x batch at a time |\n|---|---|---|---|")
    for path, runs in figures.items():
        rows_s, tokens_s = statistics.median(r for r, _ in runs), statistics.median(t for _, t in runs)
        print(f"| {path} | {rows_s:.0f} | {tokens_s:.0f} | {rows_s / base:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="training steps per run (the same samples for each schedule)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of the three schedules (--engine: of the paths), alternated")
    parser.add_argument("--ray", action="store_true", help="generator and trainer as separate Ray workers")
    parser.add_argument("--schedules", default="sync,async,stream", help="which to run, comma-separated")
    parser.add_argument("--chunk-tokens", type=int, default=None, help="schedule.chunk_tokens for stream (default: its default)")
    parser.add_argument("--max-staleness", type=int, default=1, help="schedule.max_staleness of async and stream alike")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every schedule (after --)")
    parser.add_argument("--engine", action="store_true", help="the decode alone: batch at a time vs continuous")
    parser.add_argument("--generator", default="hf", choices=["hf", "vllm"], help="--engine: which generator")
    parser.add_argument("--widths", default="64,128,256", help="--engine: rows in flight, comma-separated")
    parser.add_argument("--rows", type=int, default=1280, help="--engine: rows decoded per measurement")
    args = parser.parse_args()
    if args.engine:
        engine(args.generator, [int(w) for w in args.widths.split(",")], args.chunk_tokens or 8, args.rows, args.repeats)
        return
    extra = (RAY if args.ray else []) + args.overrides
    names = args.schedules.split(",")
    results: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            for name in names:
                own = [f"schedule.max_staleness={args.max_staleness}"] if name in BOUNDED else []
                own += [f"schedule.chunk_tokens={args.chunk_tokens}"] if name == "stream" and args.chunk_tokens else []
                results[name].append(run(name, args.steps, extra + own, Path(tmp)))
    merged = {name: {k: statistics.mean(r[k] for r in rs) for k in rs[0]} for name, rs in results.items()}
    keys = list(dict.fromkeys(k for m in merged.values() for k in m))
    print(f"work: {' '.join(COMMON + extra)}, async and stream at schedule.max_staleness={args.max_staleness}, "
          f"{args.steps} steps x {args.repeats} run(s) per schedule")
    print("| figure | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for key in keys:
        print(f"| {key} | " + " | ".join(f"{merged[n][key]:.3f}" if key in merged[n] else "" for n in names) + " |")
    for base in ("async", "sync"):
        if "stream" in merged and base in merged:
            print(f"throughput stream / {base} = {merged['stream']['samples/s'] / merged[base]['samples/s']:.2f}x (samples/s)")


if __name__ == "__main__":
    main()
