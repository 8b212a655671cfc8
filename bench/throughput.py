"""Benchmark: where a sync GRPO step's time goes, how much of it is padding, and the training MFU.

For each model size, response budget and generator it trains a few sync GRPO steps through the real CLI on the
built-in task (8 prompts x 8 samples, beta 0, one optimiser step per step, a random Llama whose vocabulary is the
task's, so responses stop at EOS after a few dozen tokens like a young policy's) and prints seconds per step by
stage, real tokens per second, the padding share of the training forwards and the training MFU: model FLOPs on
real tokens only (`cli_runs.train_flops`) over `time/training`, against the best matrix-product peak probed in this
same process (before and after every setting, so that a busy moment cannot inflate the MFU). Step 1 is a warm-up;
figures are medians over the rest.

``--baseline COMMIT`` also runs the same work with another commit's code (checked out into a temporary folder) at
the ``--compare-budgets`` budgets, alternating the two, and prints the step-time ratios. ``--compile both`` runs
every setting eager and with ``policy.compile=true`` (the policy's decoder blocks under torch.compile; with the hf
generator also ``generator.compile=true``, its decode steps), alternated,
and prints the training-time and MFU ratios.

    python bench/throughput.py                                              # the full table (CPU: ~30 min)
    python bench/throughput.py --sizes 3m --budgets 64 --generators hf --baseline a509689 --repeats 2
    python bench/throughput.py --sizes 3m,30m --budgets 64 --generators hf --compile both --repeats 2 --steps 8
    python bench/throughput.py --device cuda --sizes qwen0.5b --budgets 256 --generators hf   # on a GPU
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

from cli_runs import matmul_peak, save_random_llama, train_flops, train_records

# name: (hidden, layers, intermediate, heads); the vocabulary is the built-in tokenizer's, rounded up
SHAPES = {"0.1m": (64, 2, 128, 2), "3m": (256, 4, 512, 4), "30m": (512, 8, 1536, 8), "qwen0.5b": (896, 24, 4864, 14)}
VOCAB = 32
WORK = [
    "algorithm=grpo", "algorithm.beta=0", "train.prompts_per_step=8", "algorithm.num_samples_per_prompt=8",
    "train.micro_batch_size=64", "train.lr=1e-5", "eval.every=0", "eval.max_prompts=8", "eval.num_samples=1",
    "logging.tensorboard=false", "checkpoint.save_final_model=false", "dataset.max_prompt_length=16",
]
TOKEN_BUDGET = 1024  # train.max_tokens_per_micro_batch of the runs: fastest here with packed micro batches (512-4096 tried)


def overrides(
    model: Path, budget: int, generator: str, steps: int, device: str, new: bool, tokens: int, compiled: bool = False
) -> list[str]:
    """The run's CLI overrides; ``new``: with the token budget this code adds (the baseline's config lacks it);
    ``compiled``: with the policy's decoder blocks compiled, and the hf generator's decode steps."""
    run = [f"model.name_or_path={model}", f"generator.max_new_tokens={budget}", f"generator={generator}",
           f"train.num_steps={steps}", f"cluster.device={device}", *WORK]
    if device == "cuda":
        run.append("model.dtype=bfloat16")
    if generator == "vllm" and device == "cuda":
        run.append("generator.gpu_memory_utilization=0.3")
    if new:
        run.append(f"train.max_tokens_per_micro_batch={max(tokens, 16 + budget)}")
    if compiled:
        run.append("policy.compile=true")
        if generator == "hf":
            run.append("generator.compile=true")
    return run


def summary(records: list[dict], config, peak: float) -> dict[str, float]:
    """Medians of the stage times, real tokens/s, padding share and training MFU of the records (steps 2..)."""
    med = lambda key: statistics.median(r.get(key, 0.0) for r in records)  # noqa: E731
    rows = 64
    flops = []
    for r in records:
        tokens = r["perf/total_num_tokens"]
        window = r["val/sequence_lengths"] * rows
        mean_len = tokens / rows
        flops.append(train_flops(config, tokens, window, rows * mean_len**2) / r["time/training"])
    return {
        "step": med("time/step"), "generation": med("time/generation"), "logprobs": med("time/logprobs"),
        "training": med("time/training"), "weight_sync": med("time/weight_sync"),
        "tokens_per_s": statistics.median(r["perf/total_num_tokens"] / r["time/step"] for r in records),
        "response_len": med("val/sequence_lengths"), "padding": med("perf/padding_fraction"),
        "mfu": statistics.median(flops) / peak,
    }


def checkout(commit: str, folder: Path) -> Path:
    """``commit``'s ``src`` folder, extracted from this repository into ``folder``, with its ``conf`` placed where the
    installed package has it (``rlhf/conf``), so that commit's code composes that commit's configs."""
    root = Path(__file__).resolve().parents[1]
    for part, into in (("src", folder), ("conf", folder / "src" / "rlhf")):
        archive = subprocess.run(["git", "-C", str(root), "archive", commit, part], check=True, capture_output=True).stdout
        into.mkdir(parents=True, exist_ok=True)
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return folder / "src"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="0.1m,3m,30m", help=f"model shapes, of {', '.join(SHAPES)}")
    parser.add_argument("--budgets", default="16,64,256", help="generator.max_new_tokens values")
    parser.add_argument("--generators", default="hf,vllm", help="generator names")
    parser.add_argument("--steps", type=int, default=5, help="steps per run (step 1 is a warm-up)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per setting (alternated with the baseline)")
    parser.add_argument("--tokens", type=int, default=TOKEN_BUDGET, help="train.max_tokens_per_micro_batch of the runs")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--compare-budgets", default="64", help="budgets at which the baseline runs too")
    parser.add_argument("--compile", default="off", choices=("off", "on", "both"), help="policy.compile (and generator.compile with hf) of the runs; both: eager and compiled, alternated")
    parser.add_argument("--baseline", default=None, help="also run this commit's code (or a folder holding its `rlhf` package) on the same work")
    args = parser.parse_args()
    device = torch.device(args.device)
    probe = (lambda: matmul_peak(device, (512, 1024, 2048), torch.float32)) if device.type == "cpu" else (
        lambda: matmul_peak(device, (8192,), torch.bfloat16))
    peaks = [probe()]  # probed again after every setting: MFU is against the best, so a busy moment cannot inflate it
    print(f"matrix-product peak measured here: {peaks[0] / 1e9:.1f} GFLOP/s ({'float32' if device.type == 'cpu' else 'bf16'})")
    table, ratios, compiled_ratios = [], [], []
    compared = set(map(int, args.compare_budgets.split(",")))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        runs = tmp / "runs"
        runs.mkdir()
        baseline = None
        if args.baseline:
            given = Path(args.baseline)
            baseline = given.resolve() if given.is_dir() else checkout(args.baseline, tmp / "baseline")
        for size in args.sizes.split(","):
            hidden, layers, intermediate, heads = SHAPES[size]
            model = save_random_llama(tmp / size, hidden=hidden, layers=layers, intermediate=intermediate, vocab=VOCAB, heads=heads, positions=512)
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(model)
            for budget in map(int, args.budgets.split(",")):
                for generator in args.generators.split(","):
                    new, old, comp = [], [], []
                    run = lambda compiled: overrides(model, budget, generator, args.steps, args.device, True, args.tokens, compiled)  # noqa: E731
                    for _ in range(args.repeats):
                        new += train_records("new", run(args.compile == "on"), runs)
                        if args.compile == "both":
                            comp += train_records("compiled", run(True), runs)
                        if baseline is not None and budget in compared:
                            old += train_records("old", overrides(model, budget, generator, args.steps, args.device, False, 0), runs, baseline)
                    peaks.append(probe())
                    peak = max(peaks)
                    row = {"size": size, "budget": budget, "generator": generator, **summary(new, config, peak)}
                    row["peak"] = peak
                    table.append(row)
                    print(format_row(row), flush=True)
                    if comp:
                        row_c = {"size": size, "budget": budget, "generator": f"{generator}, compiled", **summary(comp, config, peak), "peak": peak}
                        table.append(row_c)
                        print(format_row(row_c), flush=True)
                        compiled_ratios.append((row, row_c))
                    if old:
                        old_step = statistics.median(r["time/step"] for r in old)
                        old_train = statistics.median(r["time/logprobs"] + r["time/training"] for r in old)
                        for now in (row, row_c) if comp else (row,):
                            ratios.append((size, budget, now["generator"], old_step, now["step"], old_train, now["logprobs"] + now["training"]))
    peak = max(peaks)
    for row in table:  # every MFU against the best probe of the whole run
        row["mfu"] *= row.pop("peak") / peak
    print()
    print(f"matrix-product peak: {min(peaks) / 1e9:.1f}-{peak / 1e9:.1f} GFLOP/s over {len(peaks)} probes; MFU against {peak / 1e9:.1f}")
    print("| model | budget | generator | s/step | generation | logprobs | training | weight sync | tokens/s | response len | padding | training MFU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in table:
        print(format_row(row))
    if compiled_ratios:
        print()
        print("| model | budget | generator | training eager | compiled | speed-up | MFU eager | compiled "
              "| generation eager | compiled | speed-up | s/step eager | compiled | speed-up |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for e, c in compiled_ratios:
            print(f"| {e['size']} | {e['budget']} | {e['generator']} | {e['training']:.3f} | {c['training']:.3f} | "
                  f"{e['training'] / c['training']:.2f}x | {e['mfu']:.0%} | {c['mfu']:.0%} | {e['generation']:.3f} | "
                  f"{c['generation']:.3f} | {e['generation'] / c['generation']:.2f}x | {e['step']:.3f} | {c['step']:.3f} | "
                  f"{e['step'] / c['step']:.2f}x |")
    if ratios:
        print()
        print(f"| model | budget | generator | s/step {args.baseline} | s/step now | speed-up | logprobs+training {args.baseline} | now | speed-up |")
        print("|---|---|---|---|---|---|---|---|---|")
        for size, budget, generator, old_step, new_step, old_train, new_train in ratios:
            print(f"| {size} | {budget} | {generator} | {old_step:.3f} | {new_step:.3f} | {old_step / new_step:.2f}x | "
                  f"{old_train:.3f} | {new_train:.3f} | {old_train / new_train:.2f}x |")


def format_row(row: dict) -> str:
    return (f"| {row['size']} | {row['budget']} | {row['generator']} | {row['step']:.3f} | {row['generation']:.3f} | "
            f"{row['logprobs']:.3f} | {row['training']:.3f} | {row['weight_sync']:.4f} | {row['tokens_per_s']:.0f} | "
            f"{row['response_len']:.1f} | {row['padding']:.0%} | {row['mfu']:.0%} |")


if __name__ == "__main__":
    main()
