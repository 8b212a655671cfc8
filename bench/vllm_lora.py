"""Benchmark: how a LoRA policy's new weights reach the vLLM generator, measured side by side in one process.

(a) merged (what the framework does): an engine without LoRA; per policy version the trainer computes the merged
    weights of the adapted layers (`rlhf.models.lora.merged_weights`, adapted_only) and `VLLMGenerator.update_weights`
    reloads them in place (`collective_rpc` -> `model_runner.reload_weights`). Sync = merge + push.
(b) vLLM LoRA: an engine with ``enable_lora=True, max_lora_rank=R, max_loras=1``; per version the trainer saves the
    adapter as a PEFT folder and vLLM loads it under a new adapter id (`LoRARequest`). Sync = save + `add_lora`.

Per version, each engine then decodes the same prompts (greedy, no stop token, so every row runs the whole budget):
the first generate after the sync (vLLM LoRA moves the adapter into its slot there) and the median of ``--repeats``
more, as tokens/s. The two paths' greedy tokens are compared position by position. Adapters are peft's on every
linear layer (all-linear) with random A and B (B normal, std 0.02: a trained adapter, so versions differ).

    python bench/vllm_lora.py --size tiny      # builtin:tiny_arith (2 layers, hidden 64)
    python bench/vllm_lora.py --size 30m       # random Llama (512, 8 layers, 1536, 8 heads), 32-token vocabulary
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engines in this process, as VLLMGenerator runs them

import torch  # noqa: E402

from cli_runs import save_random_llama  # noqa: E402

# name: (hidden, layers, intermediate, heads), as in lora.py; "tiny" is the built-in model
SHAPES = {"30m": (512, 8, 1536, 8)}
VOCAB = 32
KV_BYTES = 512 << 20


def wait_quiet(limit: float = 1.5, patience: float = 300.0) -> float:
    """Wait (10 s polls, up to ``patience`` s) for the 1-minute load average to fall below ``limit``; returns it."""
    deadline = time.monotonic() + patience
    while os.getloadavg()[0] >= limit and time.monotonic() < deadline:
        time.sleep(10)
    return os.getloadavg()[0]


def model_folder(size: str, tmp: Path) -> tuple[Path, int]:
    """The model's folder and vocabulary size."""
    from transformers import AutoConfig

    from rlhf.models.loading import resolve_model_path

    if size == "tiny":
        path = Path(resolve_model_path("builtin:tiny_arith"))
        return path, AutoConfig.from_pretrained(path).vocab_size
    hidden, layers, intermediate, heads = SHAPES[size]
    return save_random_llama(tmp / "model", hidden, layers, intermediate, VOCAB, heads, positions=512), VOCAB


def engines(model_dir: Path, rank: int):
    """(our VLLMGenerator without LoRA, a vLLM engine with LoRA), same model, dtype, KV cache and eager mode."""
    import vllm
    from omegaconf import OmegaConf

    from rlhf.config.schema import ModelConfig
    from rlhf.generators.vllm import VllmGeneratorConfig
    from rlhf.generators.vllm import VLLMGenerator
    from rlhf.models.loading import load_tokenizer

    cfg = VllmGeneratorConfig(name="vllm", kv_cache_memory_bytes=KV_BYTES, enforce_eager=True)
    merged = VLLMGenerator(cfg, OmegaConf.structured(ModelConfig(name_or_path=str(model_dir))), load_tokenizer(str(model_dir)),
                           torch.device("cpu"))
    with_lora = vllm.LLM(
        model=str(model_dir), dtype="float32", skip_tokenizer_init=True, generation_config="vllm", seed=0,
        kv_cache_memory_bytes=KV_BYTES, enforce_eager=True, enable_lora=True, max_lora_rank=rank, max_loras=1,
    )
    return merged, with_lora


def decode(llm, prompts: list[list[int]], params, lora=None) -> tuple[float, list[list[int]]]:
    """Seconds of one generate and its tokens."""
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=lora, use_tqdm=False)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outputs]


