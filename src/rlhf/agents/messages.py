"""Chat messages as the endpoint compares them, and the parsers that find tool calls in sampled text.

A request's messages are normalised into `Message` values (`parse_messages`) so that a session can tell whether a
request extends what it already holds: the same roles, texts and tool calls in the same order. An assistant message
the agent sends back matches the reply the endpoint recorded when their texts agree (whitespace at the ends aside)
and, where the agent repeats the tool calls, the calls agree too (name and parsed arguments).

Tool calls: the sampled text of a reply is split by a parser (`env.tool_parser`) into the text shown as the reply's
``content`` and OpenAI-style ``tool_calls``. The built-in ``hermes`` parser reads the Hermes/Qwen format, one JSON
object ``{"name": ..., "arguments": {...}}`` inside each ``<tool_call>...</tool_call>``. A parser of your own is an
import path to ``fn(text) -> ParsedReply``. Text that looks like a tool call but does not parse is returned as
plain content and flagged (`ParsedReply.unparsed`, counted in ``env/unparsed_tool_calls``).
"""

from __future__ import annotations

import difflib
import importlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from rlhf.errors import ConfigError

ROLES = ("system", "developer", "user", "assistant", "tool")
MESSAGE_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content", "reasoning", "refusal",
                  "audio", "function_call", "annotations")  # OpenAI's message fields, and vLLM's reasoning by either name
# ``annotations`` (a reply's citations, sent back by SDKs that dump the reply whole) is read by no chat template: ignored
_NULL_ONLY = {  # message fields served only as null: field -> why any other value is refused
    "refusal": "a refusal is not served as its own field; send its text as content",
    "audio": "audio is not served",
    "function_call": "the deprecated functions API is not served; send tool_calls",
}


class RequestError(ValueError):
    """A request the endpoint cannot serve: answered with HTTP ``status`` and a message naming the field."""

    def __init__(self, message: str, status: int = 400, field_name: str | None = None) -> None:
        super().__init__(message)
        self.status, self.field = status, field_name


@dataclass(frozen=True)
class ToolCall:
    """One function call: its name and its arguments as canonical JSON (keys sorted), so equal calls compare equal."""

    name: str
    arguments: str  # canonical JSON of the arguments object
    id: str = field(default="", compare=False)  # the id the endpoint gave it (not part of equality)

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Message:
    """One chat message, normalised: text content, tool calls, the id a tool result answers, the speaker's name and an
    assistant's reasoning, each handed to the chat template as sent (a template that does not read a field drops it)."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    name: str = ""  # OpenAI's participant name (or a tool result's function name)
    reasoning: str = ""  # an assistant's reasoning, sent as `reasoning_content` or `reasoning` (vLLM's fields)

    def as_template(self) -> dict[str, Any]:
        """The message as chat templates read it (tool-call arguments as a mapping, as HF templates expect)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                for c in self.tool_calls
            ]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.name:
            out["name"] = self.name
        if self.reasoning:  # under both names: Qwen3's and DeepSeek's templates read reasoning_content, newer ones reasoning
            out["reasoning_content"] = out["reasoning"] = self.reasoning
        return out


def resembling(name: str, known: tuple[str, ...]) -> str:
    """"; did you mean '<field>'?" for the known field most like ``name``, or nothing."""
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.7)
    return f"; did you mean {close[0]!r}?" if close else ""


def canonical_arguments(arguments: Any, where: str) -> str:
    """Tool-call arguments (a JSON string or an object) as canonical JSON, or RequestError naming ``where``."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise RequestError(f"{where}: arguments are not JSON: {arguments[:80]!r}", field_name=where) from None
    if not isinstance(arguments, dict):
        raise RequestError(f"{where}: arguments must be a JSON object", field_name=where)
    return json.dumps(arguments, sort_keys=True, ensure_ascii=False)


def _content(raw: Any, where: str) -> str:
    """A message's content as text: a string, null, or a list of text parts."""
    if raw is None:
        return ""
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        texts = []
        for k, part in enumerate(raw):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise RequestError(f"{where}[{k}]: only text parts are served ({{'type': 'text', 'text': ...}})", field_name=where)
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(f"{where} must be a string, null or a list of text parts", field_name=where)


