"""Checkpoints: finding complete ones, `resume=`, atomic saves and pruning, the full save/load round trip,
safe deserialisation, and the prompt stream's resumable position."""

from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from rlhf.disk import OWNER_FILE
from rlhf.run import checkpoint
from rlhf.run.checkpoint import STATE_FILE, STATE_KEYS, complete_checkpoints, resume_path
from rlhf.config.schema import CriticConfig, RewardConfig, TrainConfig
from rlhf.errors import ConfigError
from rlhf.data.prompts import PromptExample, PromptStream
from rlhf.algorithms import PolicyGradient, build_algorithm
from algorithm_nodes import algorithm_cfg
from rlhf.training import optim as optim_module
from rlhf.training.critic import TorchCritic
from rlhf.training.policy import TorchPolicy
from rlhf.rewards.combine import RewardSet
from rlhf.rewards.model import RunningMoments
from rlhf.step.collector import Collector
from rlhf.step.learner import Learner

CPU = torch.device("cpu")


# --- helpers ------------------------------------------------------------------------------------------


def make_examples(n: int) -> list[PromptExample]:
    """``n`` distinct prompts whose text is their index."""
    return [PromptExample(text=str(i), token_ids=(i,), ground_truth=i) for i in range(n)]


def texts(batch: list[PromptExample]) -> list[str]:
    """The texts of a batch of prompts, in order."""
    return [example.text for example in batch]


def grpo(**overrides) -> PolicyGradient:
    """A GRPO algorithm on the `algorithm` node composition gives (defaults, then ``overrides``)."""
    return build_algorithm(algorithm_cfg("grpo", **overrides), max_new_tokens=8)


def make_step_dir(root: Path, name: str, complete: bool = True) -> Path:
    """A folder ``root/name``, marked complete (with trainer_state.json) unless told otherwise."""
    folder = root / name
    folder.mkdir(parents=True)
    if complete:  # as `checkpoint.save` leaves it: every key `load` reads, and a readable rng.pt
        (folder / STATE_FILE).write_text(json.dumps({key: {} for key in STATE_KEYS}))
        torch.save({}, folder / "rng.pt")
    return folder


class StubPolicy:
    """Stands in for a trained policy: its whole state is one number, saved as a text file.

    ``during_save`` is called with the destination folder while the save is in progress.
    """

    def __init__(self, value: int = 0, during_save=None) -> None:
        self.value, self.during_save = value, during_save

    def save_checkpoint(self, path: Path) -> None:
        """Write the value to ``path/value.txt``."""
        path.mkdir(parents=True)
        (path / "value.txt").write_text(str(self.value))
        if self.during_save is not None:
            self.during_save(path)

    def load_checkpoint(self, path: Path) -> None:
        """Read the value back."""
        self.value = int((path / "value.txt").read_text())


def stub_components(policy=None, critic=None) -> SimpleNamespace:
    """A Components-like object without model weights (a stub policy), for tests of the checkpoint layout."""
    return SimpleNamespace(
        policy=policy or StubPolicy(),
        critic=critic,
        prompts=PromptStream(make_examples(5), seed=0),
        algorithm=grpo(),
        rewards=RewardSet(OmegaConf.structured(RewardConfig())),
        shuffle=torch.Generator().manual_seed(0),
    )


def parts(c) -> tuple[Collector, Learner]:
    """A real Collector and Learner around a flat stub's pieces (what `checkpoint.save` and `load` take); they share
    the stub's objects, so what the test changes in one it sees in the other."""
    collector = Collector(None, None, c.rewards, c.prompts, None, prompts_per_step=1, samples_per_prompt=1)
    train = OmegaConf.structured(TrainConfig())
    return collector, Learner(c.policy, None, c.critic, c.algorithm, train, CPU, c.shuffle)


def resume_cfg(resume):
    """The only config key `resume_path` reads."""
    return SimpleNamespace(resume=resume)


# --- complete_checkpoints -----------------------------------------------------------------------------


def test_complete_checkpoints_of_a_missing_folder_is_empty(tmp_path):
    """A checkpoint folder that does not exist yet holds no checkpoint."""
    assert complete_checkpoints(tmp_path / "nope") == []


