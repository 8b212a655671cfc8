"""What a request's messages say, read strictly: messages normalised for comparison, tool calls parsed from sampled
text."""

from __future__ import annotations

import pytest

from rlhf.agents.messages import (
    Message, RequestError, ToolCall, extends, parse_hermes, parse_messages, same_message, tool_parser,
)
from rlhf.errors import ConfigError


def test_messages_are_normalised_text_parts_joined_and_arguments_canonical():
    raw = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "x", "type": "function", "function": {"name": "f", "arguments": '{"b": 1, "a": 2}'}}]},
        {"role": "tool", "content": "ok", "tool_call_id": "x"},
    ]
    user, assistant, tool = parse_messages(raw)
    assert user == Message("user", "ab")
    assert assistant.tool_calls == (ToolCall("f", '{"a": 2, "b": 1}'),)
    assert tool.tool_call_id == "x"


@pytest.mark.parametrize("raw, field", [
    ([], "messages"),
    ([{"role": "robot", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": 3}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}],
     "messages[0].tool_calls[0].function.arguments"),
])
def test_a_malformed_message_names_its_field(raw, field):
    with pytest.raises(RequestError) as err:
        parse_messages(raw)
    assert err.value.field == field and err.value.status == 400


def test_an_assistant_message_sent_back_matches_by_text_and_calls_the_agent_repeats():
    ours = Message("assistant", " 42\n", (ToolCall("f", "{}"),))
    assert same_message(ours, Message("assistant", "42"))  # the agent dropped the calls: still the same reply
    assert same_message(ours, Message("assistant", "42", (ToolCall("f", "{}", id="call_9"),)))  # ids do not count
    assert not same_message(ours, Message("assistant", "42", (ToolCall("g", "{}"),)))
    assert not same_message(ours, Message("assistant", "43"))
    assert not same_message(Message("user", "a"), Message("user", "a "))  # other roles compare exactly
    assert extends([Message("user", "a")], [Message("user", "a"), Message("user", "b")])
    assert not extends([Message("user", "a"), Message("user", "b")], [Message("user", "a")])


def test_hermes_tool_calls_are_parsed_and_the_rest_is_content():
    text = 'Let me look.<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    reply = parse_hermes(text)
    assert reply.content == "Let me look."
    assert reply.tool_calls == (ToolCall("weather", '{"city": "Paris"}'),)
    assert not reply.unparsed


@pytest.mark.parametrize("text", ['<tool_call>{"name": "f", "arguments": {</tool_call>', "<tool_call>no end", '<tool_call>[1]</tool_call>'])
def test_tool_call_text_that_does_not_parse_is_plain_content_and_flagged(text):
    reply = parse_hermes(text)
    assert reply.content == text and reply.tool_calls == () and reply.unparsed


def test_a_parser_is_named_by_builtin_name_or_import_path():
    assert tool_parser("hermes") is parse_hermes
    assert tool_parser("rlhf.agents.messages.parse_hermes") is parse_hermes
    with pytest.raises(ConfigError, match="env.tool_parser='nope'"):
        tool_parser("nope")

