"""First contact without tracebacks: a hub model, tokenizer or dataset this machine cannot get is one paragraph and
exit 2 (`rlhf.checks.hub`), naming the key, the name, why (offline, unreachable, no such repository, gated, no such
revision) and the fix; a name in the local cache still trains offline. The hub is never contacted: each test points
`huggingface_hub` at an empty cache and at an offline switch, a closed port, or a fake hub on 127.0.0.1."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import datasets.config
import pytest
from datasets.load import CachedDatasetModuleFactory
from huggingface_hub import constants, scan_cache_dir, snapshot_download, try_to_load_from_cache

import rlhf.train_reward
from rlhf import exits
from rlhf.checks import hub
from rlhf.config import ConfigError, compose_config
from rlhf.models.loading import resolve_model_path
from rlhf.train import train

TULU = "allenai/Llama-3.1-Tulu-3-8B-SFT"
SMALL = ["train.prompts_per_step=4", "algorithm.num_samples_per_prompt=2", "eval.num_samples=0", "eval.greedy=false",
         "logging.tensorboard=false", "checkpoint.save_final_model=false"]
COMMIT = "0123456789abcdef0123456789abcdef01234567"
# the fake hub's answers to HEAD <path>: (status, X-Error-Code); any other path is a repository it does not have
ANSWERS = {
    "/org/model/resolve/main/config.json": (200, None),
    "/org/model/resolve/v9/config.json": (404, "RevisionNotFound"),
    "/org/gated/resolve/main/config.json": (401, "GatedRepo"),
    "/org/gguf/resolve/main/config.json": (404, "EntryNotFound"),
    "/org/model/resolve/main/tokenizer_config.json": (404, "EntryNotFound"),  # a repo without one still answers
    "/org/down/resolve/main/config.json": (503, None),
    "/datasets/org/prompts/resolve/main/README.md": (200, None),
}


@pytest.fixture
def empty_cache(tmp_path, monkeypatch) -> Path:
    """Both Hugging Face caches (hub files, prepared datasets) point at empty folders under ``tmp_path``."""
    root = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(root))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", root / "datasets")
    return root


def set_offline(monkeypatch, offline: bool) -> None:
    """HF_HUB_OFFLINE as huggingface_hub, transformers and datasets read it (at import, so patched here)."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", offline)


@pytest.fixture
def offline(empty_cache, monkeypatch):
    set_offline(monkeypatch, True)


class FakeHub(BaseHTTPRequestHandler):
    def do_HEAD(self):  # noqa: N802 -- the http.server name
        status, code = ANSWERS.get(self.path.split("?")[0], (404, "RepoNotFound"))
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def use_endpoint(monkeypatch, endpoint: str) -> None:
    """What HF_ENDPOINT=<endpoint> sets when huggingface_hub is imported."""
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")


@pytest.fixture
def fake_hub(empty_cache, monkeypatch):
    """An online machine whose hub is a server on 127.0.0.1 answering from ANSWERS."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    set_offline(monkeypatch, False)
    use_endpoint(monkeypatch, f"http://127.0.0.1:{server.server_address[1]}")
    yield
    server.shutdown()
    server.server_close()


def closed_port() -> int:
    """A loopback port nothing listens on (connection refused at once, like a failed DNS lookup)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def config_error(overrides: list[str], out: Path) -> str:
    """The ConfigError `rlhf.train.train` raises for ``overrides``, as one line."""
    with pytest.raises(ConfigError) as caught:
        train(compose_config([*SMALL, *overrides]), out)
    message = str(caught.value)
    assert "\n" not in message
    return message


