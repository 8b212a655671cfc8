"""judge: the rubric, the parsing, and every way a judge's service misbehaves, against a fake OpenAI-compatible
server on 127.0.0.1 (what the fake judge replies is the rendered rubric itself, so each row's response says how it
misbehaves). The real thing, `vllm serve`, is tests/rewards/test_judge_vllm.py."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import ThreadingHTTPServer

import pytest
from omegaconf import OmegaConf
from slow_replies import Replies, drip_forever

from rlhf.config.compose import compose_config
from rlhf.config.schema import RewardConfig, RewardFunctionConfig
from rlhf.errors import ConfigError
from rlhf.rewards.combine import RewardSet
from rlhf.rewards.failure import Unscored
from rlhf.rewards.judge import FAILURES, JudgeError, check_judge_args, judge, read_score

ECHO = "{{ response }}"  # the fake judge replies with the message it got: here, the row's response
FAST = {"timeout_s": 5.0, "backoff_s": 0.01, "model": "fake-judge"}
HELD_S = 10.0  # how long a "hold" request waits for company (event-driven: it goes on as soon as the others arrive)


class FakeJudge(Replies):
    """A chat-completions endpoint that answers with the user message's text, unless that text asks otherwise:
    ``html`` (an HTML page), ``drip`` (a reply trickled forever), ``busy<k>`` (503 k times, then "5"), ``status<code>``
    (that HTTP status), ``hold...`` (the first ``server.hold_for`` to arrive wait until that many are in flight; then
    "5")."""

    def do_POST(self) -> None:
        server = self.server
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        text = request["messages"][0]["content"]
        with server.lock:
            server.requests.append((text, time.monotonic(), dict(self.headers), request))
            server.in_flight += 1
            server.peak = max(server.peak, server.in_flight)
            server.company.notify_all()
            seen = sum(t == text for t, *_ in server.requests)
            self.arrival = len(server.requests)
        try:
            self.answer(text, seen)
        finally:
            self.leave()

    def leave(self) -> None:
        """No longer in flight (once): before its reply is written, so the client's next request never arrives
        while this one still counts."""
        with self.server.lock:
            if not getattr(self, "left", False):
                self.left = True
                self.server.in_flight -= 1

    def answer(self, text: str, seen: int) -> None:
        if text == "html":
            return self.reply(200, b"<html><body>Bad gateway</body></html>", "text/html")
        if text == "drip":
            return drip_forever(self, b'{"choices": []}', self.server.stop)
        if text.startswith("busy") and seen <= int(text[4:]):
            return self.reply(503, b'{"error": "busy"}')
        if text.startswith("status"):
            return self.reply(int(text[6:]), b'{"error": "no"}')
        if text.startswith("hold") and self.arrival <= self.server.hold_for:  # the first wave waits for each other
            with self.server.lock:
                self.server.company.wait_for(lambda: self.server.in_flight >= self.server.hold_for, timeout=HELD_S)
            time.sleep(0.2)  # in flight a while longer: a client past its limit would show more at once
        content = "5" if text.startswith(("busy", "hold")) else text
        self.reply(200, json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]}).encode())

    before_reply = leave


@pytest.fixture
def server():
    """The fake judge on an ephemeral port, served from threads; ``server.url`` is its OpenAI base URL."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeJudge)
    httpd.daemon_threads = True
    httpd.requests, httpd.in_flight, httpd.peak, httpd.stop, httpd.hold_for = [], 0, 0, threading.Event(), 1
    httpd.lock = threading.Lock()
    httpd.company = threading.Condition(httpd.lock)
    httpd.url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    thread.start()
    yield httpd
    httpd.stop.set()
    httpd.shutdown()
    httpd.server_close()


def ask(url: str, responses, **args):
    """judge's Scores for ``responses`` (prompts "p0", "p1", ...; no ground truths), the fake judge echoing them."""
    args = {**FAST, "rubric": ECHO, **args}
    return judge(prompts=[f"p{i}" for i in range(len(responses))], responses=list(responses), ground_truths=None,
                 base_url=url, **args)


