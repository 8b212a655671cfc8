"""The visible supervised warm start that makes the built-in tiny model a plausible, imperfect policy.

    python -m rlhf.warmstart                     # rebuilds src/rlhf/assets/tiny_arith (the committed one)
    python -m rlhf.warmstart --output-dir /tmp/m --steps 200
    python -m rlhf.warmstart --retry             # rebuilds src/rlhf/assets/tiny_arith_retry (env=arith_retry)
    python -m rlhf.warmstart --teacher           # rebuilds src/rlhf/assets/tiny_arith_teacher (experiment=opd_arith_tiny)
    python -m rlhf.warmstart --count             # rebuilds src/rlhf/assets/tiny_count (dataset=count, the long-tail task)
    python -m rlhf.warmstart --count --teacher   # rebuilds src/rlhf/assets/tiny_count_teacher (experiment=opd_count_tiny)

It trains a tiny Llama from scratch on addition demonstrations that are right only part of the time:
by default 30% correct, 40% off by one (the most common single answer, so greedy decoding starts out
wrong), 20% a random number and 10% malformed (sometimes too long to stop in time). RL then has real
errors to fix; none of this runs inside `python -m rlhf.train`.

``--retry`` adds the second turn of `env=arith_retry`: after every wrong first answer the problem follows
again (`<bos>3+4=8<eos>3+4=`) with a retry that is right 30% of the time and repeats the rejected answer 40%
of the time (so a greedy retry starts wrong too). Without it the model has never seen a token after <eos>
and answers a retry with an empty string most of the time: RL would have nothing to reinforce there.

``--count`` demonstrates the counting task (`dataset=count`): 35% exact, 35% stopping a little early or late (up to
a fifth of N), 20% at a random length, 10% malformed; its model has room for 128 positions.

``--teacher`` is not supervised: it runs the default training (`python -m rlhf.train` as it stands: GRPO from
`tiny_arith`, 200 steps, seed 1) and keeps the policy it ends with, the stronger built-in model that
`experiment=opd_arith_tiny` distils into a fresh `tiny_arith`. ``--count --teacher`` is supervised like ``--count``
but on correct counts only: GRPO on the counting task levels off near 0.85 greedy, a teacher with little to teach.
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import tempfile
from pathlib import Path

import torch

from rlhf.config.compose import compose_config
from rlhf.data.arith import ALPHABET, MAX_OPERAND, arith_problems
from rlhf.data.count import CountDatasetConfig, count_answer
from rlhf.disk import WARM_START, check_own_output
from rlhf.errors import ConfigError
from rlhf.models.hf_folder import atomic_folder, save_hf_folder
from rlhf.models.tiny import build_char_tokenizer, build_tiny_llama
from rlhf.train import train as rl_train

DEFAULT_OUTPUT = Path(__file__).parent / "assets" / "tiny_arith"
RETRY_OUTPUT = Path(__file__).parent / "assets" / "tiny_arith_retry"
TEACHER_OUTPUT = Path(__file__).parent / "assets" / "tiny_arith_teacher"
COUNT_OUTPUT = Path(__file__).parent / "assets" / "tiny_count"
COUNT_TEACHER_OUTPUT = Path(__file__).parent / "assets" / "tiny_count_teacher"
COUNT_MIX = {"correct": 0.35, "near": 0.35, "random": 0.20, "malformed": 0.10}
CLEAN_MIX = {"correct": 1.0}  # the counting teacher's demonstrations
MIX = {"correct": 0.30, "off_by_one": 0.40, "random": 0.20, "malformed": 0.10}
RETRY_MIX = {"correct": 0.30, "repeat": 0.40, "random": 0.20, "malformed": 0.10}  # answers after a wrong one
PER_PROBLEM = 64  # demonstrations drawn for each problem


def demonstration(answer: str, rng: random.Random, max_sum: int) -> str:
    """One noisy demonstration for a problem whose correct answer is ``answer``."""
    kind = rng.choices(list(MIX), weights=list(MIX.values()))[0]
    if kind == "correct":
        return answer
    if kind == "off_by_one":
        return str(int(answer) + 1)
    if kind == "random":
        return str(rng.randint(0, max_sum))
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 6)))


def retry_demonstration(answer: str, rejected: str, rng: random.Random, max_sum: int) -> str:
    """One noisy retry after the wrong answer ``rejected``: right, the same again, random or malformed."""
    kind = rng.choices(list(RETRY_MIX), weights=list(RETRY_MIX.values()))[0]
    if kind == "correct":
        return answer
    if kind == "repeat":
        return rejected
    if kind == "random":
        return str(rng.randint(0, max_sum))
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 6)))


def build_examples(
    tokenizer, max_operand: int, per_problem: int, seed: int, retry: bool = False
) -> list[tuple[list[int], list[int]]]:
    """(token ids of prompt + demonstration + EOS, 1 where the loss applies) for every problem, ``per_problem``
    times; with ``retry``, a wrong demonstration is followed by the problem again and a retry."""
    rng = random.Random(seed)
    eos = tokenizer.eos_token_id
    examples = []
    for prompt, answer in arith_problems(max_operand):
        prompt_ids = tokenizer(prompt)["input_ids"]
        asked_again = tokenizer(prompt, add_special_tokens=False)["input_ids"]  # as env=arith_retry asks again
        for _ in range(per_problem):
            first = demonstration(answer, rng, 2 * max_operand)
            reply = tokenizer(first, add_special_tokens=False)["input_ids"] + [eos]
            ids, trained = prompt_ids + reply, [0] * len(prompt_ids) + [1] * len(reply)
            if retry and first != answer:
                second = tokenizer(retry_demonstration(answer, first, rng, 2 * max_operand), add_special_tokens=False)
                ids += asked_again + second["input_ids"] + [eos]
                trained += [0] * len(asked_again) + [1] * (len(second["input_ids"]) + 1)
            examples.append((ids, trained))
    return examples


def count_demonstration(n: int, rng: random.Random, max_count: int, mix: dict[str, float] = COUNT_MIX) -> str:
    """One demonstration of counting to ``n``, of a kind drawn from ``mix``: exact, near (off by up to a fifth of n),
    random or malformed."""
    kind = rng.choices(list(mix), weights=list(mix.values()))[0]
    if kind == "correct":
        return count_answer(n)
    if kind == "near":
        spread = max(1, n // 5)
        return count_answer(max(1, n + rng.choice([d for d in range(-spread, spread + 1) if d])))
    if kind == "random":
        return count_answer(rng.randint(1, max_count))
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 8)))


def build_count_examples(
    tokenizer, max_count: int, per_problem: int, seed: int, mix: dict[str, float] = COUNT_MIX
) -> list[tuple[list[int], list[int]]]:
    """(token ids of prompt + demonstration + EOS, 1 where the loss applies) for every count 1..max_count, the
    demonstrations drawn from ``mix``."""
    rng = random.Random(seed)
    examples = []
    for n in range(1, max_count + 1):
        prompt_ids = tokenizer(f"{n}=")["input_ids"]
        for _ in range(per_problem):
            reply = tokenizer(count_demonstration(n, rng, max_count, mix), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            examples.append((prompt_ids + reply, [0] * len(prompt_ids) + [1] * len(reply)))
    return examples


def train(
    output_dir: Path, steps: int, batch_size: int, lr: float, seed: int, max_operand: int, retry: bool = False,
    count: bool = False, count_mix: dict[str, float] = COUNT_MIX,
) -> None:
    torch.manual_seed(seed)
    tokenizer = build_char_tokenizer(ALPHABET)
    model = build_tiny_llama(
        len(tokenizer), max_positions=128 if count else 64, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    if count:
        examples = build_count_examples(tokenizer, CountDatasetConfig.max_count, PER_PROBLEM, seed=seed, mix=count_mix)
    else:
        examples = build_examples(tokenizer, max_operand, PER_PROBLEM, seed=seed, retry=retry)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - s / steps)
    rng = random.Random(seed)
    model.train()
    for step in range(1, steps + 1):
        batch = rng.sample(examples, batch_size)
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((batch_size, width), tokenizer.pad_token_id)
        labels = torch.full((batch_size, width), -100)
        for row, (ids, trained) in enumerate(batch):  # right-padded; loss on the replies and their EOS only
            input_ids[row, : len(ids)] = torch.tensor(ids)
            labels[row, : len(ids)] = torch.where(torch.tensor(trained).bool(), torch.tensor(ids), -100)
        loss = model(input_ids=input_ids, attention_mask=(labels != -100) | (input_ids != tokenizer.pad_token_id), labels=labels).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if step % 100 == 0 or step == steps:
            print(f"warm start step {step}/{steps}: loss {loss.item():.4f}", flush=True)
    save_hf_folder(output_dir, model, tokenizer, owner=WARM_START)
    print(f"saved to {output_dir}")


def build_teacher(output_dir: Path, seed: int) -> None:
    """The default training run's final policy, saved to ``output_dir`` (its evaluation left out: it changes nothing)."""
    with tempfile.TemporaryDirectory() as tmp:
        rl_train(compose_config([f"seed={seed}", "eval.every=0", "logging.tensorboard=false"]), Path(tmp))
        with atomic_folder(output_dir, owner=WARM_START) as folder:  # replaces only an earlier warm start (`check_args`)
            shutil.copytree(Path(tmp) / "final_model", folder, dirs_exist_ok=True)
    print(f"saved to {output_dir}")


