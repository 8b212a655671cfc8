"""Procedurally generated reasoning problems from the `reasoning-gym` package, for `dataset=reasoning_gym`.

Each task of `dataset.tasks` gives `dataset.train_size` training and `dataset.eval_size` eval problems from
one generator seeded by the run's seed; the eval problems are the indices after the training ones, so the two
splits never share an index. A prompt's ground truth is ``{"task": name, "entry": the generated entry}``: plain
data that pickles across processes, and all the `reasoning_gym` reward needs to call the task's `score_answer`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from types import ModuleType
from typing import Optional

from rlhf.data.answers import with_suffix
from rlhf.data.config import DatasetConfig
from rlhf.data.mix import SourceReport, log_report
from rlhf.data.templates import encode_prompt
from rlhf.data.prompts import PromptExample, PromptSplits
from rlhf.data.templates import render_prompt, resolve_template
from rlhf.errors import ConfigError
from rlhf.registry import register

INSTALL = "pip install 'rlhf[reasoning]' (the reasoning-gym package)"



@dataclass
class ReasoningGymConfig(DatasetConfig):
    """Problems generated locally by reasoning-gym, seeded by the run."""

    tasks: list[str] = field(default_factory=lambda: ["basic_arithmetic", "chain_sum"])  # task names (reasoning_gym.factory.DATASETS), mixed evenly
    train_size: int = 1000  # training problems generated per task, seeded by the run's seed
    eval_size: int = 50  # eval problems per task (generated after the training ones); 0 = eval on the train ones
    prompt_suffix: Optional[str] = "Give only the final answer inside <answer></answer> tags."  # instruction appended to every prompt: the format the reward reads
    chat_template: str = "tokenizer"  # the model's own chat template (or simple_concat_with_space, tulu, a .jinja file)
    max_prompt_length: int = 512  # tokens; longer problems are dropped and counted

def load_package() -> ModuleType:
    """The optional `reasoning_gym` package (1.5 s to import, so only runs that use it pay)."""
    try:
        import reasoning_gym
    except ImportError as err:
        raise ConfigError(f"dataset=reasoning_gym and reward=reasoning_gym need {INSTALL}: {err}") from None
    return reasoning_gym


def task_names() -> list[str]:
    """Every task the installed package can generate."""
    return sorted(load_package().factory.DATASETS)


def check_reasoning_gym(cfg) -> None:
    """ConfigError for bad `dataset.tasks` or sizes, or the reward without its dataset (before models load)."""
    data = cfg.dataset
    if data.name == "reasoning_gym":
        if not data.tasks:
            raise ConfigError("dataset.tasks is empty; name reasoning-gym tasks: dataset.tasks=[basic_arithmetic]")
        valid = task_names()
        unknown = [t for t in data.tasks if t not in valid]
        if unknown:
            raise ConfigError(
                f"dataset.tasks: unknown reasoning-gym task(s) {unknown}; valid tasks: {', '.join(valid)}"
            )
        if len(set(data.tasks)) != len(data.tasks):
            raise ConfigError(f"dataset.tasks={list(data.tasks)} names a task twice; raise dataset.train_size")
        if data.train_size < 1 or data.eval_size < 0:
            raise ConfigError(
                f"dataset.train_size={data.train_size} must be >= 1 and dataset.eval_size={data.eval_size} >= 0"
            )
    scorers = [i for i, fn in enumerate(cfg.reward.functions) if fn.name == "reasoning_gym"]
    if scorers and data.name != "reasoning_gym" and cfg.env.name is None:
        raise ConfigError(
            f"reward.functions[{scorers[0]}].name=reasoning_gym scores the prompts of dataset=reasoning_gym "
            f"(their ground truth is the generated problem), not dataset={data.name}; choose that dataset or "
            "another reward"
        )


def task_examples(task: str, entries, cfg, tokenizer, template: str, split: str):
    """Prompts from one task's generated ``entries`` (over-long ones dropped and counted), with their report."""
    report = SourceReport(f"reasoning_gym:{task}", split, rows=len(entries))
    examples = []
    for entry in entries:
        messages = with_suffix([{"role": "user", "content": entry["question"]}], cfg.prompt_suffix)
        text = render_prompt(tokenizer, messages, template, cfg.chat_template, f"a reasoning_gym {task} question")
        ids = encode_prompt(tokenizer, text)
        if len(ids) > cfg.max_prompt_length:
            report.too_long += 1
            continue
        truth = {"task": task, "entry": entry}
        examples.append(PromptExample(text=text, token_ids=tuple(ids), ground_truth=truth))
    report.kept = len(examples)
    return examples, {"role": split, **asdict(report)}


@register("dataset", "reasoning_gym")
def reasoning_gym_dataset(cfg, tokenizer, seed: int = 1) -> PromptSplits:
    """`dataset.train_size` + `dataset.eval_size` problems per task of `dataset.tasks`, seeded by the run."""
    package = load_package()
    template = resolve_template(cfg.chat_template, tokenizer)
    splits: dict[str, list[PromptExample]] = {"train": [], "eval": []}
    reports = []
    for task in cfg.tasks:
        problems = package.create_dataset(task, size=cfg.train_size + cfg.eval_size, seed=seed)
        entries = [problems[i] for i in range(len(problems))]
        for split, part in (("train", entries[: cfg.train_size]), ("eval", entries[cfg.train_size :])):
            if part:
                examples, report = task_examples(task, part, cfg, tokenizer, template, split)
                splits[split] += examples
                reports.append(report)
    if not splits["train"]:
        raise ValueError(
            f"every generated training prompt is longer than dataset.max_prompt_length={cfg.max_prompt_length} "
            "tokens; raise it or shorten dataset.prompt_suffix"
        )
    report = {"sources": reports}
    log_report(report)
    return PromptSplits(train=splits["train"], eval=splits["eval"] or splits["train"], report=report)


reasoning_gym_dataset.config = ReasoningGymConfig  # its keys (`dataset.*`)