def kinds(scores) -> list[str | None]:
    """Each row's failure kind (the reason's first word), None for a scored row."""
    return [s.reason.split(":")[0] if isinstance(s, Unscored) else None for s in scores]


def test_numbers_in_range_are_rescaled_to_zero_one(server):
    scores = ask(server.url, ["7", "0", "10", "Score: 2.5 out of 10"], cache_size=0)
    assert scores == pytest.approx([0.7, 0.0, 1.0, 0.25])
    assert ask(server.url, ["3"], low=1, high=5, cache_size=0) == [0.5]
    assert scores.metrics["requests"] == 4 and scores.metrics["unscored"] == 0


def test_yes_no_reads_the_first_word(server):
    assert ask(server.url, ["Yes.", "no", "NO! It is wrong", "Yes, but"], parse="yes_no", cache_size=0) == [1.0, 0.0, 0.0, 1.0]


def test_the_request_is_a_chat_completion_with_the_settings_and_the_key(server, monkeypatch):
    monkeypatch.setenv("JUDGE_TEST_KEY", "not-a-real-key")
    ask(server.url, ["4"], api_key_env="JUDGE_TEST_KEY", temperature=0.5, max_tokens=7, cache_size=0,
        rubric="Q: {{ prompt }} A: {{ response }} truth: {{ ground_truth }} ({{ low }}-{{ high }})")
    ((text, _, headers, request),) = server.requests
    assert text == "Q: p0 A: 4 truth: None (0.0-10.0)"
    assert headers["Authorization"] == "Bearer not-a-real-key"
    assert (request["model"], request["temperature"], request["max_tokens"]) == ("fake-judge", 0.5, 7)


@pytest.mark.parametrize(
    ("reply", "parse", "kind"),
    [("11", "number", "out_of_range"), ("-1", "number", "out_of_range"), ("great answer", "number", "unparsed"),
     ("", "number", "unparsed"), ("maybe", "yes_no", "unparsed"), ("html", "number", "bad_reply"),
     ("status400", "number", "http_error"), ("status500", "number", "busy")],
)
def test_a_reply_without_a_score_is_unscored_and_counted_never_zero(server, reply, parse, kind):
    scores = ask(server.url, [reply, "5"], parse=parse, max_retries=1, cache_size=0)
    assert kinds(scores) == [kind, "unparsed" if parse == "yes_no" else None]
    with pytest.raises(TypeError, match="no score"):  # an Unscored row is never silently a number
        float(scores[0])
    assert scores.metrics["unscored"] == (2 if parse == "yes_no" else 1)
    assert scores.metrics[f"unscored_{kind}"] >= 1
    assert set(FAILURES) <= {k.removeprefix("unscored_") for k in scores.metrics}  # every kind, every batch


def test_a_refused_connection_is_unscored_after_the_retries():
    with socket.socket() as probe:  # a port nobody listens on: bound, then closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    scores = ask(f"http://127.0.0.1:{port}/v1", ["1", "2"], max_retries=2)
    assert kinds(scores) == ["unreachable", "unreachable"]
    assert "failed 3 times" in scores[0].reason and "refused" in scores[0].reason.lower()
    assert scores.metrics["unscored_unreachable"] == 2


def test_a_judge_that_trickles_its_reply_times_out_at_the_whole_request(server):
    """Each byte comes well inside any per-read timeout: only a deadline on the whole exchange ends it."""
    done: list = []
    worker = threading.Thread(target=lambda: done.append(ask(server.url, ["drip"], timeout_s=1.0, max_retries=1)), daemon=True)
    worker.start()
    worker.join(timeout=120)  # generous: a hang fails the assertion, never the suite's clock
    assert done, "the judge's request never ended"
    assert kinds(done[0]) == ["timeout"] and "args.timeout_s=1" in done[0][0].reason
    assert len(server.requests) == 2  # tried, then retried once
    assert done[0].metrics["unscored_timeout"] == 1


def test_a_busy_judge_is_retried_with_growing_backoff_until_it_answers(server):
    assert ask(server.url, ["busy2"], max_retries=2, backoff_s=0.2, cache_size=0) == [0.5]
    times = [t for text, t, *_ in server.requests]
    assert len(times) == 3  # 503, 503, then the answer
    assert times[1] - times[0] >= 0.2 and times[2] - times[1] >= 0.4  # backoff_s, then twice it


