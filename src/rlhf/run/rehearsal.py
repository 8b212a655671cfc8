"""`python -m rlhf.train preflight=true ...`: rehearse the run's first step on a tiny batch, then report and exit.

Every stage of a real step runs, with the run's own models, strategies and schedule settings, on 2 prompts (the
configured samples each) and at most as many new tokens as the parity probe (`rlhf.checks.parity.short_sampling`): the checks made before any model loads, loading,
the weight push (verified, `rlhf.checks.weight_sync`), the log-prob parity probe (`rlhf.checks.parity`), generation and scoring,
the update (logprobs, reference, values, advantages, optimiser steps), a hybrid engine's sleep and wake, the push of the updated weights,
evaluation, a checkpoint saved and reloaded (in a temporary folder beside the run's checkpoints) and the export.
The report gives each stage's outcome (ok, or the error with its fix), seconds and peak memory: the fast answer to
"will my long job survive its first step?". The run folder receives nothing but the log.
"""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from rlhf.run import checkpoint, preflight
from rlhf import exits, plan
from rlhf.errors import user_exits_named
from rlhf.checks import hub, parity
from rlhf.run.build import build_components
from rlhf.config import ConfigError, validate
from rlhf.distributed.remote import WorkerError
from rlhf.registry import schedule_trait
from rlhf.run.state import NonFiniteGuard, RunState
from rlhf.seeding import seed_everything
from rlhf.models.fingerprint import first_difference, fingerprint

log = logging.getLogger("rlhf")

REHEARSAL_PROMPTS = 2  # prompts in the rehearsed step (each with algorithm.num_samples_per_prompt samples)


@dataclass
class StageResult:
    """One rehearsed stage: its name, ok / error / not run, seconds, this process's peak memory, and a detail line
    (its figures when ok, the error with its fix when not)."""

    name: str
    status: str
    seconds: float = 0.0
    peak_mib: float | None = None
    detail: str = ""
    exit_code: int = exits.FINISHED  # what the real run would exit with on this stage's error (rlhf.exits)


class PeakMemory:
    """This process's peak memory during one stage: CUDA's peak allocation when the run is on a GPU, else the peak
    resident set (Linux resets it through /proc/self/clear_refs; elsewhere the peak since start)."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda") and torch.cuda.is_available()

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass

    def peak_mib(self) -> float | None:
        if self.cuda:
            return torch.cuda.max_memory_allocated() / 2**20
        try:
            status = Path("/proc/self/status").read_text()
        except OSError:
            return None
        kib = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), None)
        return kib / 1024 if kib is not None else None


class Rehearsal:
    """The stages of one step on a tiny batch; each method runs one, keeps what later ones need, and returns its
    detail line."""

    def __init__(self, cfg, out: Path) -> None:
        self.cfg, self.out = cfg, out
        self.root = checkpoint.checkpoint_root(cfg, out)
        self.c = self.spec = self.scored = None
        self.sampling = parity.short_sampling(cfg.generator)

    def stages(self) -> list[tuple[str, object]]:
        """(name, method) of every stage, in order."""
        named = [
            ("config", self.config), ("models and data found", self.sources), ("memory plan", self.plan),
            ("output folders", self.outputs), ("load models and data", self.load), ("log-prob parity", self.parity),
            ("generate and score", self.collect), ("update", self.update),
        ]
        if schedule_trait(self.cfg.schedule, "sleeps_generator"):
            named.append(("generator sleep and wake", self.sleep_and_wake))
        named += [("weight push (verified)", self.push), ("evaluate", self.evaluate),
                  ("checkpoint save and reload", self.checkpoint)]
        if self.cfg.checkpoint.save_final_model:
            named.append(("export final model", self.export))
        return named

    def config(self) -> str:
        self.spec = validate(self.cfg)
        sizes = self.spec.sizes
        return f"{sizes.samples_per_step} samples per step, {sizes.optimizer_steps} optimiser steps in all"

    def sources(self) -> str:
        hub.check_sources(self.cfg)
        return ""

    def plan(self) -> str:
        made = plan.check(self.spec)
        if made is None:
            return "skipped (see the log)"
        verdict = " (does NOT fit: plan.enforce=false)" if made.fits is False else ""
        return f"{made.needed(made.worst) / 2**30:.2f} GiB planned on the fullest device{verdict}"

    def outputs(self) -> str:
        size = preflight.checkpoint_bytes(self.spec)
        preflight.check_outputs(preflight.train_outputs(self.cfg, self.out, self.root, size, self.spec.sizes.longest_row))
        return f"a checkpoint needs about {size / 2**20:.0f} MiB"

    def load(self) -> str:
        seed_everything(self.cfg.seed)
        self.c = build_components(self.spec)
        return f"generator {self.cfg.generator.name}, policy {self.cfg.policy.name} on {self.c.device}"

    def parity(self) -> str:
        figures = parity.gate(self.c, self.spec)
        if figures is None:
            return "skipped (checks.parity_prompts=0)"
        return f"mean |Δ log p| {figures['mean']:.2g}, max {figures['max']:.2g}, k3 KL {figures['k3']:.2g}"

    def collect(self) -> str:
        """The run's `Collector.collect` on a few prompts, with the probe's short sampling."""
        examples = self.c.collector.prompts.next_batch(REHEARSAL_PROMPTS)
        self.scored = self.c.collector.collect(examples, sampling=self.sampling)
        return f"{len(self.scored.batch)} responses, mean score {self.scored.scores.mean().item():.3g}"

    def update(self) -> str:
        """The run's `Learner.update`: logprobs, reference, values, advantages, the optimiser steps."""
        guard = NonFiniteGuard(self.cfg.train.max_skipped_steps_in_row)
        metrics = self.c.learner.update(self.scored, guard)
        if "policy/grad_norm" not in metrics:
            raise FloatingPointError("every optimiser step was skipped: the loss or gradient norm was not finite")
        return f"{len(self.scored.batch)} rows, policy grad norm {metrics['policy/grad_norm']:.3g}"

    def sleep_and_wake(self) -> str:
        self.c.collector.generator.sleep()
        freed = self.c.collector.generator.freed_bytes
        self.c.collector.load_weights(self.c.learner.policy.state_dict())  # every weight: asleep it holds none (schedule=hybrid's wake)
        return f"{freed / 2**20:.0f} MiB freed asleep"

    def push(self) -> str:
        self.c.collector.load_weights(self.c.learner.weights())  # what every schedule's push sends
        return f"verified (checks.weight_sync={self.cfg.checks.weight_sync})"

    def evaluate(self) -> str:
        examples = self.c.eval_examples[:REHEARSAL_PROMPTS]
        if not examples:
            return "skipped: no evaluation prompts"
        metrics, _ = self.c.collector.evaluate(examples, self.cfg.eval, self.sampling)
        return ", ".join(f"{k} {v:.3g}" for k, v in metrics.items() if k.endswith("_scores"))

    def checkpoint(self) -> str:
        """Save into a temporary folder beside the run's checkpoints (the disk they will use), reload, compare."""
        before = local_weights(self.c)
        with tempfile.TemporaryDirectory(prefix=".preflight-", dir=existing_parent(self.root)) as folder:
            path = checkpoint.save(self.c.collector, self.c.learner, Path(folder), 1, RunState(step=1).to_dict(), 1)
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            checkpoint.load(self.c.collector, self.c.learner, path)
        after = local_weights(self.c)
        if before is not None and (name := first_difference(before, after)) is not None:
            raise RuntimeError(f"the reloaded checkpoint's `{name}` differs from the saved policy's")
        return f"{size / 2**20:.0f} MiB written and read back" + (", weights equal" if before is not None else "")

    def export(self) -> str:
        with tempfile.TemporaryDirectory(prefix=".preflight-", dir=existing_parent(self.out)) as folder:
            self.c.learner.policy.export(Path(folder) / "final_model", self.c.tokenizer)
        return "Hugging Face folder written"

    def close(self) -> None:
        if self.c is not None:
            self.c.close()


