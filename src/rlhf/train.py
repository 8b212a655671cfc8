"""Entry point: `python -m rlhf.train [hydra overrides]` composes the config, checks it, trains.

Examples:
    python -m rlhf.train
    python -m rlhf.train algorithm=rloo train.lr=3e-4
    python -m rlhf.train --multirun train.lr=1e-4,3e-4 seed=1,2
    python -m rlhf.train --cfg job          # print the composed config

Exit codes (`rlhf.exits`): 0 finished, 2 config error or run folder in use, 3 non-finite loss, 4 a worker failed,
5 interrupted by SIGINT/SIGTERM with a checkpoint saved, 6 an error raised during the run (user code or a bug).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from transformers.utils import logging as transformers_logging

from rlhf.run import checkpoint, preflight, rehearsal, sweep
from rlhf import exits, plan
from rlhf.disk import check_writable_folder
from rlhf.checks import hub, parity
from rlhf.run.build import build_components
from rlhf.config import ConfigError, RunSpec, register_schema, validate
from rlhf.errors import StopRequested
from rlhf.config.compose import check_command_line
from rlhf.config.moved import check_overrides
from rlhf.config.tiny import tiny_settings_warning
from rlhf.distributed.cluster import end_if_cluster_lost
from rlhf.distributed.layout import check_launcher
from rlhf.distributed.remote import WorkerError
from rlhf.run.lock import check_free, folder_lock
from rlhf.run.state import NonFiniteError, NonFiniteGuard, RunState, StopSignals
from rlhf.schedules.loop import Loop
from rlhf.seeding import seed_everything
from rlhf.tracking.progress import wants_bar
from rlhf.tracking.tracker import Tracker
from rlhf.checks.weight_sync import resumed

log = logging.getLogger("rlhf")

register_schema()


def train(cfg: DictConfig, out: Path):
    """Validate, build, resume if asked, run the schedule in folder ``out``, export. Returns the final RunState.

    Before any model loads: every model and dataset can be found (`rlhf.checks.hub`), the run fits its devices'
    memory (`rlhf.plan`), and every folder it writes is writable with room for a checkpoint (`rlhf.run.preflight`)."""
    spec = validate(cfg)
    hub.check_sources(cfg)
    plan.check(spec)
    root = checkpoint.checkpoint_root(cfg, out)
    checkpoint_size = preflight.checkpoint_bytes(spec)
    preflight.check_outputs(preflight.train_outputs(cfg, out, root, checkpoint_size, spec.sizes.longest_row))
    preflight.check_wandb(spec.logging)
    preflight.check_ray_address(spec.cluster)
    with run_folder_locks(out, root), checkpoint.recording(root, preflight.config_text(cfg), checkpoint_size):
        return train_locked(spec, out, root)


@contextmanager
def run_folder_locks(out: Path, root: Path):
    """Hold the run folder (and a `checkpoint.dir` outside it) for this run alone; see `rlhf.run.lock`."""
    with ExitStack() as stack:
        stack.enter_context(folder_lock(out, "run folder (hydra.run.dir)"))
        if not root.resolve().is_relative_to(out.resolve()):
            stack.enter_context(folder_lock(root, "checkpoint.dir"))
        yield


def train_locked(spec: RunSpec, out: Path, root: Path):
    """`train` once the run's folders are locked (``spec``: the run, as `validate` resolved it)."""
    cfg, sizes = spec.config, spec.sizes
    resume_from = checkpoint.resume_path(cfg, root)
    if resume_from is not None:
        preflight.check_resume(spec, resume_from, sweep.swept_keys(sys.argv[1:]))
    log.info("output folder: %s", out)
    log.info("run: %s", spec.describe())
    log.info("derived sizes: %s", ", ".join(f"{k}={v}" for k, v in sizes.as_dict().items()))
    seed_everything(spec.seed)
    with StopSignals() as stop:  # from the first model load: a stop before the first step ends the run cleanly
        components = build_components(spec, push=resume_from is None)  # resuming: the checkpoint's weights are pushed
        stop.arm()  # the build may have put in handlers of its own (ray.init's SIGTERM handler exits at once)
        try:
            state = run_schedule(spec, out, components, root, resume_from, stop)
        finally:
            components.close()
    if not state.preempted:
        summarize(state)
    return state


