"""Benchmark: a group's prompt prefilled once in generation (`generator.share_prompt_prefill`), against each row
prefilling its own copy, side by side in one run.

For each shape, each of the hf generator's decode paths (the eager loop, the static decode) runs the same prompts,
every prompt repeated ``samples`` times as `Collector.sample` repeats it, shared and unshared, called in turns
(median of ``--repeats`` after a warm-up call). Two figures each: the prompt pass of generation (a call for one new
token: padding, finding the groups, the prompt pass, the cache copied to the rows, the first token picked) and a
whole `generate` call (temperature 1). Shapes:

- ``long``: 512-token prompts, answers of up to 32 tokens, 8 samples per prompt, on the 3M random Llama of
  `bench/generate.py` (4 layers, width 256);
- ``edge``: short prompts on a model 40x the built-in one's size: 6-token prompts (5.25 tokens saved a
  row; ``--edge-len`` sets another length), up to 16 new tokens, 16 prompts x 8 samples, on the same 3M model;
- ``tiny``: the built-in task's (`model=tiny_arith`, prompts of 4 to 6 tokens, 4 new tokens, 16 prompts x 8 samples);
- ``smollm2``: SmolLM2-135M-Instruct at its natural shape (chat-templated sums, ~45-token prompts, up to 14 new
  tokens, 8 samples per prompt).

``auto`` says what `generator.share_prompt_prefill=auto` picks there. ``--vllm`` adds the vLLM generator at the
``long`` shape with `generator.enable_prefix_caching` on and off (minutes: two engines start).

    python bench/shared_prefix.py                       # every shape, eager and static
    python bench/shared_prefix.py --shapes long,tiny --repeats 3
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

from cli_runs import save_random_llama
from real_model_speed import MODEL, chat_prompts
from rlhf.config.schema import ModelConfig
from rlhf.generators.base import SamplingParams
from rlhf.generators.hf import HFGenerator, HfGeneratorConfig
from rlhf.generators.shared_prefill import prompt_groups, shares
from rlhf.models.loading import load_tokenizer, resolve_model_path

PATHS = {"eager": dict(decode="eager"), "static": dict(decode="static", graphs=False)}


def random_prompts(count: int, shortest: int, longest: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of ``shortest`` to ``longest`` tokens drawn from ids 3.. ``vocab`` - 1 (no pad, BOS or EOS)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(shortest, longest + 1, (count,), generator=generator).tolist()
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def shape_work(name: str, root: Path, prompts: int, samples: int, edge_len: int = 6) -> tuple[str, list[list[int]], int]:
    """(model folder, the repeated prompts, new tokens) of shape ``name`` (``edge``: prompts of ``edge_len`` tokens)."""
    if name in ("long", "edge"):
        folder = str(save_random_llama(root / "3m", 256, 4, 512, 32, 4, positions=1024))
        length, new = (512, 32) if name == "long" else (edge_len, 16)
        distinct = random_prompts(prompts, length, length, 32)
    elif name == "tiny":
        folder = resolve_model_path("builtin:tiny_arith")
        distinct, new = random_prompts(prompts, 4, 6, len(load_tokenizer(folder))), 4
    else:
        folder = resolve_model_path(MODEL)
        distinct, new = chat_prompts(load_tokenizer(folder), prompts, 1), 14
    return folder, [p for p in distinct for _ in range(samples)], new


def hf_generator(folder: str, path: str, share: str, rows: int) -> HFGenerator:
    """An hf generator on the CPU of decode path ``path`` (`PATHS`) with `generator.share_prompt_prefill` ``share``."""
    config = OmegaConf.structured(HfGeneratorConfig(name="hf", batch_size=rows, share_prompt_prefill=share, **PATHS[path]))
    model_cfg = OmegaConf.structured(ModelConfig(name_or_path=folder, dtype="float32"))
    return HFGenerator(config, model_cfg, load_tokenizer(folder), torch.device("cpu"))


def timed_turns(generators: dict[str, object], prompts, sampling: SamplingParams, repeats: int, before=None) -> tuple[dict, dict]:
    """(median seconds of a `generate` call, mean response tokens of the warm-up call) of each generator, called in
    turns after one warm-up call each; ``before(generator)``, untimed, before each call."""
    before = before or (lambda generator: None)
    tokens = {}
    for name, generator in generators.items():
        before(generator)
        tokens[name] = float(generator.generate(prompts, sampling).loss_mask.sum(dim=1).mean())
    times = {name: [] for name in generators}
    for _ in range(repeats):
        for name, generator in generators.items():
            before(generator)
            torch.manual_seed(0)
            start = time.perf_counter()
            generator.generate(prompts, sampling)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}, tokens


def hf_rows(shape: str, folder: str, prompts, new: int, repeats: int) -> list[dict]:
    """One row per decode path: prompt pass and whole call, unshared and shared, and their ratios."""
    rows = []
    for path in PATHS:
        made = {share: hf_generator(folder, path, share, len(prompts)) for share in ("false", "true")}
        auto = shares("auto", prompts, prompt_groups(prompts), made["true"].params)
        passes, _ = timed_turns(made, prompts, SamplingParams(1, temperature=1.0), repeats)
        whole, tokens = timed_turns(made, prompts, SamplingParams(new, temperature=1.0), repeats)
        rows.append({
            "shape": shape, "path": path, "rows": len(prompts), "prompt_tokens": round(statistics.mean(map(len, prompts))),
            "answer_tokens": round(tokens["false"], 1),
            "prompt_pass_unshared_s": passes["false"], "prompt_pass_shared_s": passes["true"],
            "prompt_pass_x": passes["false"] / passes["true"],
            "generate_unshared_s": whole["false"], "generate_shared_s": whole["true"],
            "generate_x": whole["false"] / whole["true"], "auto": "shared" if auto else "unshared",
        })
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


def vllm_rows(folder: str, prompts, new: int, repeats: int) -> list[dict]:
    """The vLLM generator on the CPU, prefix caching on and off, one engine at a time (each closed before the next
    starts): the prompt pass (one new token) and a whole call. The prefix cache is emptied before every call, as a
    weight push empties it before each step's new prompts: only a group's rows share, not the calls before."""
    from rlhf.config.schema import ModelConfig as Model
    from rlhf.generators.vllm import VLLMGenerator, VllmGeneratorConfig

    seconds = {}
    for caching in (False, True):
        config = OmegaConf.structured(VllmGeneratorConfig(
            name="vllm", kv_cache_memory_bytes=1024 * 2**20, max_model_len=1024, enforce_eager=True,
            enable_prefix_caching=caching))
        engine = VLLMGenerator(config, OmegaConf.structured(Model(name_or_path=folder, dtype="float32")),
                               load_tokenizer(folder), torch.device("cpu"))
        def empty(generator):
            generator.llm.reset_prefix_cache()

        passes, _ = timed_turns({"e": engine}, prompts, SamplingParams(1, temperature=1.0), repeats, empty)
        whole, tokens = timed_turns({"e": engine}, prompts, SamplingParams(new, temperature=1.0), repeats, empty)
        seconds[caching] = (passes["e"], whole["e"], tokens["e"])
        engine.close()
        del engine
    (p0, w0, t0), (p1, w1, _) = seconds[False], seconds[True]
    return [{"shape": "long", "path": "vllm (prefix caching)", "rows": len(prompts), "prompt_tokens": 512,
             "answer_tokens": round(t0, 1), "prompt_pass_unshared_s": p0, "prompt_pass_shared_s": p1,
             "prompt_pass_x": p0 / p1, "generate_unshared_s": w0, "generate_shared_s": w1, "generate_x": w0 / w1,
             "auto": "on (default)"}]


def table(rows: list[dict]) -> str:
    """The rows as a markdown table, seconds to 4 places and ratios to 2."""
    keys = list(dict.fromkeys(k for row in rows for k in row))

    def cell(key, value):
        if isinstance(value, float):
            return f"{value:.2f}x" if key.endswith("_x") else f"{value:.4f}" if key.endswith("_s") else f"{value:g}"
        return str(value)

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    return "\n".join(lines + ["| " + " | ".join(cell(k, row.get(k, "")) for k in keys) + " |" for row in rows])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="long,edge,tiny,smollm2", help="comma-separated: long, edge, tiny, smollm2")
    parser.add_argument("--prompts", default="long=4,edge=16,tiny=16,smollm2=4", help="distinct prompts per shape")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--edge-len", type=int, default=6, help="the edge shape's prompt length")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vllm", action="store_true", help="also vLLM at the long shape, prefix caching on and off")
    args = parser.parse_args(argv)
    counts = {k: int(v) for k, v in (item.split("=") for item in args.prompts.split(","))}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            folder, prompts, new = shape_work(shape, Path(tmp), counts[shape], args.samples, args.edge_len)
            rows += hf_rows(shape, folder, prompts, new, args.repeats)
            if shape == "long" and args.vllm:
                rows += vllm_rows(folder, prompts, new, args.repeats)
    print(table(rows))


if __name__ == "__main__":
    main()
