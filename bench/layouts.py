"""Benchmark: training passes over rows of different lengths in three layouts of the same micro batches:
aligned at the action window (each micro batch as wide as its longest prompt plus its longest response), justified
(`Trajectories.justified_inputs`: each row moved past its own left padding, as wide as its longest row), and packed
(`rlhf.models.packing`: the rows end to end, attention kept inside each row; what the policy runs).

The same random rows (prompt and response lengths drawn uniformly from the given ranges), the same micro batches
(`rlhf.micro_batches.plan` under a token budget), a forward and backward of the mean window logprob on each, the
layouts alternated; prints the tokens each layout's token-wise layers compute, its padding share and the seconds per
pass, and checks that all give the same logprobs. Real prompt sets (math problems, chat turns) vary by tens to
hundreds of tokens; the built-in task's prompts all have one length (its padding is the responses' spread, which
`--prompts 8:8` shows).

    python bench/layouts.py                                   # 3m and 30m, prompts of 16-128 tokens
    python bench/layouts.py --sizes 3m --prompts 8:8 --responses 1:64
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cpu_limits import random_llama
from throughput import VOCAB
from rlhf.functional import logprobs_from_logits
from rlhf.micro_batches import Budget, plan
from rlhf.models import packing
from rlhf.models.logprobs import window_logprobs
from rlhf.trajectory import Trajectories, from_completions


def ragged_rows(rows: int, prompts: tuple[int, int], responses: tuple[int, int], seed: int = 0) -> Trajectories:
    """``rows`` rows of random tokens, prompt and response lengths uniform in the given (low, high) ranges."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(prompts[0], prompts[1] + 1, (rows,), generator=g)
    r = torch.randint(responses[0], responses[1] + 1, (rows,), generator=g)
    query_ids, query_mask = torch.zeros(rows, int(q.max()), dtype=torch.long), torch.zeros(rows, int(q.max()), dtype=torch.long)
    response_ids, response_mask = torch.zeros(rows, int(r.max()), dtype=torch.long), torch.zeros(rows, int(r.max()))
    for i, (lq, lr) in enumerate(zip(q.tolist(), r.tolist())):
        query_ids[i, -lq:] = torch.randint(3, VOCAB, (lq,), generator=g)
        query_mask[i, -lq:] = 1
        response_ids[i, :lr] = torch.randint(3, VOCAB, (lr,), generator=g)
        response_mask[i, :lr] = 1
    return from_completions(query_ids, query_mask, response_ids, response_mask, torch.zeros(rows, int(r.max())), torch.ones(rows, dtype=torch.bool))


def aligned_logprobs(model, batch: Trajectories) -> torch.Tensor:
    """Window logprobs from the rows as they are, aligned at the window (the layout before). Shape: (B, T)."""
    input_ids, attention_mask, position_ids = batch.model_inputs()
    width = batch.loss_mask.shape[1]
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, logits_to_keep=width + 1).logits
    return logprobs_from_logits(logits[:, :-1], batch.window_ids) * batch.loss_mask


def moved_logprobs(model, batch: Trajectories) -> torch.Tensor:
    """Window logprobs as the policy computes them: packed on the packing attention, justified on plain SDPA."""
    return window_logprobs(model, batch, 1.0)[0]


# layout: (the attention implementation it runs on, its logprobs)
LAYOUTS = {
    "aligned": ("sdpa", aligned_logprobs),
    "justified": ("sdpa", moved_logprobs),  # attention that takes no packed rows: the justified layout
    "packed": (packing.IMPLEMENTATION, moved_logprobs),
}


def packed_tokens(part: Trajectories) -> int:
    packed = packing.pack(part)
    return part.justified_inputs()[0].numel() if packed is None else packed.input_ids.numel()


def widths(parts: list[Trajectories]) -> dict[str, int]:
    """Tokens each layout's token-wise layers compute over the (trimmed) micro batches."""
    return {
        "aligned": sum(p.input_ids.numel() for p in parts),
        "justified": sum(p.justified_inputs()[0].numel() for p in parts),
        "packed": sum(packed_tokens(p) for p in parts),
    }


def train_pass(model, parts: list[Trajectories], layout: str) -> tuple[list[torch.Tensor], float]:
    """Forward and backward of the mean window logprob over the micro batches in ``layout``; (the logprobs
    (detached), the seconds it took). The model switches to the layout's attention before the clock starts."""
    implementation, logprobs = LAYOUTS[layout]
    model.set_attn_implementation(implementation)
    out = []
    start = time.perf_counter()
    for part in parts:
        logp = logprobs(model, part)
        (-logp.sum() / part.loss_mask.sum()).backward()
        out.append(logp.detach())
    model.zero_grad(set_to_none=True)
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="3m,30m", help="model shapes (bench/throughput.py's)")
    parser.add_argument("--rows", type=int, default=32, help="rows per batch")
    parser.add_argument("--prompts", default="16:128", help="prompt lengths, low:high")
    parser.add_argument("--responses", default="1:64", help="response lengths, low:high")
    parser.add_argument("--tokens", type=int, default=2048, help="train.max_tokens_per_micro_batch")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per layout (alternated)")
    args = parser.parse_args()
    span = lambda text: tuple(int(x) for x in text.split(":"))  # noqa: E731
    batch = ragged_rows(args.rows, span(args.prompts), span(args.responses))
    micro = plan(batch, Budget(rows=args.rows, tokens=args.tokens))
    parts = [batch.select_units(units).trimmed() for units in micro]
    computed, real = widths(parts), int(batch.attention_mask.sum())
    print(f"{args.rows} rows, prompts {args.prompts}, responses {args.responses}, {len(micro)} micro batches of <= {args.tokens} tokens")
    print("| model | layout | tokens computed | padding | s/pass | speed-up |")
    print("|---|---|---|---|---|---|")
    for size in args.sizes.split(","):
        torch.manual_seed(0)
        model = random_llama(size)
        ref = [train_pass(model, parts, name)[0] for name in LAYOUTS]  # warm-up, and every layout agrees
        for outputs in ref[1:]:
            for a, b in zip(ref[0], outputs):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
        times = {name: [] for name in LAYOUTS}
        for _ in range(args.repeats):
            for name in LAYOUTS:
                times[name].append(train_pass(model, parts, name)[1])
        base = statistics.median(times["aligned"])
        for name in LAYOUTS:
            t = statistics.median(times[name])
            print(f"| {size} | {name} | {computed[name]} | {1 - real / computed[name]:.0%} | {t:.3f} | {base / t:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
