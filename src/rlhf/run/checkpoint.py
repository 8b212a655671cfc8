"""Full training state on disk: atomic saves, pruning, finding the newest complete checkpoint, restoring.

A checkpoint is a folder `step_<8 digits>` holding each model's weights (safetensors), optimiser and
scheduler states (torch files read back with weights_only=True), RNG states, the resolved config its step ran
with (`config.yaml`, when the run records one: see `recording`), and `trainer_state.json` (written last). It is
assembled in a hidden temporary folder and renamed into place, so a crash during a save never leaves a folder
that looks complete.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from rlhf.disk import TRAIN_CHECKPOINTS, claim, free_bytes, fsync_dir, fsync_tree, lack_of_room, megabytes, owner_of, tree_bytes
from rlhf.errors import ConfigError, NoSpaceError
from rlhf.models.loading import safetensors_problem
from rlhf.seeding import rng_states

log = logging.getLogger("rlhf")

STATE_FILE = "trainer_state.json"
CONFIG_FILE = "config.yaml"  # the resolved config the checkpoint's step ran with
STATE_KEYS = ("step", "run", "prompts", "rewards", "rng")  # what `load` reads from it
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_RECORDS: dict[Path, tuple[str, int | None]] = {}  # checkpoint root -> (config text, estimated checkpoint bytes)
RESERVE = 1.5  # room kept free for one more checkpoint and the final model (about a third of one), in checkpoints


def checkpoint_root(cfg, run_dir: Path) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"


def is_checkpoint_entry(path: Path) -> bool:
    """Whether ``path``, in a checkpoint root, is what `save` writes there: a step folder or a temporary one (a root
    saved before roots were marked holds only these, `rlhf.disk.check_own_output`)."""
    return bool(_STEP_DIR.match(path.name)) or path.name.startswith(".tmp-")


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first (temporary and partial folders are ignored)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def resume_hint(root: Path) -> str:
    """What to do after a run failed: continue from the newest checkpoint under ``root``, or start again when none was
    saved (resume=auto would then start from step 0)."""
    if complete_checkpoints(root):
        return "fix it, then continue with resume=auto"
    return "fix it, then start the run again: no checkpoint was saved, so resume=auto would start from step 0"


def resume_path(cfg, root: Path) -> Path | None:
    """The checkpoint `resume` asks for: None (fresh), the newest under ``root`` (auto), or a given folder.

    A fresh start where ``root`` already holds complete checkpoints is refused: its first save would prune them as an
    abandoned future (`_prune`), losing the earlier run."""
    if cfg.resume is None:
        held = complete_checkpoints(root)
        if held:
            raise ConfigError(
                f"resume=null starts a fresh run, but {root} holds {len(held)} checkpoint(s) of an earlier run (the newest "
                f"{held[-1].name}), which its first save would delete; continue that run with resume=auto, start this one "
                f"in another folder (hydra.run.dir=... or checkpoint.dir=...), or delete {root} to start over"
            )
        return None
    if cfg.resume == "auto":
        return newest_loadable(root)
    path = Path(cfg.resume)
    if not (path / STATE_FILE).is_file():
        raise ConfigError(f"resume={cfg.resume}: not a complete checkpoint folder (no {STATE_FILE}); use resume=auto or a step_* folder")
    problem = checkpoint_problem(path)
    if problem:
        raise ConfigError(
            f"resume={cfg.resume}: the checkpoint is corrupt: {problem}; resume from another step_* folder, "
            f"or resume=auto (the newest checkpoint that loads)"
        )
    return path


def newest_loadable(root: Path) -> Path | None:
    """The newest checkpoint under ``root`` whose files read back (broken newer ones are named and skipped)."""
    found = complete_checkpoints(root)
    if not found:
        log.info("resume=auto: no complete checkpoint in %s, starting fresh", root)
        return None
    broken = []
    for path in reversed(found):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        log.warning("resume=auto: skipping the corrupt checkpoint %s: %s", path, problem)
        broken.append(problem)
    raise ConfigError(
        f"resume=auto: no checkpoint in {root} loads ({'; '.join(broken)}); move the broken folders away, "
        f"or start fresh in another folder (hydra.run.dir=... or checkpoint.dir=...)"
    )


def checkpoint_problem(path: Path) -> str | None:
    """Why checkpoint ``path`` would not load, naming the file, or None; reads headers only, never the tensors.

    Every file the save listed in `trainer_state.json` must be there at the size it was written (a file deleted or
    cut short since, a prune stopped half way), and the recorded config must parse."""
    state, problem = _read_state(path / STATE_FILE)
    problems = [problem, _listed_files_problem(path, state), _config_problem(path / CONFIG_FILE)]
    if not (path / "rng.pt").is_file():
        problems.append(f"{path / 'rng.pt'} is missing")
    for model in sorted(p.parent for p in path.glob("*/model")):  # a trained model: its optimiser state beside it
        if not (model / "optim.pt").is_file() and not (model / "deepspeed").is_dir():
            problems.append(f"{model / 'optim.pt'} is missing")
    problems += [safetensors_problem(file) for file in sorted(path.rglob("*.safetensors"))]
    problems += [_torch_file_problem(file) for file in sorted(path.rglob("*.pt"))]
    return next((problem for problem in problems if problem), None)


def _read_state(file: Path) -> tuple[dict, str | None]:
    """``trainer_state.json`` read once: (its contents, or {} when unusable; why it is unusable (truncated, not JSON,
    keys missing), or None)."""
    try:
        state = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return {}, f"{file} is unreadable or truncated ({err})"
    if not isinstance(state, dict):
        return {}, f"{file} lacks {', '.join(STATE_KEYS)}"
    missing = [k for k in STATE_KEYS if k not in state]
    return state, f"{file} lacks {', '.join(missing)}" if missing else None


def _listed_files_problem(path: Path, state: dict) -> str | None:
    """The first file `trainer_state.json` (``state``) lists under "files" that is missing or not of the size saved
    (checkpoints written before the list: not checked), or None."""
    for name, size in state.get("files", {}).items():
        file = path / name
        if name == CONFIG_FILE:
            continue  # optional: a checkpoint without one resumes with a warning (`preflight.check_resume`)
        if not file.is_file():
            return f"{file} is missing (the save wrote it)"
        if (held := file.stat().st_size) != size:
            return f"{file} holds {held} bytes, the save wrote {size}"
    return None


def _config_problem(file: Path) -> str | None:
    """Why the recorded `config.yaml` does not parse, or None (a checkpoint without one loads: older saves)."""
    if not file.is_file():
        return None
    try:
        yaml.safe_load(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        return f"{file} is unreadable or not YAML ({str(err).splitlines()[0]})"
    return None


def _torch_file_problem(file: Path) -> str | None:
    """Why a torch.save file is unusable: its zip directory, written last, is missing when the file was cut short."""
    try:
        with zipfile.ZipFile(file):
            return None
    except (OSError, zipfile.BadZipFile) as err:
        return f"{file} is truncated or not a torch file ({err})"


def _json_rng(rng: dict[str, Any]) -> dict[str, Any]:
    """Python's and NumPy's states of `rng_states` ``rng`` as JSON values."""
    (version, internal, gauss), np_state = rng["python"], rng["numpy"]
    return {
        "python": [version, list(internal), gauss],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


@contextmanager
def recording(root: Path, config_text: str, estimated_bytes: int | None = None):
    """While the block runs, every checkpoint saved under ``root`` records ``config_text`` as its `config.yaml`
    (each step its own copy, so a resumed run never rewrites what an earlier step ran with); ``estimated_bytes``
    (a checkpoint's size, estimated before any model loaded) sizes the message of a save that hits a full disk."""
    key = Path(root).resolve()
    _RECORDS[key] = (config_text, estimated_bytes)
    try:
        yield
    finally:
        _RECORDS.pop(key, None)


def _checkpoint_bytes(root: Path) -> int | None:
    """About how big a checkpoint under ``root`` is: the newest complete one's size, else the run's estimate."""
    found = complete_checkpoints(root)
    return tree_bytes(found[-1]) if found else _RECORDS.get(Path(root).resolve(), ("", None))[1]


def check_room(root: Path, step: int, saved: bool = False) -> None:
    """NoSpaceError when the disk holding ``root`` has less room than one more checkpoint and the final model need
    (`RESERVE` times a checkpoint's size): raised after a step is logged, the run's failure path then saves that step
    while the room is still there, so logs and samples filling the disk never cost the finished work; and after a
    scheduled save (``saved``), which may itself have taken the room the next step's save would need."""
    needed = _checkpoint_bytes(root)
    if not needed:
        return
    reserve = int(RESERVE * needed)
    free = free_bytes(root)
    if free < reserve:
        raise NoSpaceError(
            f"the disk holding {root} is nearly full: {megabytes(free)} MB free, under the {megabytes(reserve)} MB a "
            f"checkpoint and the final model need; the run stops after step {step} and "
            f"{'keeps its checkpoint' if saved else 'saves it while it can'}. Free "
            f"space (or set checkpoint.dir to another disk), then resume=auto"
        )


def save(
    collector, learner, root: Path, step: int, run_state: dict[str, Any], keep_last: int, stream_states: dict | None = None,
) -> Path:
    """Write the full state of step ``step`` atomically (the `Learner`'s models and state, the `Collector`'s state,
    the RNGs), then prune to the newest ``keep_last``.

    ``stream_states``: the Collector's state ({"prompts", "rewards"}) and optionally "rng" (`collecting_state`), to
    record instead of the live ones, when the schedule has drawn, sampled and scored prompts it has not trained on
    yet (the async and stream schedules). A full disk raises NoSpaceError naming the folder and the room a checkpoint needs; the partial copy
    is removed."""
    root.mkdir(parents=True, exist_ok=True)
    if owner_of(root) != TRAIN_CHECKPOINTS:  # checked before the run: empty, or this command's own
        claim(root, TRAIN_CHECKPOINTS)
    final = root / f"step_{step:08d}"
    for stale in root.glob(".tmp-*"):  # left by a save that crashed (one trainer writes here at a time)
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    try:
        tmp.mkdir()
        _write_state(collector, learner, tmp, step, run_state, stream_states)
        fsync_tree(tmp)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)  # a partial copy would only hold on to the space it took
        lacking = lack_of_room(err, root, "a checkpoint", _checkpoint_bytes(root))
        if lacking is not None:
            raise lacking from err
        raise
    _swap_in(tmp, final, root)
    log.info("checkpoint saved: %s", final)
    _prune(root, step, keep_last)
    return final


