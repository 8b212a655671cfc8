"""A remote teacher (`teacher.url`) that misbehaves, served by a real HTTP server on 127.0.0.1: its answers are
checked (a logprob above 0, or below a floor, stops the step naming teacher.url), `teacher.timeout_s` bounds each
request as a whole (a server that trickles its answer or never answers is reported as timing out), and a URL without
a scheme is refused before any model loads."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from omegaconf import OmegaConf
from slow_replies import drip_forever, error_within

from rlhf.config import ConfigError, compose_config, validate
from rlhf.config.schema import TeacherConfig
from rlhf.models.remote_teacher import RemoteTeacher, RemoteTeacherError


class Teacher(BaseHTTPRequestHandler):
    """Answers every prompt token with the logprob ``server.logprob``; or, with ``server.drip``, sends its headers and
    then a byte every 0.2 s; or, with ``server.silent``, never answers (until the test ends)."""

    def do_POST(self) -> None:
        ids = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompt"]
        server = self.server
        if server.silent:
            server.stop.wait()
            return
        body = json.dumps({"choices": [{"prompt_logprobs": [None] + [{str(t): {"logprob": server.logprob}} for t in ids[1:]]}]}).encode()
        if server.drip:
            drip_forever(self, body, server.stop)
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def server():
    """The misbehaving teacher on an ephemeral port; ``server.url`` is its base URL (…/v1)."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Teacher)
    httpd.logprob, httpd.drip, httpd.silent, httpd.stop = -0.5, False, False, threading.Event()
    httpd.daemon_threads = True
    httpd.url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True).start()
    yield httpd
    httpd.stop.set()
    httpd.shutdown()
    httpd.server_close()


def teacher(url: str, timeout_s: float = 30.0) -> RemoteTeacher:
    return RemoteTeacher(OmegaConf.structured(TeacherConfig(name_or_path="t", url=url, timeout_s=timeout_s, max_concurrency=2)))


def test_a_sane_answer_is_read(server, rollout):
    got = teacher(server.url).rollout_logprobs(rollout)
    assert (got[rollout.loss_mask.bool()] == -0.5).all() and (got[~rollout.loss_mask.bool()] == 0).all()


@pytest.mark.parametrize("logprob", [50.0, -1e30])
def test_a_logprob_that_is_no_log_probability_stops_the_step(server, rollout, logprob):
    """+50 was trained on silently; -1e30 made every optimiser step non-finite and skipped (exit 0)."""
    server.logprob = logprob
    with pytest.raises(RemoteTeacherError, match=rf"teacher.url={server.url}/completions: row \d, token \d+ \(id \d+\): "
                       rf"logprob {re.escape(f'{logprob:g}')} is not a log probability \(it must lie in \[-10000, 0\]\)"):
        teacher(server.url).rollout_logprobs(rollout)


def test_a_rounding_above_zero_is_read_as_zero(server, rollout):
    server.logprob = 3e-7
    assert (teacher(server.url).rollout_logprobs(rollout) == 0).all()


@pytest.mark.parametrize("how", ["drip", "silent"])
def test_a_teacher_that_trickles_or_never_answers_times_out_at_the_whole_request(server, rollout, how):
    """Each byte comes well inside a per-read timeout, so only a deadline on the whole request ends it (before, a
    trickling server hung the run); a silent one is reported as timing out, not as unreachable."""
    setattr(server, how, True)
    err = error_within(lambda: teacher(server.url, timeout_s=1.0).rollout_logprobs(rollout), RemoteTeacherError, server.stop)
    assert err is not None and f"teacher.url={server.url}/completions did not answer row" in str(err)
    assert "within teacher.timeout_s=1 s" in str(err) and "unreachable" not in str(err)


@pytest.mark.parametrize("url", ["127.0.0.1:8000/v1", "localhost:8000/v1", "ftp://host/v1"])
def test_a_url_without_an_http_scheme_is_a_config_error(url):
    cfg = compose_config(["algorithm=opd", "teacher.name_or_path=builtin:tiny_arith", f"teacher.url={url}"])
    with pytest.raises(ConfigError, match=rf"^teacher.url='{url}' is not an http\(s\) URL with a host; .*teacher.url=http://"):
        validate(cfg)
