"""What a request says, read strictly: messages normalised for comparison, tool calls parsed from sampled text, and
sampling fields that would corrupt the trainer's logprobs refused with the field named."""

from __future__ import annotations

import pytest

from rlhf.agents.messages import (
    Message, RequestError, ToolCall, extends, parse_hermes, parse_messages, read_limits, read_tools, same_message,
    tool_parser,
)
from rlhf.errors import ConfigError


def limits(**body):
    return read_limits(body, temperature=1.0, top_p=1.0, max_new_tokens=16, max_n=4)


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


def test_sampling_fields_repeat_the_runs_or_are_refused_naming_the_key():
    assert limits(temperature=1.0, top_p=1, max_tokens=4, n=2, stop="\n") == limits(max_completion_tokens=4, n=2, stop=["\n"], temperature=1)
    assert limits(max_tokens=999).max_new_tokens == 16  # more than generator.max_new_tokens is cut to it
    with pytest.raises(RequestError, match="generator.temperature=1") as err:
        limits(temperature=0.7)
    assert err.value.field == "temperature"
    for body, field in [({"top_p": 0.9}, "top_p"), ({"presence_penalty": 0.5}, "presence_penalty"),
                        ({"logit_bias": {"5": 3}}, "logit_bias"), ({"max_tokens": 0}, "max_tokens"), ({"n": 5}, "n"),
                        ({"stop": ["", "x"]}, "stop"), ({"stream": "yes"}, "stream")]:
        with pytest.raises(RequestError) as err:
            limits(**body)
        assert err.value.field == field, body


@pytest.mark.parametrize("body, field", [
    ({"n": 0}, "n"), ({"n": -2}, "n"), ({"stop": 5}, "stop"), ({"stop": {"x": 1}}, "stop"),
    ({"logprobs": True}, "logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
])
def test_n_below_one_a_stop_not_of_strings_and_logprobs_are_refused_naming_the_field(body, field):
    """Before: n=0 was served as n=1, stop=5 failed as "the chat template cannot render this request: TypeError" with
    no field named, and logprobs=true was answered with logprobs null."""
    with pytest.raises(RequestError) as err:
        limits(**body)
    assert err.value.field == field and err.value.status == 400


def test_absent_or_null_n_stop_and_logprobs_are_the_defaults():
    assert limits(n=None, stop=None, logprobs=False) == limits() == limits(stop="", logprobs=None, top_logprobs=None)
    assert (limits().n, limits().stops) == (1, ())


def test_tools_are_looked_for_unless_tool_choice_is_none():
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert read_tools({"tools": tools}) == (tools, True)
    assert read_tools({"tools": tools, "tool_choice": "none"}) == (tools, False)
    assert read_tools({}) == (None, False)
    with pytest.raises(RequestError, match="tool_choice"):
        read_tools({"tools": tools, "tool_choice": "required"})
    with pytest.raises(RequestError, match="tools must be a list"):
        read_tools({"tools": "f"})