# --- the real CLI --------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("network", ["HF_HUB_OFFLINE=1", "refused"])
def test_tulu8b_without_weights_or_hub_is_one_paragraph_and_exit_2(tmp_path, network):
    """The README's Tulu 3 model on a machine that has neither its weights nor the hub: exit 2 in seconds, no
    traceback, no retries; the key, the name, why and the fix. `refused`: hub requests fail as on a cut network."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT")}
    env |= {"HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_CACHE": str(tmp_path / "hf_home" / "hub")}
    if network == "HF_HUB_OFFLINE=1":
        env["HF_HUB_OFFLINE"] = "1"
    else:  # a closed loopback port: the same failure as no route or no DNS, and never a real download elsewhere
        env["HF_ENDPOINT"] = f"http://127.0.0.1:{closed_port()}"
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf.train", "algorithm=ppo", "model=tulu8b", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == exits.CONFIG_ERROR, output[-3000:]
    assert len(output.strip().splitlines()) < 15, output
    assert "Traceback" not in output and "Retrying" not in output
    assert f"config error: model.name_or_path={TULU} is neither a local folder nor in the local Hugging Face cache" in output
    assert f"`hf download {TULU}`" in output and f"set model.name_or_path=DIR" in output
    assert ("HF_HUB_OFFLINE=1 keeps the hub out of reach" if network == "HF_HUB_OFFLINE=1" else "the hub is unreachable (") in output


# --- every key that names a hub source -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "key", "name"),
    [
        (["model.tokenizer=org/tokenizer"], "model.tokenizer", "org/tokenizer"),
        (["reward=model", "reward.path=org/reward-model"], "reward.path", "org/reward-model"),
        (["reference.name_or_path=org/reference"], "reference.name_or_path", "org/reference"),
        (["algorithm=ppo", "critic.name_or_path=org/critic"], "critic.name_or_path", "org/critic"),
        (["dataset=gsm8k", "reward=math"], "dataset.train[0].path", "openai/gsm8k"),
        (["dataset=tldr"], "dataset.train[0].path", "trl-internal-testing/tldr-preference-sft-trl-style"),
        (["dataset=jsonl", "dataset.path=org/prompts"], "dataset.path", "org/prompts"),
    ],
)
def test_each_hub_key_offline_is_a_config_error_naming_it(overrides, key, name, offline, tmp_path):
    """Offline with an empty cache: `train` stops before any model loads, naming the key, the name and a fix."""
    message = config_error(overrides, tmp_path / "run")
    assert message.startswith(f"{key}={name} is neither a local ")
    assert "nor in the local Hugging Face cache" in message and "HF_HUB_OFFLINE=1 keeps the hub out of reach" in message
    assert f"hf download {name}" in message and f"set {key}=DIR" in message
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_an_unreachable_hub_is_named_with_its_reason(empty_cache, monkeypatch, tmp_path):
    """Online, but the hub's address refuses: the reason is quoted, and there are no retries."""
    set_offline(monkeypatch, False)
    use_endpoint(monkeypatch, f"http://127.0.0.1:{closed_port()}")
    message = config_error(["reference.name_or_path=org/reference"], tmp_path / "run")
    assert message.startswith("reference.name_or_path=org/reference is neither a local folder nor in the local ")
    assert "and the hub is unreachable (" in message


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["model.name_or_path=org/missing-model"],
         "model.name_or_path=org/missing-model is not a local folder, and the hub has no model repository of that name "
         "(or it is private: log in with `hf auth login` or set HF_TOKEN)"),
        (["model.name_or_path=org/gated"], "model.name_or_path=org/gated: the hub repository is gated"),
        (["model.name_or_path=org/model", "model.revision=v9"],
         "model.name_or_path=org/model: the hub has no revision 'v9' of it (model.revision)"),
        (["model.name_or_path=org/gguf"], "model.name_or_path=org/gguf: the hub repository has no config.json"),
        (["model.name_or_path=org/down"], "and the hub answered HTTP 503"),
        (["dataset=gsm8k", "reward=math"], "dataset.train[0].path=openai/gsm8k is not a local file or folder, and the "
                                           "hub has no dataset repository of that name"),
    ],
)
def test_the_hubs_answer_is_named(overrides, expected, fake_hub, tmp_path):
    """The hub answers no: the paragraph says which no (missing or private, gated, revision, not a model, down)."""
    assert expected in config_error(overrides, tmp_path / "run")


def test_sources_the_hub_answers_for_pass(fake_hub):
    """A model the hub has (its tokenizer repo without tokenizer_config.json too) and a hub dataset: no error."""
    hub.check_sources(compose_config(["model.name_or_path=org/model", "model.tokenizer=org/model"]))
    hub.check_sources(compose_config(["dataset=jsonl", "dataset.path=org/prompts"]))


def test_local_and_builtin_sources_are_not_hub_names(offline, tmp_path):
    """builtin:, local folders (missing ones too: `check_model_sources` names them) and local files never reach the
    hub check, so nothing changes for them offline."""
    cfg = compose_config([
        "model.tokenizer=./no_such_folder", f"reference.name_or_path={tmp_path}", "dataset=jsonl",
        "dataset.path=prompts.jsonl",
    ])
    assert hub.model_sources(cfg) == [] and hub.dataset_sources(cfg) == []
    hub.check_sources(cfg)


def test_a_name_that_is_no_hub_name_says_so(offline, tmp_path):
    message = config_error(["model.name_or_path=models/run/final_model"], tmp_path / "run")
    assert message.startswith("model.name_or_path=models/run/final_model is neither a local folder (relative to ")
    assert "nor a valid hub name (org/name)" in message


# --- the cache -----------------------------------------------------------------------------------------------------


