"""`env=openai_agent`: agents written against OpenAI's API, trained through an endpoint inside the run.

The agent is a user file (`env.path`) defining

    async def run(task, client) -> reward

(plain ``def`` runs in a worker thread). ``task`` is an `AgentTask` (the dataset row's prompt and label, the reset
seed); ``client`` a `ClientConfig` (`rlhf.agents.agent_api`): the session's own ``base_url`` and ``api_key`` for the
OpenAI SDK (``openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key)``), and ``client.environ()`` for
an agent that runs a program reading ``OPENAI_BASE_URL``/``OPENAI_API_KEY``. The episode's reward is the number
``run`` returns plus every reward posted to ``client.reward_url`` (with ``client.headers``); ``run`` may return None
when it posted one.

`AgentRunner` has the agent loop's interface (`run(generator, tasks, seeds, group_size, sampling) -> episodes`), so
the Collector plays agent episodes as it plays environment episodes, in every schedule. One call opens a session
per episode, starts the agents (at most `env.max_concurrency` at once), and serves their requests from the caller's
thread: requests waiting together are batched into one generate call (up to `env.num_parallel` rows; the first
waits at most `env.batch_wait_s` for the others). An episode is lost, not the run, when its agent raises, gives no
reward, makes no request for `env.step_timeout_s` while not waiting for a reply, blocks the agents' event loop that
long, runs past `env.episode_timeout_s` or makes more than `env.max_requests` requests (`rlhf.agents.running`); later
calls to its session get 410. A stop signal abandons the batch at once (`StopRequested`). Rows: the session's last
chain (`env.chains=last`), or every chain (`all`, with an estimator without groups).
"""

from __future__ import annotations

from concurrent.futures import Future
import ipaddress
import logging
import queue
import secrets
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from rlhf.agents.agent_api import AgentTask, ClientConfig, load_agent
from rlhf.agents.fields import Limits, check_reward_fields, read_limits, read_tools
from rlhf.agents.messages import Message, RequestError, parse_messages, tool_parser
from rlhf.agents.running import AgentLoop, blocked_error, error_kind, no_reply_error, overdue
from rlhf.agents.sessions import Budget, Choice, Plan, Prerendered, Renderer, Reply, Session, Unrendered
from rlhf.envs.agent_func import call_user
from rlhf.envs.base import EnvConfig, finite_reward
from rlhf.envs.loop import Episode, sampled
from rlhf.data.templates import BUILTIN_TEMPLATES
from rlhf.errors import ConfigError, StopRequested, require, stop_requested
from rlhf.registry import register
from rlhf.rewards.combine import MAX_ABS_SCORE, within_bound

log = logging.getLogger("rlhf")

CHAINS = ("last", "all")  # `env.chains`
# `env.chat_template=plain`: messages' texts back to back, each assistant reply closed by EOS (the tiny model's format)
PLAIN_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)


def chat_template_source(value: str | None) -> str | None:
    """The Jinja source `env.chat_template` names: null or `tokenizer` (None: the tokenizer's own), `plain`, a built-in
    name of `dataset.chat_template`, a `.jinja` file, or inline Jinja; else ConfigError naming the key and the fix."""
    choices = (f"choose null (the tokenizer's own), plain, {', '.join(BUILTIN_TEMPLATES)}, a .jinja file, or an inline "
               f"Jinja template")
    if value is None or value == "tokenizer":
        return None
    if value == "plain":
        return PLAIN_TEMPLATE
    if value in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[value]
    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if value.endswith(".jinja") or "/" in value or path.is_file():
        require(path.is_file(), f"env.chat_template={value}: no such file; give an existing .jinja file, or {choices[7:]}")
        return path.read_text()
    raise ConfigError(f"env.chat_template={value!r} is not a template; {choices}")