def test_complete_checkpoints_ignores_temporary_partial_and_foreign_folders(tmp_path):
    """Only `step_<8 digits>` folders with trainer_state.json count; temp, partial and other names do not."""
    good = make_step_dir(tmp_path, "step_00000003")
    make_step_dir(tmp_path, ".tmp-step_00000004-123")  # complete-looking, but still temporary
    (tmp_path / ".tmp-step_00000005-123").mkdir()
    make_step_dir(tmp_path, "step_00000006", complete=False)  # a crash before trainer_state.json
    make_step_dir(tmp_path, "step_7")  # wrong number of digits
    make_step_dir(tmp_path, "step_000000080")
    make_step_dir(tmp_path, "step_00000009.bak")
    make_step_dir(tmp_path, "final_model")
    (tmp_path / "step_00000010").write_text("a file, not a folder")
    assert complete_checkpoints(tmp_path) == [good]


def test_complete_checkpoints_sort_by_step_number(tmp_path):
    """Oldest first by step: step 10 comes after step 9 and step 100 after both, whatever the creation order."""
    for step in (100, 9, 10, 1):
        make_step_dir(tmp_path, f"step_{step:08d}")
    assert [p.name for p in complete_checkpoints(tmp_path)] == [
        "step_00000001",
        "step_00000009",
        "step_00000010",
        "step_00000100",
    ]


# --- resume_path --------------------------------------------------------------------------------------


def test_a_fresh_start_where_checkpoints_are_is_refused_and_leaves_them(tmp_path):
    """resume=None in a folder holding complete checkpoints is a config error (its first save would delete them as an
    abandoned future); before, the run started and pruned them. Incomplete folders do not count."""
    make_step_dir(tmp_path, "step_00000003", complete=False)
    assert resume_path(resume_cfg(None), tmp_path) is None
    held = make_step_dir(tmp_path, "step_00000002")
    with pytest.raises(ConfigError, match=r"^resume=null starts a fresh run, but .* holds 1 checkpoint\(s\) of an earlier run "
                                          r"\(the newest step_00000002\).*continue that run with resume=auto"):
        resume_path(resume_cfg(None), tmp_path)
    assert (held / STATE_FILE).is_file()


@pytest.mark.parametrize("create_root", [False, True], ids=["missing", "empty"])
def test_resume_auto_without_checkpoints_starts_fresh_and_says_so(tmp_path, caplog, create_root):
    """resume=auto on a missing or empty folder returns None and logs that the run starts fresh."""
    root = tmp_path / "checkpoints"
    if create_root:
        root.mkdir()
    with caplog.at_level(logging.INFO, logger="rlhf"):
        assert resume_path(resume_cfg("auto"), root) is None
    assert "starting fresh" in caplog.text


def test_resume_auto_skips_partial_checkpoints(tmp_path):
    """resume=auto on a folder with only partial and temporary checkpoints starts fresh."""
    make_step_dir(tmp_path, "step_00000002", complete=False)
    make_step_dir(tmp_path, ".tmp-step_00000003-1")
    assert resume_path(resume_cfg("auto"), tmp_path) is None


def test_resume_auto_picks_the_newest_complete_checkpoint(tmp_path):
    """resume=auto returns the highest complete step, skipping a newer partial one."""
    make_step_dir(tmp_path, "step_00000009")
    newest = make_step_dir(tmp_path, "step_00000010")
    make_step_dir(tmp_path, "step_00000011", complete=False)
    assert resume_path(resume_cfg("auto"), tmp_path) == newest


def test_resume_given_complete_folder_is_returned(tmp_path):
    """resume=<complete checkpoint folder> returns that folder, even when a newer one exists."""
    older = make_step_dir(tmp_path, "step_00000004")
    make_step_dir(tmp_path, "step_00000008")
    assert resume_path(resume_cfg(str(older)), tmp_path / "elsewhere") == older


@pytest.mark.parametrize("which", ["partial", "root", "missing"])
def test_resume_given_incomplete_folder_is_a_config_error(tmp_path, which):
    """resume=<folder without trainer_state.json> (partial, the checkpoint root, or absent) names `resume=`."""
    make_step_dir(tmp_path, "step_00000001")
    target = {
        "partial": make_step_dir(tmp_path, "step_00000002", complete=False),
        "root": tmp_path,
        "missing": tmp_path / "step_00000099",
    }[which]
    with pytest.raises(ConfigError, match="resume=") as err:
        resume_path(resume_cfg(str(target)), tmp_path)
    assert str(target) in str(err.value) and STATE_FILE in str(err.value)