def _write_state(collector, learner, tmp: Path, step: int, run_state: dict[str, Any], stream_states: dict | None) -> None:
    """Every file of step ``step``'s checkpoint into the folder ``tmp``; `trainer_state.json` last."""
    learner.save_models(tmp)
    trained = learner.state_dict()
    collected = stream_states or collector.state_dict()
    rng = collected.get("rng") or rng_states()
    torch_rngs = {"torch_rng": rng["torch"], "cuda_rng": rng["cuda"], "shuffle_rng": trained["shuffle"]}
    torch.save(torch_rngs, tmp / "rng.pt")
    record = _RECORDS.get(tmp.parent.resolve())
    if record is not None:
        (tmp / CONFIG_FILE).write_text(record[0], encoding="utf-8")
    state = {
        "step": step,
        "run": run_state,
        "prompts": collected["prompts"],
        "algorithm": trained["algorithm"],
        "rewards": collected["rewards"],
        "rng": _json_rng(rng),
        "files": {str(f.relative_to(tmp)): f.stat().st_size for f in sorted(tmp.rglob("*")) if f.is_file()},
    }
    with open(tmp / STATE_FILE, "w", encoding="utf-8") as f:  # written last: its presence marks completeness
        json.dump(state, f)


def _swap_in(tmp: Path, final: Path, root: Path) -> None:
    """Rename the complete ``tmp`` to ``final``, replacing an earlier save of the same step only after the swap."""
    if final.exists():  # re-saving a step: the old copy moves aside first and is deleted only after the swap
        old = root / f".tmp-replaced-{final.name}-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(root)


