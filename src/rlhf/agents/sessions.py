"""Sessions and chains: how each request of an agent becomes tokens the trainer can trust.

A session is one episode of one task. It holds one or more chains; a chain is one growing token sequence (a
trajectory row): the first request's messages rendered by the chat template, then each sampled reply exactly as
sampled, then each later request's new messages rendered after it. History is never rendered again, so a template
that rewrites old turns (dropping earlier reasoning, say) cannot change what is trained.

A request is matched against the session's chains, newest first (`Session.plan_chat`, `Session.plan_text`):

- **retry**: its messages are exactly those a reply was already sampled for: the recorded reply again (an SDK
  retry after a timeout leaves no orphan row); the same request still being answered waits for that answer;
- **extend**: its messages start with everything a chain holds, the chain's last message being a sampled reply
  (or the chain being new): only the new messages are rendered and appended;
- **fork**: anything else (the agent rewrote a reply, branched from an earlier point, or two requests raced on one
  chain): a new chain copies the longest matching history up to the end of a sampled reply, and the rest of the
  request is rendered after it (assistant messages the endpoint did not sample are observations, masked out).

Sessions are not thread-safe: the endpoint calls them under one lock, and plans with a `Prerendered` renderer so that
the tokenising of a request happens outside it.
"""

from __future__ import annotations

import concurrent.futures
import copy
import json
from dataclasses import dataclass, field
from typing import Any, Callable

from rlhf.agents.messages import Message, ParsedReply, RequestError, extends, with_call_ids
from rlhf.data.templates import encode_prompt
from rlhf.envs.loop import Episode, Turn, within_budget
from rlhf.envs.templates import chat_after_reply


SESSION_COUNTS = (  # what a session counts (summed over a batch: `env/*` metrics)
    "env/retried_requests",  # requests answered with the reply already sampled for them (an SDK retry)
    "env/forked_chains",  # chains started beside an existing one (a rewritten or branched history, a race, n > 1 aside)
    "env/rewritten_messages",  # assistant messages the agent wrote itself (trained as observations, masked out)
    "env/unparsed_tool_calls",  # replies whose tool-call text did not parse (returned as plain content)
    "env/budget_ended_requests",  # requests answered with nothing: env.max_turns or env.max_tokens ran out
)