@dataclass
class OpenAIAgentConfig(EnvConfig):
    path: Optional[str] = None  # the Python file defining `async def run(task, client) -> reward` (required); builtin:<file> = one of examples/
    host: str = "127.0.0.1"  # the interface the endpoint listens on (loopback unless you say otherwise)
    port: int = 0  # the endpoint's port; 0 = a free one (logged at start)
    model_name: str = "policy"  # the model name the endpoint serves (GET /v1/models; requests may name it or none)
    chat_template: Optional[str] = None  # a .jinja file, an inline Jinja chat template, `plain`, or a dataset.chat_template built-in name; null = the tokenizer's own
    tool_parser: str = "hermes"  # how tool calls are read from sampled text: hermes, or an import path `pkg.module.fn`
    chains: str = "last"  # rows per episode: last (the chain the session ended on) or all (needs an estimator without groups)
    batch_wait_s: float = 0.02  # how long a request waits for others to share its generate call
    max_n: int = 8  # the largest `n` one request may ask for
    max_request_bytes: int = 1_048_576  # a request body larger than this is refused (413) before it is parsed
    episode_timeout_s: float = 600.0  # an episode whose agent is still running this long after it started is lost (env/timed_out_episodes)
    max_requests: int = 128  # requests one episode may make (replies, retries, reward posts); the next loses it (env/over_budget_episodes)

    def check(self, at: str) -> None:
        super().check(at)
        require(self.chains in CHAINS, f"{at}.chains={self.chains!r}; choose one of {', '.join(CHAINS)}")
        require(0 <= self.port <= 65535, f"{at}.port={self.port} must be in 0..65535 (0 = a free port)")
        require(self.batch_wait_s >= 0, f"{at}.batch_wait_s={self.batch_wait_s} must be >= 0")
        require(self.max_n >= 1, f"{at}.max_n={self.max_n} must be >= 1")
        require(self.max_request_bytes >= 1024, f"{at}.max_request_bytes={self.max_request_bytes} must be >= 1024")
        require(self.episode_timeout_s > 0, f"{at}.episode_timeout_s={self.episode_timeout_s} must be > 0")
        require(self.max_requests >= 1, f"{at}.max_requests={self.max_requests} must be >= 1")
        chat_template_source(self.chat_template)  # a missing file or a misspelt name, before any model loads


@dataclass
class Job:
    """A request waiting for the generator."""

    session: Session  # whose request it is
    plan: Plan  # the chain and the context to generate after
    limits: Limits  # the request's max_tokens, n, stop strings and answer shape
    tools: bool  # look for tool calls in the reply