def _prune(root: Path, step: int, keep_last: int) -> None:
    """Drop checkpoints newer than ``step`` (an abandoned future), then all but the newest ``keep_last``."""
    for newer in [p for p in complete_checkpoints(root) if int(p.name[5:]) > step]:
        # a run resumed from an older checkpoint has abandoned these; keeping them would make resume=auto jump ahead
        log.warning("removing %s: it belongs to the run that was resumed from an earlier step", newer)
        _remove(newer)
    if keep_last > 0:
        for old in complete_checkpoints(root)[:-keep_last]:
            _remove(old)


def prompt_stream_fits(prompts, saved: dict, path: Path, new_prompts: bool) -> bool:
    """Whether the prompt stream can go on where checkpoint ``path`` left it (``saved``): it draws from the same
    prompts in the same order (size and seed). Otherwise ConfigError, or with ``new_prompts`` a warning and False
    (a fresh stream)."""
    if prompts.draws_as(saved):
        return True
    now = prompts.state_dict()
    differs = f"the checkpoint's prompt stream had {saved['size']} prompts and seed {saved['seed']}, this run's has {now['size']} and seed {now['seed']}"
    if not new_prompts:
        raise ConfigError(
            f"resume from {path}: {differs} (the dataset's files changed?), so resuming would replay or skip prompts; "
            f"restore the data, or set checkpoint.allow_config_change=true to start the prompt stream over"
        )
    log.warning("resume: %s; checkpoint.allow_config_change=true: the prompt stream starts over", differs)
    return False