# --- save: atomicity, replacement, pruning ------------------------------------------------------------


def test_save_writes_a_complete_folder_and_no_leftovers(tmp_path):
    """After a save only `step_<8 digits>` exists (and the root's owner mark), with trainer_state.json, the policy and
    rng.pt inside."""
    final = checkpoint.save(*parts(stub_components(StubPolicy(7))), tmp_path, 12, {"run_id": "abc"}, keep_last=0)
    assert final == tmp_path / "step_00000012"
    assert sorted(p.name for p in tmp_path.iterdir()) == [OWNER_FILE, "step_00000012"]
    assert sorted(p.name for p in final.iterdir()) == ["policy", "rng.pt", STATE_FILE]
    state = json.loads((final / STATE_FILE).read_text())
    assert state["step"] == 12 and state["run"] == {"run_id": "abc"}
    assert list(tmp_path.rglob(STATE_FILE)) == [final / STATE_FILE]


def test_save_in_progress_is_invisible(tmp_path):
    """While components are being written, neither the final folder nor any trainer_state.json exists."""
    seen = {}

    def during_save(path: Path) -> None:
        """Record what a concurrent reader would see mid-save."""
        seen["tmp_name"] = path.parent.name
        seen["final_exists"] = (tmp_path / "step_00000003").exists()
        seen["state_files"] = list(tmp_path.rglob(STATE_FILE))
        seen["complete"] = complete_checkpoints(tmp_path)

    checkpoint.save(*parts(stub_components(StubPolicy(during_save=during_save))), tmp_path, 3, {}, keep_last=0)
    assert seen["tmp_name"].startswith(".tmp-step_00000003")
    assert seen["final_exists"] is False and seen["state_files"] == [] and seen["complete"] == []


def test_crash_during_save_leaves_previous_checkpoint_as_the_newest(tmp_path):
    """A save that fails half-way leaves no complete step folder; resume=auto still finds the previous one."""
    previous = checkpoint.save(*parts(stub_components()), tmp_path, 1, {}, keep_last=0)

    def crash(path: Path) -> None:
        """Die in the middle of writing the checkpoint."""
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        checkpoint.save(*parts(stub_components(StubPolicy(during_save=crash))), tmp_path, 2, {}, keep_last=0)
    assert not (tmp_path / "step_00000002").exists()
    assert complete_checkpoints(tmp_path) == [previous]
    assert resume_path(resume_cfg("auto"), tmp_path) == previous


def test_save_replaces_a_stale_temporary_folder_of_the_same_step(tmp_path):
    """A leftover temporary folder (same step, same process) is discarded, not merged into the checkpoint."""
    stale = tmp_path / f".tmp-step_00000005-{os.getpid()}"
    (stale / "policy").mkdir(parents=True)
    (stale / "policy" / "stale.txt").write_text("old")
    (stale / "junk.bin").write_bytes(b"x")
    final = checkpoint.save(*parts(stub_components(StubPolicy(5))), tmp_path, 5, {}, keep_last=0)
    assert not stale.exists()
    assert not (final / "junk.bin").exists() and not (final / "policy" / "stale.txt").exists()
    assert (final / "policy" / "value.txt").read_text() == "5"