class Renderer:
    """Messages and texts to token ids with the run's tokenizer, chat template and stop token."""

    def __init__(self, tokenizer, stop_text: str, chat_template: str | None = None) -> None:
        self.tokenizer, self.stop_text, self.chat_template = tokenizer, stop_text, chat_template

    def first(self, messages: list[Message], tools: list | None) -> list[int]:
        """A conversation's opening: every message, then the generation prompt."""
        text = self.tokenizer.apply_chat_template(
            [m.as_template() for m in messages], tools=tools or None, chat_template=self.chat_template,
            tokenize=False, add_generation_prompt=True,
        )
        return encode_prompt(self.tokenizer, text)

    def after_reply(self, messages: list[Message], tools: list | None, stopped: bool = True) -> list[int]:
        """The tokens that follow a sampled reply for the later ``messages``, up to the next generation prompt. The
        template's stop token after the reply is left out when the reply ended with it (``stopped``), kept when the
        reply was cut short without it."""
        stop_text = self.stop_text if stopped else ""
        text = chat_after_reply([m.as_template() for m in messages], self.tokenizer, stop_text, tools, self.chat_template)
        return self.tokens(text)

    def tokens(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def prompt(self, text: str) -> list[int]:
        """A completions prompt's tokens, as a text prompt opens a row."""
        return encode_prompt(self.tokenizer, text)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens shown (``<eos>``), as a logprob entry names it."""
        return self.tokenizer.decode([token_id])


class Unrendered(Exception):
    """Planning needs tokens not rendered yet: ``call`` (a `Renderer` method's name and arguments)."""

    def __init__(self, call: tuple[str, tuple]) -> None:
        super().__init__(call[0])
        self.call = call


class Prerendered:
    """A `Renderer` that answers only what was rendered beforehand (`add`) and raises `Unrendered` for anything else.
    Planning with it under the sessions' lock costs no tokenising: the caller renders the call named outside the lock
    and plans again (planning touches nothing before it renders)."""

    def __init__(self, render: Renderer) -> None:
        self.render, self.done = render, []  # [(call, token ids)]

    def add(self, call: tuple[str, tuple]) -> None:
        name, args = call
        self.done.append((call, getattr(self.render, name)(*args)))

    def _ask(self, name: str, *args) -> list[int]:
        for call, ids in self.done:
            if call == (name, args):
                return ids
        raise Unrendered((name, args))

    def first(self, messages: list[Message], tools: list | None) -> list[int]:
        return self._ask("first", messages, tools)

    def after_reply(self, messages: list[Message], tools: list | None, stopped: bool = True) -> list[int]:
        return self._ask("after_reply", messages, tools, stopped)

    def tokens(self, text: str) -> list[int]:
        return self._ask("tokens", text)

    def prompt(self, text: str) -> list[int]:
        return self._ask("prompt", text)


@dataclass
class Choice:
    """One sampled reply as the endpoint answered it."""

    message: Message  # the assistant message (content and tool calls); completions: its text as content
    finish_reason: str  # stop | length | tool_calls
    token_ids: list[int] = field(default_factory=list)  # the sampled tokens, as trained (the stop token included)
    logprobs: list[float] = field(default_factory=list)  # the generator's logprob of each, as trained

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class Reply:
    """A request's recorded answer: ``n`` choices, from one policy version."""

    choices: list[Choice]
    prompt_tokens: int
    version: int | None


@dataclass
class Chain:
    """One token sequence of a session: a trajectory row."""

    kind: str  # chat (messages) or text (completions)
    tools: str  # the request's tools, as canonical JSON ("" for none)
    turns: list[Turn] = field(default_factory=list)  # observations and the replies sampled after them
    messages: list[Message] = field(default_factory=list)  # chat: every message so far, sampled replies included
    text: str = ""  # text: the prompt and completion texts so far
    boundaries: dict[int, int] = field(default_factory=lambda: {0: 0})  # history length after a reply -> turns then
    replies: dict[Any, Reply] = field(default_factory=dict)  # a request (its history length) -> its recorded answer
    pending: dict[Any, concurrent.futures.Future] = field(default_factory=dict)  # requests being answered
    ended: str = ""  # "" while it may grow; max_tokens or max_turns once a budget ran out

    @property
    def length(self) -> int:
        """The history length: messages (chat) or characters (text)."""
        return len(self.messages) if self.kind == "chat" else len(self.text)

    def token_ids(self) -> list[int]:
        return [i for t in self.turns for i in t.observation_ids + t.action_ids]

    @property
    def num_replies(self) -> int:
        return sum(bool(t.action_ids) for t in self.turns)

    def copy_until(self, boundary: int) -> "Chain":
        """A new chain holding this one's history up to ``boundary`` (the end of a reply, or 0)."""
        chain = Chain(self.kind, self.tools, copy.deepcopy(self.turns[: self.boundaries[boundary]]))
        chain.messages, chain.text = self.messages[:boundary], self.text[:boundary]
        chain.boundaries = {b: t for b, t in self.boundaries.items() if b <= boundary}
        return chain

    def twin(self) -> "Chain":
        """A copy of everything this chain holds (the unanswered last observation included), without its requests."""
        return Chain(self.kind, self.tools, copy.deepcopy(self.turns), list(self.messages), self.text, dict(self.boundaries))


@dataclass
class Plan:
    """What answering one request takes."""

    chain: Chain
    key: int  # the history length the reply is recorded under
    recorded: Reply | None = None  # a retry: the answer already given
    waiting: concurrent.futures.Future | None = None  # the same request, already being answered
    context: list[int] | None = None  # generate after these tokens
    ended: str = ""  # the chain has no room for a reply: answer with nothing, finish_reason length


@dataclass
class Budget:
    """The limits every chain keeps (`env.max_tokens`, `env.max_turns`)."""

    max_tokens: int
    max_turns: int


class Session:
    """One episode: a task, its chains, its reward and what went wrong, counted."""

    def __init__(self, session_id: str, key: str, group: int, seed: int, task, budget: Budget) -> None:
        self.id, self.key, self.group, self.seed, self.task, self.budget = session_id, key, group, seed, task, budget
        self.chains: list[Chain] = []
        self.last: Chain | None = None  # the chain the latest request extended or started
        self.reward: float | None = None  # posted rewards, summed
        self.finished = False  # the agent said so (a reward posted with finished=true) or its `run` returned
        self.error: str | None = None  # why the episode is lost
        self.unfit: int | None = None  # the longest request (tokens) answered with nothing before any reply: env.max_tokens
        self.started: float | None = None  # when its agent started (monotonic seconds); None before
        self.active: float | None = None  # when the agent last acted (monotonic seconds); None before it starts
        self.requests = 0  # requests it made (`env.max_requests`)
        self.counts = dict.fromkeys(SESSION_COUNTS, 0)  # what happened to its requests (`env/*` metrics)

    @property
    def settled(self) -> bool:
        return self.finished or self.error is not None

    # -- matching requests -------------------------------------------------------------------------------
    def plan_chat(self, messages: list[Message], tools: list | None, render: Renderer) -> Plan:
        """How to answer a chat request whose (normalised) messages are ``messages``."""
        if messages[-1].role == "assistant":
            raise RequestError("the last message is an assistant message; continuing a reply is not served", field_name="messages")
        tools_key = json.dumps(tools or [], sort_keys=True)
        chains = [c for c in reversed(self.chains) if c.kind == "chat" and c.tools == tools_key]
        k = len(messages)
        for chain in chains:  # a retry, or the same request in flight
            if k <= chain.length and extends(chain.messages[:k], messages):
                plan = self._again(chain, k)
                if plan is not None:
                    return plan
        for chain in chains:  # extend: the chain ends with a sampled reply and the request holds all of it
            if chain.length in chain.boundaries and not chain.pending and extends(chain.messages, messages):
                new = messages[chain.length :]
                if not any(m.role == "assistant" for m in new):
                    ids = render.after_reply(new, tools, chain.turns[-1].stopped)
                    return self._grow(chain, k, ids, lambda c: setattr(c, "messages", list(messages)))
        best, boundary = None, 0  # fork: the longest history a chain holds up to a reply's end, then the rest
        for chain in chains:
            for b in chain.boundaries:
                if boundary < b < k and extends(chain.messages[:b], messages):
                    best, boundary = chain, b
        new = messages[boundary:]
        chain = best.copy_until(boundary) if best is not None else Chain("chat", tools_key)
        ids = render.after_reply(new, tools, chain.turns[-1].stopped) if best is not None else render.first(new, tools)
        plan = self._grow(chain, k, ids, lambda c: setattr(c, "messages", list(messages)), fork=True)
        if not plan.ended:
            self.counts["env/rewritten_messages"] += sum(m.role == "assistant" for m in new)
        return plan

    def plan_text(self, prompt: str, render: Renderer) -> Plan:
        """How to answer a completions request for ``prompt``: a retry, an extension of a chain's text, or a new chain."""
        chains = [c for c in reversed(self.chains) if c.kind == "text"]
        k = len(prompt)
        for chain in chains:
            if chain.text[:k] == prompt and k <= chain.length:
                plan = self._again(chain, k)
                if plan is not None:
                    return plan
        for chain in chains:
            if chain.length in chain.boundaries and chain.turns and not chain.pending and prompt.startswith(chain.text):
                ids = render.tokens(prompt[chain.length :])
                return self._grow(chain, k, ids, lambda c: setattr(c, "text", prompt))
        ids = render.prompt(prompt)
        return self._grow(Chain("text", ""), k, ids, lambda c: setattr(c, "text", prompt), fork=True)

    def _again(self, chain: Chain, key: int) -> Plan | None:
        """The plan of a request already answered (its recorded reply) or being answered (its future), else None."""
        if key in chain.replies:
            self.counts["env/retried_requests"] += 1
            return Plan(chain, key, recorded=chain.replies[key])
        if key in chain.pending:
            self.counts["env/retried_requests"] += 1
            return Plan(chain, key, waiting=chain.pending[key])
        return None

    def _grow(self, chain: Chain, key: int, ids: list[int], take_history: Callable[[Chain], None], fork: bool = False) -> Plan:
        """Append the rendered new history ``ids`` to ``chain`` (a new one: ``fork``) and plan to generate after it;
        a chain without room for another reply (`env.max_turns`, `env.max_tokens`) is ended instead, untouched."""
        ended = chain.ended
        if not ended and chain.num_replies >= self.budget.max_turns:
            ended = "max_turns"
        elif not ended and len(chain.token_ids()) + len(ids) >= self.budget.max_tokens:
            ended = "max_tokens"
        if ended:
            self.counts["env/budget_ended_requests"] += 1
            if ended == "max_tokens" and not chain.num_replies:
                self.unfit = max(self.unfit or 0, len(chain.token_ids()) + len(ids))
            if not fork:
                chain.ended = ended
            return Plan(chain, key, ended=ended)
        if fork:
            self.counts["env/forked_chains"] += bool(self.chains)
            self.chains.append(chain)
        take_history(chain)
        chain.turns.append(Turn(observation="", observation_ids=list(ids)))
        chain.pending[key] = concurrent.futures.Future()
        self.last = chain
        return Plan(chain, key, context=chain.token_ids(), waiting=chain.pending[key])

    # -- recording replies -------------------------------------------------------------------------------
    def record(
        self, plan: Plan, samples: list[tuple[list[int], list[float], bool]], version: int | None, render: Renderer,
        parse: Callable[[str], ParsedReply] | None, stops: tuple[str, ...] = (),
    ) -> Reply:
        """Keep ``samples`` (one per choice: token ids, generator logprobs, ended by the stop token) as the replies
        to ``plan``; choices after the first get chains of their own. ``parse`` finds tool calls (None: none are
        looked for); a reply is cut after the first token that completes one of ``stops`` (hidden from its text)."""
        base = plan.chain
        twins = [base.twin() for _ in samples[1:]]
        self.chains.extend(twins)
        prompt_tokens = len(plan.context or ())
        room = self.budget.max_tokens - prompt_tokens
        choices = []
        for n, (chain, (ids, logp, stopped)) in enumerate(zip([base] + twins, samples)):
            text = None
            cut = stop_cut(ids, stops, render.decode) if stops else None
            if cut is not None:
                (end, text), stopped = cut, True
                ids, logp = ids[:end], logp[:end]
            ids, logp, stopped, over_budget = within_budget(ids, logp, stopped, room)
            if over_budget:  # the chain's budget ends with this reply
                text, chain.ended = None, "max_tokens"
            turn = chain.turns[-1]
            turn.action_ids, turn.action_logp, turn.stopped, turn.version = list(ids), list(logp), stopped, version
            turn.action = render.decode(ids) if text is None else text
            choices.append(self._answer(chain, turn.action, stopped, parse, plan.key, n))
        reply = Reply(choices, prompt_tokens, version)
        for chain in [base] + twins:
            chain.replies[plan.key] = reply
        future = base.pending.pop(plan.key, None)
        if future is not None:
            future.set_result(reply)
        return reply

    def fail_request(self, plan: Plan, err: BaseException) -> None:
        """The generation for ``plan`` failed: its chain forgets the unanswered request and the waiter gets ``err``."""
        chain = plan.chain
        future = chain.pending.pop(plan.key, None)
        if chain.turns and not chain.turns[-1].action_ids:
            chain.turns.pop()
        if future is not None and not future.done():
            future.set_exception(err)

    def _answer(self, chain: Chain, text: str, stopped: bool, parse, key: int, n: int) -> Choice:
        """The reply's message (tool calls parsed), appended to ``chain``'s history, which now ends at a reply."""
        parsed = parse(text) if parse is not None else ParsedReply(text)
        parsed = with_call_ids(parsed, f"call_{key}_{n}")
        self.counts["env/unparsed_tool_calls"] += parsed.unparsed
        message = Message("assistant", parsed.content, parsed.tool_calls)
        if chain.kind == "chat":
            chain.messages.append(message)
        else:
            chain.text += text
        chain.boundaries[chain.length] = len(chain.turns)
        reason = "tool_calls" if parsed.tool_calls else ("stop" if stopped else "length")
        turn = chain.turns[-1]
        return Choice(message, reason, list(turn.action_ids), list(turn.action_logp))

    # -- the episode ------------------------------------------------------------------------------------
    def episodes(self, which: str, render: Renderer) -> list[Episode]:
        """The session's trained rows as episodes of its group: the last chain (``last``) or every chain with a reply
        (``all``). The session's reward sits on each row's last reply."""
        chains = [c for c in self.chains if c.num_replies]
        if which == "last":
            chains = [self.last] if self.last is not None and self.last.num_replies else chains[-1:]
        out = []
        for chain in chains:
            turns = copy.deepcopy(chain.turns)
            while turns and not turns[-1].action_ids:  # an observation no reply answered is not trained
                turns.pop()
            for turn in turns:
                turn.reward, turn.observation = 0.0, render.tokenizer.decode(turn.observation_ids)
            turns[-1].reward = float(self.reward or 0.0)
            end = "failed" if self.error else (chain.ended or "terminated")
            out.append(Episode(self.group, self.seed, self.task, turns, end, self.error, {}))
        return out


def stop_cut(ids: list[int], stops: tuple[str, ...], decode: Callable[[list[int]], str]) -> tuple[int, str] | None:
    """Where a `stop` string first appears in the decoded reply: (tokens kept, the text before the stop string),
    the kept tokens being the fewest whose text holds it; None when no stop string appears."""
    if not any(s in decode(ids) for s in stops):
        return None
    for end in range(1, len(ids) + 1):
        text = decode(ids[:end])
        found = [text.index(s) for s in stops if s in text]
        if found:
            return end, text[: min(found)]
    return None