def timed_decodes(llm, prompts, params, repeats: int, lora=None) -> tuple[float, float, list[list[int]]]:
    """(first generate s, median of ``repeats`` more, tokens of the last)."""
    first, _ = decode(llm, prompts, params, lora)
    times = []
    for _ in range(repeats):
        seconds, tokens = decode(llm, prompts, params, lora)
        times.append(seconds)
    return first, statistics.median(times), tokens


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of token positions where the two decodes agree."""
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(x == y for x, y in pairs) / max(1, len(pairs))


def main(argv: list[str] | None = None) -> list[dict]:
    """Run both paths for each version; print the table and return its rows."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="tiny", choices=["tiny", *SHAPES], help="tiny: builtin:tiny_arith; else a random Llama")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (vLLM accepts 1, 8, 16, 32, ...); alpha = 2 x rank")
    parser.add_argument("--versions", type=int, default=3, help="policy versions (a new adapter each)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="timed generates per version after the first")
    args = parser.parse_args(argv)

    import vllm
    from vllm.lora.request import LoRARequest

    from rlhf.models import lora
    from rlhf.models.loading import load_causal_lm

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir, vocab = model_folder(args.size, tmp)
        cfg = SimpleNamespace(rank=args.rank, alpha=2.0 * args.rank, dropout=0.0, target_modules=[lora.ALL_LINEAR])
        policy = lora.add_adapters(load_causal_lm(str(model_dir)), cfg).eval()
        prompts = torch.randint(3, vocab, (args.prompts, 16)).tolist()
        params = vllm.SamplingParams(n=1, max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        merged_gen, lora_llm = engines(model_dir, args.rank)
        decode(merged_gen.llm, prompts, params)  # warm-ups
        decode(lora_llm, prompts, params)
        load = wait_quiet()
        print(f"load average before timing: {load:.2f}")
        tokens = args.prompts * args.new_tokens
        # the base model on both engines: what enabling LoRA costs before any adapter is in use
        _, base_s, base_tokens = timed_decodes(merged_gen.llm, prompts, params, args.repeats)
        _, lora_base_s, _ = timed_decodes(lora_llm, prompts, params, args.repeats)
        rows = []
        for version in range(1, args.versions + 1):
            gen = torch.Generator().manual_seed(version)
            with torch.no_grad():
                for name, param in policy.named_parameters():
                    if ".lora_B." in name:
                        param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
            # (a) merge the adapted layers and reload them in place
            start = time.perf_counter()
            weights = lora.merged_weights(policy.state_dict(), lora.scaling(cfg), adapted_only=True)
            merge_s = time.perf_counter() - start
            merged_gen.update_weights(weights)
            push_s = time.perf_counter() - start - merge_s
            a_first, a_steady, a_tokens = timed_decodes(merged_gen.llm, prompts, params, args.repeats)
            # (b) save a PEFT folder, load it as a new adapter id
            start = time.perf_counter()
            folder = tmp / f"adapter-v{version}"
            policy.save_pretrained(folder)
            save_s = time.perf_counter() - start
            request = LoRARequest(f"policy-v{version}", version, str(folder))
            lora_llm.llm_engine.add_lora(request)
            add_s = time.perf_counter() - start - save_s
            b_first, b_steady, b_tokens = timed_decodes(lora_llm, prompts, params, args.repeats, request)
            rows.append({
                "version": version, "merge_s": merge_s, "push_s": push_s, "merged_first_s": a_first,
                "merged_tok_s": tokens / a_steady, "save_s": save_s, "add_s": add_s, "lora_first_s": b_first,
                "lora_tok_s": tokens / b_steady, "agree": agreement(a_tokens, b_tokens),
                "agree_base": agreement(a_tokens, base_tokens), "push_mib": sum(t.numel() * t.element_size() for t in weights.values()) / 2**20,
                "adapter_mib": sum(f.stat().st_size for f in folder.iterdir()) / 2**20,
            })
        total = sum(p.numel() for n, p in policy.named_parameters() if ".lora_" not in n)
    print(f"\n{args.size} ({total / 1e6:.2f}M parameters), LoRA rank {args.rank} all-linear, {args.prompts} prompts x "
          f"{args.new_tokens} tokens greedy, vLLM {vllm.__version__} on CPU, load average {load:.2f} -> {os.getloadavg()[0]:.2f}")
    print("\n| version | merged: merge s | merged: push s | merged: sync s | merged: first generate s | merged: tokens/s "
          "| LoRA: save s | LoRA: add_lora s | LoRA: sync s | LoRA: first generate s | LoRA: tokens/s | same tokens |")
    print("|---" * 12 + "|")
    for r in rows:
        print(f"| {r['version']} | {r['merge_s']:.3f} | {r['push_s']:.3f} | {r['merge_s'] + r['push_s']:.3f} | {r['merged_first_s']:.3f} "
              f"| {r['merged_tok_s']:.0f} | {r['save_s']:.3f} | {r['add_s']:.3f} | {r['save_s'] + r['add_s']:.3f} "
              f"| {r['lora_first_s']:.3f} | {r['lora_tok_s']:.0f} | {r['agree']:.3f} |")
    print(f"\npushed {rows[0]['push_mib']:.2f} MiB of merged weights a version; adapter folder {rows[0]['adapter_mib']:.2f} MiB; "
          f"merged tokens equal to the base model's: {statistics.mean(r['agree_base'] for r in rows):.3f} (the adapters matter)")
    print(f"base model, no adapter: {tokens / base_s:.0f} tokens/s on the engine without LoRA, {tokens / lora_base_s:.0f} on the "
          f"engine with enable_lora")
    return rows


if __name__ == "__main__":
    main()