def test_a_judge_still_busy_after_the_retries_is_unscored(server):
    scores = ask(server.url, ["busy5"], max_retries=1, cache_size=0)
    assert kinds(scores) == ["busy"] and "HTTP 503" in scores[0].reason
    assert len(server.requests) == 2


@pytest.mark.parametrize(("status", "key"), [(401, "args.api_key_env"), (404, "args.model or args.base_url")])
def test_a_refusal_every_row_would_get_stops_the_run_naming_the_key(server, status, key):
    with pytest.raises(JudgeError, match=f"HTTP {status}.*check {key}"):
        ask(server.url, [f"status{status}"], max_retries=3)
    assert len(server.requests) == 1  # not retried


def test_identical_requests_go_once_and_the_cache_serves_them_again(server):
    first = ask(server.url, ["3", "3", "4", "nonsense"], cache_size=100)
    assert first.metrics["requests"] == 3 and len(server.requests) == 3  # the two "3" rows asked once
    again = ask(server.url, ["4", "3", "nonsense"], cache_size=100)
    assert again[:2] == [0.4, 0.3] and kinds(again)[2] == "unparsed"
    assert again.metrics["cache_hits"] == 2
    assert [text for text, *_ in server.requests][3:] == ["nonsense"]  # a failure is never cached: asked again
    ask(server.url, ["4"], cache_size=100, temperature=0.7)  # other settings: another request
    assert len(server.requests) == 5


def test_the_cache_is_bounded_least_recently_used_out_first(server):
    ask(server.url, ["1", "2"], cache_size=1)  # "2" put last: "1" goes
    assert ask(server.url, ["2"], cache_size=1).metrics["cache_hits"] == 1
    assert ask(server.url, ["1"], cache_size=1).metrics["cache_hits"] == 0
    assert ask(server.url, ["1"], cache_size=0).metrics["cache_hits"] == 0  # 0: off
    assert len(server.requests) == 4


@pytest.mark.parametrize("limit", [2, 3])
def test_no_more_requests_are_in_flight_than_max_concurrency(server, limit):
    """The first requests wait (up to HELD_S) until ``limit`` are in flight: the peak reaches the limit, and a judge
    that sent more at once would pass it while they wait."""
    server.hold_for = limit
    scores = ask(server.url, [f"hold{i}" for i in range(6)], max_concurrency=limit, cache_size=0)
    assert scores == [0.5] * 6
    assert len(server.requests) == 6 and server.peak == limit


def test_extra_body_fields_go_with_each_request_from_a_config_node(server):
    rewards = reward_set({**GOOD, "base_url": server.url, "rubric": ECHO, "cache_size": 0,
                          "extra_body": {"structured_outputs": {"choice": ["yes", "no"]}, "top_p": 0.5}})
    (name, _, args, fn), = rewards.functions
    fn(prompts=["p"], responses=["7"], ground_truths=None, **args)  # the args as a config holds them
    request = server.requests[0][3]
    assert request["structured_outputs"] == {"choice": ["yes", "no"]} and request["top_p"] == 0.5
    assert request["model"] == "judge"


def test_a_ground_truth_is_given_to_the_rubric(server):
    judge(prompts=["p"], responses=["r"], ground_truths=[{"answer": 42}], base_url=server.url,
          rubric="{{ ground_truth.answer }}", cache_size=0, **FAST)
    assert server.requests[0][0] == "42"


# -- config checks, before any model loads ---------------------------------------------------------------------------