def run_schedule(spec: RunSpec, out: Path, components, root: Path, resume_from: Path | None, stop: StopSignals):
    """Resume if asked, run the schedule with tracking, export the final policy. Returns the final RunState; a stop
    requested (``stop``) before the first step returns it at once, preempted."""
    cfg, sizes, schedule = spec.config, spec.sizes, spec.schedule.obj
    max_skipped = spec.train.max_skipped_steps_in_row
    state = RunState(guard=NonFiniteGuard(max_skipped))
    if resume_from is not None:
        state = RunState.from_dict(checkpoint.load(components.collector, components.learner, resume_from, spec.checkpoint.allow_config_change), max_skipped)
        resumed(components.collector.generator, state.step)
        components.collector.generator.update_weights(components.learner.policy.state_dict())  # the generator's first push
    with suppress(StopRequested):  # agents that play the probe are abandoned at a stop signal, answered below
        parity.gate(components, spec)  # before the first step: the generator samples what the trainer scores
    if stop.requested:
        log.warning("%s received before the first step: stopped, nothing new to save; run again (resume=auto) to "
                    "start", stop.requested)
        state.preempted = True
        return state
    tracker = Tracker(
        out, spec.logging.tensorboard, resume_step=state.step if resume_from else None, checkpoint_root=root,
        settings=spec.logging,
    )
    tracker.config(OmegaConf.to_yaml(cfg), sizes.as_dict())
    if components.data_report:
        (out / "dataset_report.json").write_text(json.dumps(components.data_report, indent=2) + "\n")
    log.info("run id %s, starting at step %d", state.run_id, state.step)
    with tracker:  # the tracker closes (a W&B run marked failed) on errors too
        state = schedule(components.collector, components.learner, Loop(spec, tracker, components.eval_examples, state, stop))
    state.elapsed = tracker.elapsed()
    if state.preempted:
        return state
    if spec.checkpoint.save_final_model:
        components.learner.policy.export(out / "final_model", components.tokenizer)
        log.info("final policy saved as a Hugging Face folder: %s", out / "final_model")
        if spec.policy.lora.rank is not None:
            log.info("LoRA adapters saved as a PEFT folder (PeftModel.from_pretrained(base, path)): %s", out / "final_adapter")
    return state


def summarize(state) -> None:
    first, last = state.first_eval, state.last_eval
    log.info("done in %.0f s. eval start -> end:", state.elapsed)
    for key in sorted(set(first) & set(last)):
        log.info("  %-32s %.3f -> %.3f", key, first[key], last[key])


def main() -> float | None:
    """`python -m rlhf.train` and `rlhf-train`: a launch under torchrun or a key that moved is refused (exit 2) before
    Hydra composes, then `run`."""
    try:
        check_launcher(os.environ, torch.cuda.is_available)  # under torchrun every copy would train the whole run: refused in each
        check_overrides(sys.argv[1:])
        check_command_line(sys.argv[1:])
        sweep.check_sweep_values(sys.argv[1:])
        for override in sys.argv[1:]:  # a folder another run holds, or none can write: refused before Hydra makes it
            if override.startswith("hydra.run.dir=") and "${" not in override:
                check_free(Path(override.partition("=")[2]).expanduser(), "run folder (hydra.run.dir)")
                check_writable_folder(Path(override.partition("=")[2]).expanduser(), "hydra.run.dir")
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        raise SystemExit(exits.CONFIG_ERROR) from None
    try:
        result = run()
    except SystemExit as exit:  # `run` ends with this project's codes, Hydra with 1 for its own errors
        code = exits.of_hydra(exit.code)
        end_if_cluster_lost(code)
        raise SystemExit(code) from None
    end_if_cluster_lost(exits.FINISHED)
    return result


@hydra.main(config_path="pkg://rlhf.conf", config_name="config", version_base="1.3")
def run(cfg: DictConfig) -> float | None:
    """Train; exit with the outcome's code (`rlhf.exits`), or in a `--multirun` record it for the sweep's summary."""
    if not wants_bar(cfg.logging.progress_bar, sys.stderr):
        transformers_logging.disable_progress_bar()  # its loading bars would put control characters into CI logs
    warning = tiny_settings_warning(cfg, HydraConfig.get().runtime.choices.get("model"))
    if warning:
        log.warning(warning)
    if cfg.preflight:
        return preflight_only(cfg, Path(HydraConfig.get().runtime.output_dir))
    try:
        state = train(cfg, Path(HydraConfig.get().runtime.output_dir))
    except ConfigError as err:
        log.error("config error: %s", err)
        return sweep.end_job(exits.CONFIG_ERROR, f"config error: {err}")
    except NonFiniteError as err:
        log.error("training stopped: %s", err)
        return sweep.end_job(exits.NON_FINITE, f"training stopped: {err}")
    except WorkerError as err:
        log.error("a worker failed: %s", err)
        return sweep.end_job(exits.WORKER_FAILED, f"a worker failed: {err}")
    except Exception as err:  # user code (reward function, environment) or a bug: a paragraph, not a traceback
        out = Path(HydraConfig.get().runtime.output_dir)
        code = exits.report_run_error(err, checkpoint.resume_hint(checkpoint.checkpoint_root(cfg, out)))
        return sweep.end_job(code, f"{type(err).__name__}: {err}")
    if state.preempted:  # saved and resumable, but not finished: a scheduler must not take it for done
        saved = ", checkpoint saved" if state.step else " (before the first step: nothing to save)"
        return sweep.end_job(exits.INTERRUPTED_SAVED, f"interrupted at step {state.step}{saved}")
    sweep.end_job(exits.FINISHED, "finished")
    # returned for Hydra sweepers that optimise a value
    return state.last_eval.get("eval/sampled_correct_rate")


def preflight_only(cfg: DictConfig, out: Path) -> None:
    """`preflight=true`: rehearse one step on a tiny batch (`rlhf.run.rehearsal`), print the report, exit 0 when every
    stage passed, else with the code the run would have exited with."""
    results = rehearsal.rehearse(cfg, out)
    log.info("preflight report:\n%s", rehearsal.render(results))
    failed = next((r for r in results if r.status == "error"), None)
    if failed is None:
        return sweep.end_job(exits.FINISHED, "preflight passed")
    return sweep.end_job(failed.exit_code, f"preflight failed at {failed.name}")


if __name__ == "__main__":
    main()