def _remove(checkpoint: Path) -> None:
    """Delete a checkpoint folder: renamed to a `.tmp-` name first, so a removal cut short never leaves a step folder
    missing some of its files (the next save clears `.tmp-` folders)."""
    doomed = checkpoint.with_name(f".tmp-removing-{checkpoint.name}-{os.getpid()}")
    try:
        os.replace(checkpoint, doomed)
    except OSError as err:  # pruning never fails the save that ran it
        log.warning("could not remove %s (%s); delete it by hand", checkpoint, err)
        return
    shutil.rmtree(doomed, ignore_errors=True)


def load(collector, learner, path: Path, new_prompts: bool = False) -> dict[str, Any]:
    """Restore the `Learner`'s models and state, the `Collector`'s state and every RNG from ``path``; returns the run
    state saved with it. ``new_prompts`` (`checkpoint.allow_config_change`): a prompt stream unlike the
    checkpoint's starts over instead of refusing."""
    state = json.loads((path / STATE_FILE).read_text())
    learner.load_models(path)
    collected = {"rewards": state["rewards"]}
    if prompt_stream_fits(collector.prompts, state["prompts"], path, new_prompts):
        collected["prompts"] = state["prompts"]
    collector.load_state_dict(collected)
    rng = torch.load(path / "rng.pt", weights_only=True)
    learner.load_state_dict({"algorithm": state.get("algorithm", state.get("estimator")), "shuffle": rng["shuffle_rng"]})  # older checkpoints: "estimator"
    torch.set_rng_state(rng["torch_rng"])
    if rng["cuda_rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda_rng"])
    _set_rng_state(state["rng"])
    log.info("resumed from %s (step %d)", path, state["step"])
    return {"step": state["step"], **state["run"]}