def test_saving_twice_at_the_same_step_replaces_the_folder(tmp_path):
    """A second save of the same step replaces the first one's contents entirely."""
    first = checkpoint.save(*parts(stub_components(StubPolicy(1))), tmp_path, 4, {"n": 1}, keep_last=0)
    (first / "extra.txt").write_text("from the first save")
    second = checkpoint.save(*parts(stub_components(StubPolicy(2))), tmp_path, 4, {"n": 2}, keep_last=0)
    assert second == first
    assert not (second / "extra.txt").exists()
    assert (second / "policy" / "value.txt").read_text() == "2"
    assert json.loads((second / STATE_FILE).read_text())["run"] == {"n": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == [OWNER_FILE, "step_00000004"]


def test_keep_last_prunes_the_oldest(tmp_path):
    """keep_last=2 keeps the two highest steps (numerically: 10 beats 9); keep_last=0 keeps all."""
    for step in (8, 9, 10):
        checkpoint.save(*parts(stub_components()), tmp_path, step, {}, keep_last=2)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000009", "step_00000010"]
    checkpoint.save(*parts(stub_components()), tmp_path, 11, {}, keep_last=0)
    assert len(complete_checkpoints(tmp_path)) == 3


def test_keep_last_leaves_partial_and_temporary_folders_alone(tmp_path):
    """Pruning only removes complete checkpoints; anything else under the root is not its business."""
    partial = make_step_dir(tmp_path, "step_00000001", complete=False)
    other = tmp_path / "notes.txt"
    other.write_text("mine")
    for step in (2, 3):
        checkpoint.save(*parts(stub_components()), tmp_path, step, {}, keep_last=1)
    assert partial.exists() and other.exists()
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000003"]



def test_save_never_prunes_the_checkpoint_it_just_wrote(tmp_path):
    """Saving a lower step than an existing one (after resuming from an older folder) keeps the new checkpoint."""
    checkpoint.save(*parts(stub_components()), tmp_path, 10, {}, keep_last=1)
    final = checkpoint.save(*parts(stub_components()), tmp_path, 5, {}, keep_last=1)
    assert final.is_dir() and (final / STATE_FILE).is_file()
    assert checkpoint.complete_checkpoints(tmp_path) == [final], "the abandoned later checkpoint is removed"

# --- load: critic presence ----------------------------------------------------------------------------


def test_load_without_critic_state_when_the_run_has_a_critic_is_a_config_error(tmp_path):
    """Resuming a critic run from a checkpoint saved without a critic fails clearly."""
    saved = checkpoint.save(*parts(stub_components()), tmp_path, 1, {}, keep_last=0)
    with pytest.raises(ConfigError, match="no critic state"):
        checkpoint.load(*parts(stub_components(critic=StubPolicy())), saved)


def test_load_restores_the_stub_state_and_returns_step_and_run_state(tmp_path):
    """`load` returns {'step': ..., **run_state} and restores the policy's state."""
    saved = checkpoint.save(*parts(stub_components(StubPolicy(42))), tmp_path, 6, {"run_id": "r1", "skipped_total": 2}, keep_last=0)
    c = stub_components(StubPolicy(0))
    assert checkpoint.load(*parts(c), saved) == {"step": 6, "run_id": "r1", "skipped_total": 2}
    assert c.policy.value == 42


# --- full round trip with real models -----------------------------------------------------------------


def train_step(model_owner, loss_fn) -> None:
    """One backward + optimizer step of a TorchPolicy or TorchCritic on ``loss_fn(owner)``."""
    model_owner.backward(loss_fn(model_owner))
    model_owner.optimizer_step()


def policy_loss(policy, rollout):
    """A loss raising the likelihood of the rollout's responses."""
    logp, _ = policy.logprobs(rollout)
    return -(logp * rollout.loss_mask).sum()


def critic_loss(critic, rollout):
    """A loss pulling every value towards 1."""
    return (((critic.values(rollout) - 1.0) ** 2) * rollout.loss_mask).sum()


def snapshot(owner) -> dict:
    """Weights, AdamW moments, scheduler position and LR of a TorchPolicy/TorchCritic, cloned."""
    params = [p for p in owner.model.parameters() if p.requires_grad]
    return {
        "weights": {k: v.detach().clone() for k, v in owner.model.state_dict().items()},
        "exp_avg": [owner.optimizer.state[p]["exp_avg"].clone() for p in params],
        "exp_avg_sq": [owner.optimizer.state[p]["exp_avg_sq"].clone() for p in params],
        "adam_step": [float(owner.optimizer.state[p]["step"]) for p in params],
        "last_epoch": owner.scheduler.last_epoch,
        "lr": owner.optimizer.param_groups[0]["lr"],
    }


def assert_same_snapshot(actual: dict, expected: dict) -> None:
    """Every tensor equal, every number equal."""
    assert actual["weights"].keys() == expected["weights"].keys()
    for key, value in expected["weights"].items():
        assert torch.equal(actual["weights"][key], value), key
    for name in ("exp_avg", "exp_avg_sq"):
        assert len(actual[name]) == len(expected[name])
        assert all(torch.equal(a, e) for a, e in zip(actual[name], expected[name])), name
    assert actual["adam_step"] == expected["adam_step"]
    assert actual["last_epoch"] == expected["last_epoch"]
    assert actual["lr"] == expected["lr"]


def draws(c) -> dict:
    """The next values of every random source and the prompt stream (consumes them)."""
    return {
        "python": random.random(),
        "numpy": np.random.rand(3).tolist(),
        "torch": torch.rand(3).tolist(),
        "shuffle": torch.randperm(10, generator=c.shuffle).tolist(),
        "prompts": texts(c.prompts.next_batch(4)),
    }


@pytest.fixture
def components(policy_cfg, model_cfg, train_cfg, tiny_model_dir, rollout):
    """Components with a real policy and critic (each trained one step), GRPO with adaptive KL, a reward
    set whose model carries running moments, a prompt stream part-way into its first epoch, and a shuffle RNG."""
    train = train_cfg(lr=1e-2, lr_schedule="linear")
    policy = TorchPolicy(policy_cfg, model_cfg, train, total_optimizer_steps=10, device=CPU)
    critic = TorchCritic(OmegaConf.structured(CriticConfig()), model_cfg, tiny_model_dir, train, total_optimizer_steps=10, device=CPU)
    train_step(policy, lambda p: policy_loss(p, rollout))
    train_step(critic, lambda v: critic_loss(v, rollout))
    rewards = RewardSet(OmegaConf.structured(RewardConfig()))
    rewards.model = SimpleNamespace(moments=RunningMoments())  # only its moments are checkpointed
    rewards.model.moments.update(torch.tensor([1.0, 2.0, 4.0]))
    algorithm = grpo(beta=0.1, kl_ctl="adaptive", target=1.0, horizon=10)
    algorithm.kl_ctl.update(5.0, 4)
    c = SimpleNamespace(
        policy=policy,
        critic=critic,
        prompts=PromptStream(make_examples(7), seed=5),
        algorithm=algorithm,
        rewards=rewards,
        shuffle=torch.Generator().manual_seed(3),
    )
    c.prompts.next_batch(3)
    torch.randperm(10, generator=c.shuffle)
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    return c


def test_save_load_round_trip_restores_everything(components, rollout, tmp_path):
    """Mutating every component after a save and then loading brings back weights, optimiser moments,
    scheduler position, prompt position, KL coefficient, reward moments and every RNG stream."""
    c = components
    saved = checkpoint.save(*parts(c), tmp_path, 7, {"run_id": "xyz", "first_eval": {"eval/a": 0.5}}, keep_last=0)
    expected = {
        "policy": snapshot(c.policy),
        "critic": snapshot(c.critic),
        "prompts": c.prompts.state_dict(),
        "kl_coef": c.algorithm.kl_ctl.value,
        "moments": c.rewards.model.moments.state_dict(),
    }
    expected_draws = draws(c)

    # move everything on
    train_step(c.policy, lambda p: policy_loss(p, rollout))
    train_step(c.critic, lambda v: critic_loss(v, rollout))
    c.prompts.next_batch(9)  # into the next epoch
    c.algorithm.kl_ctl.update(0.0, 4)
    c.rewards.model.moments.update(torch.tensor([-3.0, 9.0]))
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    c.shuffle.manual_seed(99)
    assert c.algorithm.kl_ctl.value != expected["kl_coef"]
    assert c.prompts.state_dict() != expected["prompts"]
    assert c.policy.scheduler.last_epoch != expected["policy"]["last_epoch"]

    run = checkpoint.load(*parts(c), saved)

    assert run == {"step": 7, "run_id": "xyz", "first_eval": {"eval/a": 0.5}}
    assert_same_snapshot(snapshot(c.policy), expected["policy"])
    assert_same_snapshot(snapshot(c.critic), expected["critic"])
    assert c.prompts.state_dict() == expected["prompts"]
    assert c.algorithm.kl_ctl.value == expected["kl_coef"]
    assert c.rewards.model.moments.state_dict() == expected["moments"]
    assert draws(c) == expected_draws


def test_loaded_policy_keeps_training_like_the_uninterrupted_one(components, rollout, tmp_path):
    """A step after load gives exactly the weights the uninterrupted run reaches with the same step."""
    c = components
    saved = checkpoint.save(*parts(c), tmp_path, 1, {}, keep_last=0)
    train_step(c.policy, lambda p: policy_loss(p, rollout))
    uninterrupted = {k: v.clone() for k, v in c.policy.state_dict().items()}
    train_step(c.policy, lambda p: policy_loss(p, rollout))  # diverge further
    checkpoint.load(*parts(c), saved)
    train_step(c.policy, lambda p: policy_loss(p, rollout))
    for key, value in uninterrupted.items():
        assert torch.equal(c.policy.state_dict()[key], value), key


def test_reward_set_without_model_saves_empty_state_and_ignores_moments_on_load():
    """A RewardSet without a model has empty state; loading moments into it is a no-op, not an error."""
    rewards = RewardSet(OmegaConf.structured(RewardConfig()))
    assert rewards.state_dict() == {}
    rewards.load_state_dict({"model_moments": {"count": 3, "mean": 1.0, "var": 2.0}})
    assert rewards.model is None


# --- safe deserialisation -----------------------------------------------------------------------------


def test_weights_are_safetensors_and_torch_files_load_with_weights_only(components, tmp_path, monkeypatch):
    """Model weights are safetensors (no pickles); every torch.load during `load` passes weights_only=True."""
    c = components
    saved = checkpoint.save(*parts(c), tmp_path, 2, {}, keep_last=0)
    for role in ("policy", "critic"):
        model_files = sorted(p.name for p in (saved / role / "model").iterdir())
        assert any(name.endswith(".safetensors") for name in model_files), model_files
        assert not any(name.endswith((".bin", ".pt", ".pth", ".pkl")) for name in model_files), model_files

    calls = []
    real_load = torch.load

    def recording_load(*args, **kwargs):
        """torch.load, recording the file name and the weights_only flag."""
        calls.append((Path(args[0]).name, kwargs.get("weights_only")))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", recording_load)
    safetensors_reads = []
    real_load_file = optim_module.load_file
    monkeypatch.setattr(optim_module, "load_file", lambda *a, **k: safetensors_reads.append(a[0]) or real_load_file(*a, **k))
    checkpoint.load(*parts(c), saved)
    assert sorted(calls) == [("optim.pt", True), ("optim.pt", True), ("rng.pt", True)]
    assert len(safetensors_reads) == 2  # one shard each for the policy and the critic


# --- PromptStream state -------------------------------------------------------------------------------


def continue_from(state: dict, n_examples: int, seed: int, sizes: list[int]) -> list[list[str]]:
    """Batches of a fresh stream restored from ``state``."""
    stream = PromptStream(make_examples(n_examples), seed=seed)
    stream.load_state_dict(json.loads(json.dumps(state)))  # through JSON, as in a checkpoint
    return [texts(stream.next_batch(size)) for size in sizes]


@pytest.mark.parametrize(
    "consumed",
    [[3], [3, 4], [7], [7, 7], [5, 6]],
    ids=["mid-first-epoch", "end-of-first-epoch", "exact-epoch", "exact-second-epoch", "mid-second-epoch"],
)
def test_prompt_stream_resumes_the_same_sequence(consumed):
    """Restoring the state (mid-epoch or exactly at an epoch boundary) continues as an uninterrupted stream."""
    sizes = [4, 5, 7, 2]
    stream = PromptStream(make_examples(7), seed=2)
    for size in consumed:
        stream.next_batch(size)
    state = stream.state_dict()
    uninterrupted = [texts(stream.next_batch(size)) for size in sizes]
    assert continue_from(state, 7, 2, sizes) == uninterrupted


def test_prompt_stream_state_at_the_boundary_keeps_the_epoch_count():
    """Exactly at an epoch's end the state says position == size in the same epoch; the next draw starts a new one."""
    stream = PromptStream(make_examples(6), seed=0)
    stream.next_batch(6)
    assert stream.state_dict() == {"seed": 0, "epoch": 0, "position": 6, "size": 6}
    restored = PromptStream(make_examples(6), seed=0)
    restored.load_state_dict(stream.state_dict())
    assert restored.epochs_done == stream.epochs_done == 1.0
    assert texts(restored.next_batch(2)) == texts(stream.next_batch(2))
    assert restored.epoch == 1


@pytest.mark.parametrize("size, seed", [(8, 2), (7, 3)], ids=["other-size", "other-seed"])
def test_prompt_stream_rejects_state_of_another_dataset_or_seed(size, seed):
    """Loading a state saved with a different number of prompts or seed raises ValueError."""
    state = PromptStream(make_examples(7), seed=2).state_dict()
    stream = PromptStream(make_examples(size), seed=seed)
    with pytest.raises(ValueError, match="replay or skip"):
        stream.load_state_dict(state)