class AgentRunner:
    """The endpoint and the sessions behind it; plays batches of agent episodes (`run`)."""

    def __init__(self, maker, cfg, tokenizer, stop_id: int) -> None:
        self.maker, self.cfg, self.tokenizer = maker, cfg, tokenizer
        template = chat_template_source(cfg.chat_template)
        if template is None and not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                "env.name=openai_agent renders chat messages with the tokenizer's chat template, and this tokenizer has "
                "none; set env.chat_template to a Jinja template (or `plain`: texts back to back, replies closed by EOS)"
            )
        self.render = Renderer(tokenizer, tokenizer.convert_ids_to_tokens(stop_id), template)
        try:
            self.render.after_reply([Message("user", "probe")], None)
        except ValueError as err:
            raise ConfigError(f"env.chat_template: {err}; give a template that renders earlier replies as they were") from None
        self.parse = tool_parser(cfg.tool_parser)
        self.model_name = cfg.model_name
        self.lock = threading.Lock()  # guards the sessions (the server's thread and the serving thread share them)
        self.jobs: queue.Queue[Job] = queue.Queue()
        self.sessions: dict[str, Session] = {}
        self.keys: dict[str, Session] = {}
        self.closed: dict[str, str] = {}  # the id of each session of earlier batches -> its key
        self.closed_keys: set[str] = set()  # their keys
        self.sampling = None  # the sampling of the batch being played
        self.version: int | None = None  # the policy version the generator holds (set by the Collector)
        self.counts: dict[str, float] = {}
        self.last_metrics: dict[str, float] = {}
        self.agents = AgentLoop()  # where the agents' coroutines run (replaced when an agent blocks it)
        self._running = threading.Lock()
        from rlhf.agents.server import Server, make_app  # FastAPI and uvicorn load only when an endpoint serves

        self.server = Server(make_app(self), cfg.host, cfg.port)
        log.info("agent endpoint listening on %s (env.path=%s)", self.server.url, cfg.path)
        if not _loopback(cfg.host):
            log.warning(
                "env.host=%s: the agent endpoint listens beyond this machine, on port %d: whoever reaches it can list "
                "the model, and whoever holds a session's key (sent in clear over HTTP) can sample the policy, shape "
                "that episode's rows and post its reward; keep env.host=127.0.0.1 unless agents run elsewhere, and "
                "then firewall the port", cfg.host, self.server.port,
            )
        for name in ("httpx", "httpx2"):  # the agents' HTTP clients log every request at INFO: keep the run's log readable
            logging.getLogger(name).setLevel(max(logging.getLogger(name).getEffectiveLevel(), logging.WARNING))

    def close(self) -> None:
        self.server.close()
        self.agents.close()

    # -- what the HTTP routes call (the server's thread) -----------------------------------------------------
    def session_for(self, session_id: str | None, authorization: str | None) -> Session:
        """The live session named by the URL (its key the bearer token) or by the bearer key alone; RequestError 401
        (no key, or not this session's: nothing is touched), 404 or 410 otherwise."""
        key = (authorization or "").removeprefix("Bearer ").strip()
        if session_id is None and not key:
            raise RequestError("no session: use the session's base URL, or its key as the API key", 401)
        with self.lock:
            session, owner = self._owner(session_id, key)
            if session is None or session.settled:
                self._count("env/late_requests")
                if session is not None or owner is not None:
                    raise RequestError("this session has ended (its episode is over, lost or timed out)", 410)
                raise RequestError("no such session", 404)
            session.requests += 1
            if session.requests > self.cfg.max_requests:
                session.error = (f"over budget: the agent made more than env.max_requests={self.cfg.max_requests} "
                                 f"requests (replies, retries and reward posts) in its episode; end run() sooner, or raise "
                                 f"env.max_requests")
                raise RequestError(f"this session has ended: {session.error}", 410)
            return session

    def check_key(self, session_id: str, authorization: str | None) -> None:
        """RequestError 401 unless ``authorization`` holds session ``session_id``'s key (404: no such session); for
        the routes under a session's URL that read nothing of it (GET /v1/models): nothing is counted."""
        with self.lock:
            session, owner = self._owner(session_id, (authorization or "").removeprefix("Bearer ").strip())
        if session is None and owner is None:
            raise RequestError("no such session", 404)

    def _owner(self, session_id: str | None, key: str) -> tuple[Session | None, str | None]:
        """The session named by ``session_id`` (None: the one whose key is ``key``) and the key that owns it (either
        None for an unknown one); RequestError 401 when ``key`` is not that key. Called under the lock."""
        if session_id is None:
            session, owner = self.keys.get(key), key if key in self.closed_keys else None
            if session is None and owner is None:
                raise RequestError("no session has this API key: send a session's client.api_key", 401)
            return session, owner
        session = self.sessions.get(session_id)
        owner = session.key if session is not None else self.closed.get(session_id)
        if owner is not None and not secrets.compare_digest(key.encode(), owner.encode()):
            raise RequestError(f"the API key is not session {session_id}'s: send its client.api_key as "
                               f"Authorization: Bearer <key>", 401)
        return session, owner

    def submit(self, session: Session, route: str, body: dict) -> tuple[Reply | Future, Limits]:
        """Plan an answer to one request: a recorded `Reply` (a retry, or a chain out of budget) or a future one, and
        the request's `Limits` (what it asked of the answer)."""
        try:
            model = body.get("model")
            if model not in (None, self.model_name):
                raise RequestError(f"model {model!r} is not served here; ask for {self.model_name!r}", 404, "model")
            sampling = self.sampling
            limits = read_limits(body, sampling.temperature, sampling.top_p, sampling.max_new_tokens, self.cfg.max_n, route)
            if route == "chat":
                messages = parse_messages(body.get("messages"))
                tools, look_for_calls = read_tools(body)
            else:
                prompt = body.get("prompt")
                if not isinstance(prompt, str) or not prompt:
                    raise RequestError("prompt must be a non-empty string (token-id prompts are not served)", field_name="prompt")
                look_for_calls = False
            rendered = Prerendered(self.render)
            while True:  # plan under the lock; render what planning asks for outside it (a big request stalls no one)
                with self.lock:
                    if session.settled:
                        raise RequestError("this session has ended (its episode is over, lost or timed out)", 410)
                    session.active = time.monotonic()
                    try:
                        plan = (session.plan_chat(messages, tools, rendered) if route == "chat"
                                else session.plan_text(prompt, rendered))
                    except Unrendered as need:
                        call = need.call
                    else:
                        if plan.context is not None:  # queued under the lock: a session seen waiting has its job queued
                            self.jobs.put(Job(session, plan, limits, look_for_calls))
                        break
                rendered.add(call)
        except RequestError:
            self._count("env/rejected_requests")
            raise
        except Exception as err:  # a chat template or tokenizer that cannot take these messages
            self._count("env/rejected_requests")
            raise RequestError(f"the chat template cannot render this request: {type(err).__name__}: {err}") from None
        if plan.recorded is not None:
            return plan.recorded, limits
        if plan.ended:
            return Reply([Choice(Message("assistant", ""), "length")], len(plan.chain.token_ids()), self.version), limits
        return plan.waiting, limits

    def post_reward(self, session: Session, body: dict) -> None:
        """Add a posted reward to ``session``'s (400, nothing added, for one past the bound or a sum that would be)."""
        check_reward_fields(body)
        reward, finished = body.get("reward", 0.0), body.get("finished", False)
        if (number := finite_reward(reward)) is None or not within_bound(number):
            raise RequestError(f"reward={reward!r} must be a finite number with |reward| <= {MAX_ABS_SCORE:g}", field_name="reward")
        if not isinstance(finished, bool):
            raise RequestError(f"finished={finished!r} must be true or false", field_name="finished")
        with self.lock:
            if session.settled:
                raise RequestError("this session has ended", 410)
            total = (session.reward or 0.0) + number
            if not within_bound(total):
                raise RequestError(f"reward={reward!r} would bring the episode's rewards to {total:g}; their sum must stay "
                                   f"within |sum| <= {MAX_ABS_SCORE:g}", field_name="reward")
            session.reward = total
            session.active = time.monotonic()
            session.finished = finished

    def _count(self, name: str, by: float = 1.0) -> None:
        self.counts[name] = self.counts.get(name, 0.0) + by

    # -- one batch of episodes (the caller's thread) ---------------------------------------------------------
    def run(self, generator, tasks, seeds: list[int], group_size: int, sampling) -> list[Episode]:
        """Play ``group_size`` episodes of each task; episodes of a task are contiguous (one group). A stop signal
        (SIGTERM/SIGINT) abandons the batch at once: `StopRequested`."""
        with self._running:
            sessions = self._open(tasks, seeds, group_size, sampling)
            started: dict[str, Future] = {}
            try:
                self._serve(generator, sessions, started)
            finally:
                self._close(sessions, started)
            episodes = []
            for s in sessions:
                if s.error is None and not any(c.num_replies for c in s.chains):
                    s.error = no_reply_error(s, self.cfg.max_tokens)
                if s.error is not None:
                    self._count(error_kind(s.error))
                    episodes.append(Episode(s.group, s.seed, s.task, [], "failed", s.error))
                else:
                    episodes.extend(s.episodes(self.cfg.chains, self.render))
            self.last_metrics = dict(sorted(self.counts.items()))
            return episodes

    def _open(self, tasks, seeds, group_size, sampling) -> list[Session]:
        budget = Budget(self.cfg.max_tokens, self.cfg.max_turns)
        sessions = [
            Session(secrets.token_hex(8), "sk-" + secrets.token_hex(16), g, seeds[g], tasks[g], budget)
            for g in range(len(tasks)) for _ in range(group_size)
        ]
        with self.lock:
            self.sampling, self.counts = sampling, {}
            for s in sessions:
                self.sessions[s.id], self.keys[s.key] = s, s
        return sessions

    def _start(self, session: Session) -> Future:
        """Start the agent of ``session`` on the agents' loop; its deadlines run from now."""
        base = f"{self.server.url}/sessions/{session.id}/"
        client = ClientConfig(base + "v1", session.key, self.model_name, session.id, base + "reward")
        task = AgentTask(session.task.text, session.task.ground_truth, session.seed)

        async def agent():
            try:
                return await call_user(self.maker.run, task, client)
            except (SystemExit, KeyboardInterrupt) as err:  # would stop the agents' loop, and every agent with it
                raise RuntimeError(f"{type(err).__name__}({err}) inside run()") from None

        with self.lock:
            session.started = session.active = time.monotonic()
        return self.agents.submit(agent())

    def _serve(self, generator, sessions: list[Session], started: dict[str, Future]) -> None:
        """Answer requests until every session has settled, starting agents as others settle (at most
        `env.max_concurrency` running); StopRequested at a stop signal."""
        while True:
            if stop_requested.is_set():
                raise StopRequested("a stop signal arrived while agents played; their episodes were abandoned")
            live = self._settle(sessions, started)
            self._start_more(live, started)
            if not live and self.jobs.empty():
                return
            jobs = self._gather([s for s in live if s.id in started], started)
            if jobs:
                self._generate(generator, jobs)

    def _start_more(self, live: list[Session], started: dict[str, Future]) -> None:
        """Start the agents of live sessions not started yet, while fewer than `env.max_concurrency` run (a settled
        session frees its place at once, whether or not its agent has returned)."""
        waiting = [s for s in live if s.id not in started]
        for s in waiting[: max(self.cfg.max_concurrency - (len(live) - len(waiting)), 0)]:
            started[s.id] = self._start(s)

    def _settle(self, sessions: list[Session], started: dict[str, Future]) -> list[Session]:
        """Settle the sessions whose agent returned, raised or ran past a deadline (`overdue`; a blocked agents' loop
        loses every episode on it and is replaced); the live ones, started or not."""
        now, stalled = time.monotonic(), self.agents.stalled_s()
        blocked = stalled > self.cfg.step_timeout_s
        live = []
        with self.lock:
            for s in sessions:
                future = started.get(s.id)
                if s.settled:
                    continue
                if future is None:  # not started yet
                    live.append(s)
                elif future.done():
                    self._finish(s, future)
                elif error := blocked_error(stalled) if blocked else overdue(
                        s, now, _waiting(s), self.cfg.step_timeout_s, self.cfg.episode_timeout_s):
                    s.error = error
                    future.cancel()
                else:
                    live.append(s)
        if blocked:
            self.agents.close()
            self.agents = AgentLoop()
        return live

    def _finish(self, session: Session, future) -> None:
        """Take the agent's outcome: its return value added to the reward, or why the episode is lost."""
        try:
            value = future.result()
        except BaseException as err:  # the user's agent raised (or was cancelled)
            session.error = f"run raised {type(err).__name__}: {err}"
            return
        if value is not None:
            reward = finite_reward(value)
            total = None if reward is None else (session.reward or 0.0) + reward
            if total is None or not within_bound(total):
                session.error = (f"run returned {value!r}{'' if session.reward is None else f' (posted: {session.reward:g})'}; "
                                 f"return a finite number (the reward; with any posted, |sum| <= {MAX_ABS_SCORE:g}) or "
                                 f"None after posting one")
                return
            session.reward = total
        if session.reward is None:
            session.error = "no reward: return a number from run() or POST one to client.reward_url"
            return
        session.finished = True

    def _gather(self, live: list[Session], started: dict[str, Future]) -> list[Job]:
        """The next requests to generate together: the first waits up to `env.batch_wait_s` for the others (no longer
        once every agent still running waits for a reply: one that returned or raised meanwhile asks nothing more)."""
        try:
            jobs = [self.jobs.get(timeout=0.05)]
        except queue.Empty:
            return []
        deadline = time.monotonic() + self.cfg.batch_wait_s
        while sum(j.limits.n for j in jobs) < self.cfg.num_parallel:
            try:
                jobs.append(self.jobs.get_nowait())
                continue
            except queue.Empty:
                pass
            with self.lock:  # every agent that can be running (`env.max_concurrency`) is waiting for a reply
                running = [s for s in live if not started[s.id].done()]
                everyone = sum(_waiting(s) for s in running) >= min(len(running), self.cfg.max_concurrency)
            left = deadline - time.monotonic()
            if everyone:  # their jobs are all queued (`submit` queues under the lock): take them
                while len(jobs) < self.cfg.num_parallel and not self.jobs.empty():
                    jobs.append(self.jobs.get_nowait())
                break
            if left <= 0:
                break
            try:
                jobs.append(self.jobs.get(timeout=min(left, 0.005)))
            except queue.Empty:
                pass
        return jobs

    def _generate(self, generator, jobs: list[Job]) -> None:
        """One generate call for ``jobs`` (each job's ``n`` rows), each reply cut to its request's max_tokens."""
        contexts = [job.plan.context for job in jobs for _ in range(job.limits.n)]
        sampling = replace(self.sampling, max_new_tokens=max(job.limits.max_new_tokens for job in jobs))
        try:
            if hasattr(generator, "generate_versioned"):
                batch, version = generator.generate_versioned(contexts, sampling)
            else:
                batch, version = generator.generate(contexts, sampling), self.version
        except BaseException as err:
            with self.lock:
                for job in jobs:
                    job.session.fail_request(job.plan, RequestError(f"generation failed: {err}", 500))
            raise
        rows = iter(sampled(batch))
        self._count("env/generate_calls")
        self._count("env/generated_rows", len(contexts))
        with self.lock:
            for job in jobs:
                samples = []
                for _ in range(job.limits.n):
                    ids, logp, stopped = next(rows)
                    limit = job.limits.max_new_tokens
                    samples.append((ids[:limit], logp[:limit], stopped and len(ids) <= limit))
                job.session.record(job.plan, samples, version, self.render, self.parse if job.tools else None, job.limits.stops)
                job.session.active = time.monotonic()

    def _close(self, sessions: list[Session], started: dict) -> None:
        """Forget the batch's sessions (later calls get 410); agents still running are cancelled."""
        with self.lock:
            for s in sessions:
                self.sessions.pop(s.id, None)
                self.keys.pop(s.key, None)
                self.closed[s.id] = s.key
                self.closed_keys.add(s.key)
                if s.id in started and not started[s.id].done():
                    started[s.id].cancel()
                for key, value in s.counts.items():
                    self._count(key, value)
            while not self.jobs.empty():  # requests of agents that did not wait for their reply
                job = self.jobs.get_nowait()
                job.session.fail_request(job.plan, RequestError("this session has ended", 410))


def _loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback interface alone."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False


def _waiting(session: Session) -> bool:
    """Whether the session has a request being answered."""
    return any(chain.pending for chain in session.chains)


@register("env", "openai_agent")
class OpenAIAgentMaker:
    """Loads the agent file (`env.path`); its `runner` is the `AgentRunner` the run plays episodes with."""

    config = OpenAIAgentConfig
    uses_dataset = True
    runner = AgentRunner

    def __init__(self, *, cfg, tokenizer=None, rewards=None) -> None:
        self.path = cfg.path
        self.run = load_agent(cfg.path)
        tool_parser(cfg.tool_parser)
