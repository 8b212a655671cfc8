"""remote: the JSON wire format, retries and errors, against a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from slow_replies import Replies, drip_forever, error_within

from rlhf.errors import ConfigError
from rlhf.rewards.remote import RemoteRewardError, remote

FAST = {"timeout_s": 2.0, "backoff_s": 0.01}  # retries in milliseconds, so the tests stay fast


class Scorer(Replies):
    """Scores each row by its response's length; can fail ``failures_left`` times first, or reply ``raw``."""

    def do_POST(self) -> None:
        server = self.server
        server.requests.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        if server.failures_left > 0:
            server.failures_left -= 1
            self.reply(503, b"busy")
            return
        rows = server.requests[-1]["rows"]
        scores = [len(row["response"]) for row in rows]
        body = server.raw if server.raw is not None else json.dumps({"scores": scores})
        self.reply(200, body.encode() if isinstance(body, str) else body)



@pytest.fixture
def server():
    """A scoring server on an ephemeral port, served from a thread; ``server.url`` is its address."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Scorer)
    httpd.requests, httpd.failures_left, httpd.raw = [], 0, None
    httpd.url = f"http://127.0.0.1:{httpd.server_address[1]}/score"
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def call(url: str, responses=("a", "bbb"), **args) -> list[float]:
    """remote's scores for ``responses`` (prompts "p0", "p1", ...; ground truths 0, 1, ...)."""
    prompts = [f"p{i}" for i in range(len(responses))]
    truths = list(range(len(responses)))
    return remote(prompts=prompts, responses=list(responses), ground_truths=truths, url=url, **args)


def test_posts_the_rows_and_reads_one_score_each(server):
    assert call(server.url, **FAST) == [1.0, 3.0]
    assert server.requests == [
        {
            "rows": [
                {"prompt": "p0", "response": "a", "ground_truth": 0},
                {"prompt": "p1", "response": "bbb", "ground_truth": 1},
            ]
        }
    ]


def test_retries_a_failing_server_until_it_answers(server):
    server.failures_left = 2
    assert call(server.url, max_retries=2, **FAST) == [1.0, 3.0]
    assert len(server.requests) == 3


def test_gives_up_after_the_retries_naming_the_url(server):
    server.failures_left = 5
    with pytest.raises(RemoteRewardError, match="failed 2 times; last failure.*503"):
        call(server.url, max_retries=1, **FAST)
    assert len(server.requests) == 2


def test_unreachable_url_fails_after_retries_with_the_url_in_the_message():
    with socket.socket() as probe:  # a port nobody listens on: bound, then closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}/score"
    with pytest.raises(RemoteRewardError, match=f"POST {url} failed 3 times") as err:
        call(url, max_retries=2, **FAST)
    assert "refused" in str(err.value).lower()


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        ("not json", "not JSON"),
        ('{"score": [1, 2]}', "not JSON of the form"),
        ('{"scores": [1]}', "returned 1 scores for 2 rows"),
        ('{"scores": [1, "high"]}', "score 'high' for row 1"),
        ('{"scores": [1, NaN]}', "score nan for row 1"),
        ('{"scores": [true, 1]}', "score True for row 0"),
        ('{"scores": [1, 1' + "0" * 400 + ']}', r"score 10{56}\.\.\. for row 1, not a finite number"),  # was an unnamed OverflowError
    ],
)
def test_malformed_replies_fail_at_once_saying_what_is_wrong(server, raw, problem):
    server.raw = raw
    with pytest.raises(RemoteRewardError, match=problem):
        call(server.url, max_retries=3, **FAST)
    assert len(server.requests) == 1  # a malformed reply is not retried


def test_missing_url_names_the_key():
    with pytest.raises(ConfigError, match="args.url"):
        remote(prompts=["p"], responses=["r"], ground_truths=[None])


def test_is_not_a_verifier():
    assert not getattr(remote, "is_verifier", False)


class Dripper(BaseHTTPRequestHandler):
    """Sends its headers, then the body one byte at a time, each well inside a per-read timeout, until told to stop."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        drip_forever(self, json.dumps({"scores": [1.0, 3.0]}).encode(), self.server.stop)

    def log_message(self, *args) -> None:
        pass


def test_a_service_that_drips_its_reply_is_cut_off_at_the_whole_request_timeout():
    """Each byte comes well inside the socket's timeout, so only a deadline on the whole reply ends the request:
    `args.timeout_s` bounds the request, not each read (before, the run hung forever)."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Dripper)
    httpd.stop = threading.Event()
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/score"
    err = error_within(lambda: call(url, timeout_s=1.0, max_retries=0), RemoteRewardError, httpd.stop)
    httpd.shutdown()
    httpd.server_close()
    assert err is not None and "took longer than args.timeout_s=1 s" in str(err)


@pytest.mark.parametrize(("url", "weight", "message"), [
    ("notaurl", 1.0, r"^reward function remote: reward.functions\[0\].args.url='notaurl' is not an http\(s\) URL with a host"),
    ("ftp://x/y", 1.0, r"reward.functions\[0\].args.url='ftp://x/y' is not an http\(s\) URL"),
    ("http://127.0.0.1:8000/score", float("nan"), r"^reward.functions\[0\].weight=nan \(remote\) must be a finite number$"),
    ("http://127.0.0.1:8000/score", float("inf"), r"^reward.functions\[0\].weight=inf \(remote\) must be a finite number$"),
])
def test_a_bad_url_or_weight_is_refused_when_the_reward_set_is_built(url, weight, message):
    """Before any model loads; before, `notaurl` failed at the first scoring as urllib's "unknown url type", naming no
    key, and a nan weight passed until the first scores."""
    from omegaconf import OmegaConf

    from rlhf.rewards.combine import RewardSet

    cfg = OmegaConf.create({"functions": [{"name": "remote", "weight": weight, "args": {"url": url}}], "overlong_buffer_len": None})
    with pytest.raises(ConfigError, match=message):
        RewardSet(cfg)