def parse_messages(raw: Any) -> list[Message]:
    """A request's ``messages`` as `Message` values, or RequestError naming the first bad field."""
    if not isinstance(raw, list) or not raw:
        raise RequestError("messages must be a non-empty list", field_name="messages")
    out = []
    for k, message in enumerate(raw):
        where = f"messages[{k}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object with a role and content", field_name=where)
        role = message.get("role")
        if role not in ROLES:
            raise RequestError(f"{where}.role={role!r}; choose one of {', '.join(ROLES)}", field_name=f"{where}.role")
        calls = []
        for j, call in enumerate(message.get("tool_calls") or ()):
            at = f"{where}.tool_calls[{j}]"
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise RequestError(f"{at} must hold function.name and function.arguments", field_name=at)
            arguments = canonical_arguments(function.get("arguments", {}), f"{at}.function.arguments")
            calls.append(ToolCall(function["name"], arguments, str(call.get("id") or "")))
        _check_message_fields(message, role, where)
        tool_call_id = message.get("tool_call_id") or ""
        reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
        out.append(Message(role, _content(message.get("content"), f"{where}.content"), tuple(calls), str(tool_call_id),
                           message.get("name") or "", reasoning))
    return out


def _check_message_fields(message: dict, role: str, where: str) -> None:
    """RequestError naming the first field of ``message`` (at ``where``) that would be dropped or misread: one outside
    `MESSAGE_FIELDS` (with the field it resembles), a `_NULL_ONLY` field with a value, a name or reasoning that is not
    text, or reasoning on a message other than the assistant's."""
    for name, value in message.items():
        at = f"{where}.{name}"
        if name not in MESSAGE_FIELDS:
            hint = resembling(name, MESSAGE_FIELDS) or f" (a message holds {', '.join(MESSAGE_FIELDS)})"
            raise RequestError(f"unrecognized field {at}{hint}", field_name=at)
        if name in _NULL_ONLY and value is not None:
            raise RequestError(f"{at}={value!r}: {_NULL_ONLY[name]}", field_name=at)
        if name in ("name", "reasoning_content", "reasoning") and value is not None and not isinstance(value, str):
            raise RequestError(f"{at} must be a string", field_name=at)
        if name in ("reasoning_content", "reasoning") and value and role != "assistant":
            raise RequestError(f"{at}: only an assistant message carries reasoning", field_name=at)
    both = message.get("reasoning_content"), message.get("reasoning")
    if all(both) and both[0] != both[1]:
        raise RequestError(f"{where} holds reasoning_content and reasoning that differ; send one of them",
                           field_name=f"{where}.reasoning")


def same_message(ours: Message, theirs: Message) -> bool:
    """Whether a message sent back (``theirs``) is the one held (``ours``): see the module docstring."""
    if ours.role != theirs.role:
        return False
    if ours.role != "assistant":
        return ours == theirs
    calls_agree = not theirs.tool_calls or theirs.tool_calls == ours.tool_calls
    return ours.content.strip() == theirs.content.strip() and calls_agree


def extends(held: list[Message], request: list[Message]) -> bool:
    """Whether ``request`` starts with every message of ``held``, in order."""
    return len(request) >= len(held) and all(same_message(a, b) for a, b in zip(held, request))


@dataclass(frozen=True)
class ParsedReply:
    """Sampled text split into what the reply shows and the tool calls it makes."""

    content: str  # the text outside the tool calls
    tool_calls: tuple[ToolCall, ...] = ()
    unparsed: bool = False  # text that looked like a tool call did not parse (returned as content)


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> ParsedReply:
    """Hermes/Qwen tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number of them."""
    bodies = _HERMES.findall(text)
    if not bodies:
        return ParsedReply(text, unparsed="<tool_call>" in text)
    calls = []
    for body in bodies:
        try:
            call = json.loads(body)
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                raise ValueError("no name")
            calls.append(ToolCall(call["name"], canonical_arguments(call.get("arguments", {}), "tool_call")))
        except (ValueError, RequestError):
            return ParsedReply(text, unparsed=True)
    return ParsedReply(_HERMES.sub("", text).strip(), tuple(calls))


TOOL_PARSERS: dict[str, Callable[[str], ParsedReply]] = {"hermes": parse_hermes}


def tool_parser(name: str) -> Callable[[str], ParsedReply]:
    """The parser named by `env.tool_parser`: a built-in name or an import path `pkg.module.fn`."""
    if name in TOOL_PARSERS:
        return TOOL_PARSERS[name]
    module, _, attribute = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError, ValueError):
        choices = ", ".join(TOOL_PARSERS)
        raise ConfigError(f"env.tool_parser={name!r} is neither a built-in parser ({choices}) nor an importable `pkg.module.fn`") from None


def with_call_ids(reply: ParsedReply, prefix: str) -> ParsedReply:
    """``reply`` with its tool calls numbered ``<prefix>_0``, ``<prefix>_1``, ..."""
    calls = tuple(ToolCall(c.name, c.arguments, f"{prefix}_{k}") for k, c in enumerate(reply.tool_calls))
    return ParsedReply(reply.content, calls, reply.unparsed)

