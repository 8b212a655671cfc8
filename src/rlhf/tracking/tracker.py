"""Metrics to TensorBoard, to a JSON Lines file, to the console (lines and a live bar) and optionally to W&B."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import yaml
from torch.utils.tensorboard import SummaryWriter

from rlhf.tracking.progress import ProgressBar, wants_bar
from rlhf.tracking.wandb_run import WandbRun

log = logging.getLogger("rlhf")

# (metric, console label, format) for the plain progress line
CONSOLE_FIELDS = (
    ("objective/scores", "score", "{:+.3f}"),
    ("objective/verifiable_correct_rate", "correct", "{:.3f}"),
    ("objective/kl", "kl", "{:.4f}"),
    ("objective/entropy", "ent", "{:.3f}"),
    ("val/sequence_lengths", "len", "{:.2f}"),
    ("loss/policy_avg", "loss", "{:+.4f}"),
    ("loss/value_avg", "vloss", "{:.4f}"),
    ("objective/loss", "dpo_loss", "{:.4f}"),
    ("time/step", "s/step", "{:.2f}"),
)

PROMPTS_FILE = "prompts.jsonl"  # {"step", "prompts": [index in the training split, ...]}: what each step trained


def _truncate_after(path: Path, step: int) -> None:
    """Keep the JSON Lines records of steps <= ``step`` (and drop a line a kill cut short)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("step", 0) <= step:
            kept.append(line)
    path.write_text("".join(line + "\n" for line in kept))


def console_line(step: int, num_steps: int, metrics: dict[str, float]) -> str:
    """`step   20/200 | score +0.125 | ... | s/step 0.42`: the fields of CONSOLE_FIELDS the step has."""
    parts = [f"step {step:>4}/{num_steps}"]
    parts += [f"{label} {fmt.format(metrics[key])}" for key, label, fmt in CONSOLE_FIELDS if key in metrics]
    return " | ".join(parts)


RECORDS = ("metrics.jsonl", "eval_generations.jsonl", PROMPTS_FILE, "tensorboard")  # what a run writes step by step


def set_aside_records(output_dir: Path) -> Path | None:
    """A fresh start in a folder that holds an earlier run's records (a run killed before its first checkpoint, then
    started again with `resume=auto`, or the same folder reused): they move into ``previous_run_<n>/`` beside them, so
    the new run's files hold its own steps only and nothing of the old run is lost. Returns that folder, or None."""
    found = [output_dir / name for name in RECORDS if (output_dir / name).exists()]
    if not found:
        return None
    n = 1
    while (output_dir / f"previous_run_{n}").exists():
        n += 1
    aside = output_dir / f"previous_run_{n}"
    aside.mkdir()
    for path in found:
        path.rename(aside / path.name)
    log.warning("a fresh start in %s: the records found there (%s) moved to %s", output_dir,
                ", ".join(p.name for p in found), aside)
    return aside