GOOD = {"base_url": "http://127.0.0.1:8000/v1", "model": "judge", "rubric": "Rate {{ response }} for {{ prompt }}"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"rubric": "Rate {{ response "}, r"at.rubric is not a valid Jinja template: line 1"),
        ({"rubric": "Rate {% if response %}{{ response }}"}, r"at.rubric is not a valid Jinja template"),
        ({"rubric": "Rate {{ answer }} for {{ question }}"}, r"at.rubric uses answer, question, which the judge does not give"),
        ({"rubric": "Rate {{ response.nope() }}"}, r"at.rubric does not render: UndefinedError"),
        ({"rubric": "Rate {{ response | no_such_filter }}"}, r"at.rubric is not a valid Jinja template.*no_such_filter"),
        ({"rubric": "rubrics/missing.j2"}, r"at.rubric='rubrics/missing.j2' is neither a template .* nor a file"),
        ({"rubric": ""}, r"judge needs at.rubric"),
        ({"base_url": "127.0.0.1:8000/v1"}, r"at.base_url='127.0.0.1:8000/v1' is not an http\(s\) URL"),
        ({"model": ""}, r"judge needs at.model"),
        ({"api_key_env": "sk-proj-abc123"}, r"at.api_key_env is the NAME of an environment variable"),
        ({"api_key_env": "JUDGE_TEST_UNSET_KEY"}, r"at.api_key_env='JUDGE_TEST_UNSET_KEY': that environment variable is not set"),
        ({"parse": "score"}, r"at.parse='score' must be one of number, yes_no"),
        ({"low": 10, "high": 0}, r"at.low=10 and at.high=0 must be finite numbers with low < high"),
        ({"max_concurrency": 0}, r"at.max_concurrency=0 must be an integer >= 1"),
        ({"timeout_s": 0}, r"at.timeout_s=0 must be > 0"),
        ({"cache_size": -1}, r"at.cache_size=-1 must be an integer >= 0"),
        ({"extra_body": {"model": "x", "max_tokens": 1}}, r"at.extra_body sets max_tokens, model; set at.<key> instead"),
        ({"extra_body": ["top_p"]}, r"at.extra_body must be a mapping"),
    ],
)
def test_args_it_cannot_use_are_config_errors_naming_the_key(args, message):
    with pytest.raises(ConfigError, match=message):
        check_judge_args("at", **{**GOOD, **args})


def test_called_without_its_args_it_names_the_key():
    with pytest.raises(ConfigError, match=r"args.base_url='' is not an http\(s\) URL"):
        judge(prompts=["p"], responses=["r"], ground_truths=None, model="judge", rubric=ECHO)


def test_a_rubric_from_a_file(tmp_path, server):
    path = tmp_path / "rubric.j2"
    path.write_text("{{ response }}\n")
    check_judge_args("at", **{**GOOD, "rubric": str(path)})
    assert ask(server.url, ["6"], rubric=str(path), cache_size=0) == [0.6]


def reward_set(args: dict) -> RewardSet:
    cfg = OmegaConf.structured(RewardConfig(functions=[RewardFunctionConfig(name="judge", args=args)]))
    return RewardSet(cfg)


def test_a_rubric_that_does_not_render_stops_the_reward_set_naming_the_key():
    """Where build_components builds the reward set: before the tokenizer, data or any model."""
    with pytest.raises(ConfigError, match=r"reward.functions\[0\].args.rubric is not a valid Jinja template"):
        reward_set({**GOOD, "rubric": "{{ prompt "})
    with pytest.raises(ConfigError, match=r"reward.functions\[0\].args.rubrik: .* did you mean reward.functions\[0\].args.rubric"):
        reward_set({**GOOD, "rubrik": "{{ prompt }}"})


def test_each_ground_truth_of_the_dataset_is_rendered_before_any_model_loads():
    rewards = reward_set({**GOOD, "rubric": "{{ response }} vs {{ ground_truth.answer }}"})  # a sample row renders
    rewards.check_truths([{"answer": 1}, {"answer": 2}], ["p.jsonl line 1", "p.jsonl line 2"])
    with pytest.raises(ConfigError, match=r"does not render with the ground truth of p.jsonl line 2 \(\{'answer_': 2\}\)"):
        rewards.check_truths([{"answer": 1}, {"answer_": 2}], ["p.jsonl line 1", "p.jsonl line 2"])


def test_the_preset_builds_its_reward_set():
    cfg = compose_config(["reward=judge"])
    rewards = RewardSet(cfg.reward, cfg.generator.max_new_tokens)
    assert [name for name, *_ in rewards.functions] == ["judge"]
    assert not rewards.has_verifier