def cache_model(cache: Path, repo_id: str, folder: Path) -> Path:
    """Put ``folder``'s files into a hub cache as `hf download` leaves them: blobs named by hash, a snapshot of
    relative symlinks to them, refs/main naming the snapshot's commit. Returns the snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in sorted(p for p in folder.iterdir() if p.is_file()):
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def test_a_cached_model_trains_offline(offline, empty_cache, tmp_path):
    """The built-in tiny model cached as org/tiny-arith (a layout huggingface_hub's own functions read back): the
    check passes offline, and a run trains from the cache with no hub."""
    cache = Path(constants.HF_HUB_CACHE)
    snapshot = cache_model(cache, "org/tiny-arith", Path(resolve_model_path("builtin:tiny_arith")))
    [repo] = scan_cache_dir(cache).repos
    assert (repo.repo_id, repo.repo_type, [r.commit_hash for r in repo.revisions]) == ("org/tiny-arith", "model", [COMMIT])
    assert snapshot_download("org/tiny-arith", local_files_only=True) == str(snapshot)
    assert try_to_load_from_cache("org/tiny-arith", "config.json") == str(snapshot / "config.json")
    cfg = compose_config([*SMALL, "model.name_or_path=org/tiny-arith", "model.tokenizer=org/tiny-arith", "train.num_steps=1"])
    hub.check_sources(cfg)
    state = train(cfg, tmp_path / "run")
    assert state.step == 1


def test_a_prepared_dataset_in_the_datasets_cache_passes_offline(offline, empty_cache):
    """A hub dataset `datasets` prepared before (the folders its own offline fallback looks for) is accepted."""
    prepared = Path(datasets.config.HF_DATASETS_CACHE) / "openai___gsm8k" / "main" / "0.0.0" / "abc123"
    prepared.mkdir(parents=True)
    CachedDatasetModuleFactory("openai/gsm8k", cache_dir=str(datasets.config.HF_DATASETS_CACHE)).get_module()
    hub.check_sources(compose_config(["dataset=gsm8k", "reward=math"]))


# --- reward-model training -----------------------------------------------------------------------------------------


def test_train_reward_refuses_a_missing_hub_model_with_exit_2(offline, tmp_path, monkeypatch, capsys):
    """`python -m rlhf.train_reward model.name_or_path=org/missing-model` (in-process): the same paragraph, exit 2."""
    monkeypatch.setattr(sys, "argv", [
        "rlhf.train_reward", "model.name_or_path=org/missing-model", f"hydra.run.dir={tmp_path / 'run'}",
        "hydra.job.name=train_reward",
    ])
    with pytest.raises(SystemExit) as exited:
        rlhf.train_reward.main()
    assert exited.value.code == exits.CONFIG_ERROR
    console = capsys.readouterr()
    output = console.out + console.err
    assert "config error: model.name_or_path=org/missing-model is neither a local folder nor in the local" in output
    assert "hf download org/missing-model" in output and "Traceback" not in output


@pytest.mark.parametrize(("override", "message"), [
    ("train.lr=1e38", "train.lr=1e+38 must be in (0, 1]"),  # AdamW's first step would overflow float32 mid-step
    ("seed=-1", "seed=-1 must be in [0, 4294901760)"),  # numpy's ValueError, after the tokenizer and data loaded
    ("train.eval_every=0", "train.eval_every=0 must be >= 1"),  # read from the typed config (`typed`)
    ("model.dtype=bfloat16", "model.dtype=bfloat16: reward-model training keeps float32 weights; set model.dtype=float32"),
    ("+output_dir=/tmp/rm", "output_dir is not a config key (added with +?); this project calls it hydra.run.dir"),  # trained before
    ("output_dir=/tmp/rm", "output_dir is not a config key; this project calls it hydra.run.dir"),  # Hydra's "+" advice before
    ("train.lrr=0.1", "train.lrr is not a config key; did you mean train.lr?"),  # Hydra's "+" advice before
])
def test_train_reward_refuses_a_bad_value_or_key_before_any_model_loads(override, message, tmp_path, monkeypatch, capsys):
    """`python -m rlhf.train_reward <override>`: exit 2 naming the key and the fix."""
    monkeypatch.setattr(sys, "argv", [
        "rlhf.train_reward", override, f"hydra.run.dir={tmp_path / 'run'}", "hydra.job.name=train_reward",
    ])
    with pytest.raises(SystemExit) as exited:
        rlhf.train_reward.main()
    assert exited.value.code == exits.CONFIG_ERROR
    output = "".join(capsys.readouterr())
    assert f"config error: {message}" in output and "Traceback" not in output