def default_output(args: argparse.Namespace) -> Path:
    """The committed asset the flags rebuild when no --output-dir is given."""
    if args.teacher:
        return COUNT_TEACHER_OUTPUT if args.count else TEACHER_OUTPUT
    return COUNT_OUTPUT if args.count else RETRY_OUTPUT if args.retry else DEFAULT_OUTPUT


def check_args(args: argparse.Namespace, output_dir: Path) -> None:
    """ConfigError naming the flag for a value the warm start cannot train with, or an ``output_dir`` holding files
    it did not write; checked before any model is built."""
    if args.steps < 1:
        raise ConfigError(f"--steps={args.steps} must be >= 1 (an untrained model is no warm start)")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise ConfigError(f"--lr={args.lr} must be a positive number")
    if not 0 <= args.max_operand <= MAX_OPERAND:
        raise ConfigError(f"--max-operand={args.max_operand} must be within 0..{MAX_OPERAND}")
    problems = CountDatasetConfig.max_count if args.count else (args.max_operand + 1) ** 2
    if not 1 <= args.batch_size <= problems * PER_PROBLEM:
        raise ConfigError(f"--batch-size={args.batch_size} must be within 1..{problems * PER_PROBLEM}, the demonstrations there are")
    check_own_output(output_dir, "--output-dir", WARM_START)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m rlhf.warmstart", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--output-dir", type=Path, default=None,
        help="where to save: a folder that is missing, empty or an earlier warm start (default: the committed asset)",
    )
    parser.add_argument("--steps", type=int, default=1500, help="optimiser steps")
    parser.add_argument("--batch-size", type=int, default=128, help="demonstrations per step")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (linear decay to 0)")
    parser.add_argument("--seed", type=int, default=0, help="seeds data and initialisation")
    parser.add_argument("--max-operand", type=int, default=9, help="operands range over 0..max-operand")
    parser.add_argument("--retry", action="store_true", help="also demonstrate env=arith_retry's retry turn")
    parser.add_argument(
        "--teacher", action="store_true",
        help="the distillation teacher: the default RL run's final policy; with --count, supervised on correct counts only",
    )
    parser.add_argument("--count", action="store_true", help="the counting task's model (dataset=count)")
    args = parser.parse_args(argv)
    output_dir = args.output_dir or default_output(args)
    try:
        check_args(args, output_dir)
    except ConfigError as err:
        parser.error(str(err))  # usage and the message, exit 2
    if args.teacher and args.count:
        train(output_dir, args.steps, args.batch_size, args.lr, args.seed, args.max_operand,
              count=True, count_mix=CLEAN_MIX)
        return
    if args.teacher:
        build_teacher(output_dir, seed=1)
        return
    train(output_dir, args.steps, args.batch_size, args.lr, args.seed, args.max_operand, args.retry, args.count)


if __name__ == "__main__":
    main()