def local_weights(c) -> dict[str, float] | None:
    """The fingerprint of the policy's weights when they are in this process; None on the Ray backend (gathering
    them to the driver would cost a copy of the model)."""
    return fingerprint(c.learner.policy.state_dict()) if c.backend is None else None


def existing_parent(path: Path) -> Path:
    """``path`` or its nearest existing ancestor."""
    path = path.resolve()
    while not path.exists():
        path = path.parent
    return path


def rehearse(cfg, out: Path) -> list[StageResult]:
    """Run every stage of `Rehearsal` in order; after a failure the rest are not run."""
    rehearsal = Rehearsal(cfg, out)
    peak = PeakMemory(str(cfg.cluster.device))
    results: list[StageResult] = []
    try:
        for name, stage in rehearsal.stages():
            if results and results[-1].status != "ok":
                results.append(StageResult(name, "not run"))
                continue
            peak.reset()
            start = time.perf_counter()
            try:
                with user_exits_named():
                    detail, status = stage(), "ok"
            except Exception as err:  # noqa: BLE001 -- the report names it (a sys.exit too, as a UserExit)
                log.debug("preflight stage %s failed", name, exc_info=True)
                detail, status = f"{type(err).__name__}: {err}", "error"
                code = exit_code(err)
            results.append(StageResult(name, status, time.perf_counter() - start, peak.peak_mib(), detail,
                                       code if status == "error" else exits.FINISHED))
    finally:
        rehearsal.close()
    return results


def exit_code(err: Exception) -> int:
    """The exit code `rlhf.train` gives ``err`` (`rlhf.exits`)."""
    if isinstance(err, ConfigError):
        return exits.CONFIG_ERROR
    if isinstance(err, WorkerError):
        return exits.WORKER_FAILED
    return exits.RUN_RAISED


def render(results: list[StageResult]) -> str:
    """The one-screen report: a line per stage, then the verdict."""
    lines = [f"{'stage':<30} {'result':<8} {'seconds':>8} {'peak MiB':>9}  detail"]
    for r in results:
        peak = f"{r.peak_mib:9.0f}" if r.peak_mib is not None else f"{'':>9}"
        detail = r.detail if r.status == "ok" else r.detail.splitlines()[0] if r.detail else ""
        lines.append(f"{r.name:<30} {r.status:<8} {r.seconds:8.2f} {peak}  {detail}")
    failed = next((r for r in results if r.status == "error"), None)
    if failed is None:
        lines.append("preflight passed: every stage of a step ran; start the run without preflight=true")
    else:
        lines.append(f"preflight failed at '{failed.name}':\n{failed.detail}")
    return "\n".join(lines)