class Tracker:
    """Writes scalars and sample texts; `close` flushes everything. As a context manager it closes on errors too."""

    def __init__(
        self, output_dir: Path, tensorboard: bool, resume_step: int | None = None, checkpoint_root: Path | None = None,
        settings=None,
    ) -> None:
        """On resume, records after ``resume_step`` (written after the checkpoint, then lost) are dropped.

        ``checkpoint_root`` is where the schedule saves checkpoints (default <output_dir>/checkpoints).
        ``settings`` (the `logging` node) sets the console cadence, the bar and W&B; without it: a line per step.
        """
        self.output_dir = output_dir
        self.checkpoint_root = checkpoint_root or output_dir / "checkpoints"
        output_dir.mkdir(parents=True, exist_ok=True)
        jsonl = output_dir / "metrics.jsonl"
        if resume_step is not None:
            for path in (jsonl, output_dir / "eval_generations.jsonl", output_dir / PROMPTS_FILE):
                _truncate_after(path, resume_step)
        else:
            set_aside_records(output_dir)
        self.log_every = settings.log_every if settings is not None else 1
        # decided before wandb starts, as wandb wraps the console streams
        bar = settings is not None and wants_bar(settings.progress_bar, sys.stderr)
        self.bar = ProgressBar(sys.stderr) if bar else None
        # first, as the step likeliest to fail (login, network), while nothing else is open
        self.wandb = WandbRun(output_dir, settings) if settings is not None and settings.wandb else None
        self.writer = None
        if tensorboard:
            purge = resume_step + 1 if resume_step is not None else None
            self.writer = SummaryWriter(log_dir=str(output_dir / "tensorboard"), purge_step=purge)
        self.jsonl = open(jsonl, "a", encoding="utf-8")
        self.prompts_file = None  # PROMPTS_FILE, opened by the first step that trains
        self.start = time.perf_counter()

    def config(self, composed_yaml: str, derived: dict[str, int]) -> None:
        """The composed config and the derived sizes: TensorBoard's text tab, `derived_sizes.json`, the W&B config."""
        (self.output_dir / "derived_sizes.json").write_text(json.dumps(derived, indent=2) + "\n")
        if self.writer is not None:
            self.writer.add_text("config", "```yaml\n" + composed_yaml + "```", 0)
            self.writer.add_text("derived_sizes", "```json\n" + json.dumps(derived, indent=2) + "\n```", 0)
        if self.wandb is not None:
            self.wandb.config({**yaml.safe_load(composed_yaml), "derived_sizes": derived})

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.writer is not None:
            for key, value in metrics.items():
                self.writer.add_scalar(key, value, step)
        self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self.jsonl.flush()
        if self.wandb is not None:
            self.wandb.log(step, metrics)

    def prompts(self, step: int, ids: list[int | None]) -> None:
        """The prompts step ``step`` trained, in order, as indices into the training split: a line of PROMPTS_FILE."""
        if self.prompts_file is None:
            self.prompts_file = open(self.output_dir / PROMPTS_FILE, "a", encoding="utf-8")
        self.prompts_file.write(json.dumps({"step": step, "prompts": ids}) + "\n")
        self.prompts_file.flush()

    def console(self, step: int, num_steps: int, metrics: dict[str, float]) -> None:
        """Called every step: moves the bar (if any); a plain line every `logging.log_every` steps and at the last."""
        if self.bar is not None:
            self.bar.update(step, num_steps, metrics)
        if step % self.log_every == 0 or step == num_steps:
            log.info(console_line(step, num_steps, metrics))

    def samples(self, step: int, prompts: list[str], responses: list[str], scores: list[float], tag: str = "samples") -> None:
        """A small markdown table of prompt / completion / score, in TensorBoard's text tab and the log."""
        rows = ["| prompt | completion | score |", "|---|---|---|"]
        rows += [f"| `{p}` | `{r}` | {s:+.2f} |" for p, r, s in zip(prompts, responses, scores)]
        if self.writer is not None:
            self.writer.add_text(tag, "\n".join(rows), step)
        if self.wandb is not None:
            self.wandb.samples(step, tag, prompts, responses, scores)
        for p, r, s in zip(prompts, responses, scores):
            log.debug("%s step %d: %r -> %r (%+.2f)", tag, step, p, r, s)

    def generations(self, step: int, mode: str, scored) -> None:
        """Every eval completion, one JSON object per line, in <run folder>/eval_generations.jsonl."""
        with open(self.output_dir / "eval_generations.jsonl", "a", encoding="utf-8") as f:
            for prompt, response, score in zip(scored.prompts, scored.responses, scored.scores.tolist()):
                f.write(json.dumps({"step": step, "mode": mode, "prompt": prompt, "response": response, "score": score}) + "\n")

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def close(self, failed: bool = False) -> None:
        """Close the bar, TensorBoard, the JSON Lines file and the W&B run (marked failed if ``failed``)."""
        if self.bar is not None:
            self.bar.close()
        try:
            if self.writer is not None:
                self.writer.flush()
                self.writer.close()
            self.jsonl.close()
            if self.prompts_file is not None:
                self.prompts_file.close()
        finally:
            if self.wandb is not None:
                self.wandb.close(failed)
                self.wandb = None

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        self.close(failed=exc_type is not None)
