"""What a request's messages say, read strictly: messages normalised for comparison, tool calls parsed from sampled
text."""

from __future__ import annotations

import json

import httpx
import openai
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


@pytest.mark.parametrize("message, field, says", [
    ({"role": "user", "content": "x", "nmae": "ann"}, "messages[0].nmae", "did you mean 'name'"),
    ({"role": "user", "content": "x", "images": []}, "messages[0].images", "a message holds role, content"),
    ({"role": "assistant", "content": "x", "refusal": "no"}, "messages[0].refusal", "send its text as content"),
    ({"role": "assistant", "content": "", "function_call": {"name": "f", "arguments": "{}"}}, "messages[0].function_call",
     "send tool_calls"),
    ({"role": "user", "content": "x", "name": 7}, "messages[0].name", "must be a string"),
    ({"role": "user", "content": "x", "reasoning_content": "hm"}, "messages[0].reasoning_content", "only an assistant"),
    ({"role": "assistant", "content": "x", "reasoning_content": "a", "reasoning": "b"}, "messages[0].reasoning", "differ"),
])
def test_a_message_field_that_would_be_dropped_or_misread_is_refused_by_name(message, field, says):
    """Before, every field but role, content, tool_calls and tool_call_id was dropped without a word: a misspelt
    ``nmae`` rendered the prompt without the name the agent sent."""
    with pytest.raises(RequestError, match=says) as err:
        parse_messages([message])
    assert err.value.field == field and err.value.status == 400


def test_a_name_and_an_assistants_reasoning_reach_the_chat_template_under_the_names_templates_read():
    user, assistant = parse_messages([
        {"role": "user", "content": "hi", "name": "ann"},
        {"role": "assistant", "content": "42", "reasoning_content": "6 * 7", "refusal": None, "audio": None,
         "function_call": None, "annotations": [], "tool_calls": None},  # a reply as SDKs dump it, sent back whole
    ])
    assert user.as_template() == {"role": "user", "content": "hi", "name": "ann"}
    assert assistant.as_template() == {"role": "assistant", "content": "42", "reasoning_content": "6 * 7", "reasoning": "6 * 7"}
    assert parse_messages([{"role": "assistant", "content": "42", "reasoning": "6 * 7"}]) == [assistant]  # vLLM's newer name
    assert user != Message("user", "hi")  # a name changes the prompt, so a history that differs only by it forks
    assert same_message(Message("assistant", "42"), assistant)  # a reply sent back with its reasoning still matches


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



def test_a_reply_the_openai_sdk_sends_back_parses_as_the_object_or_its_dump():
    """Agents append the SDK's reply message to their history, as the object or as `model_dump()` (which adds
    `refusal`, `annotations`, `audio`, `function_call` as null): both parse, calls and ids kept."""
    reply = {"id": "c1", "object": "chat.completion", "created": 0, "model": "m", "choices": [{
        "index": 0, "finish_reason": "tool_calls", "logprobs": None, "message": {
            "role": "assistant", "content": "on it", "tool_calls": [
                {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}}]}
    sent = []

    def answer(request):
        sent.append(json.loads(request.content)["messages"])
        return httpx.Response(200, json=reply)

    client = openai.OpenAI(base_url="http://endpoint/v1", api_key="k", http_client=httpx.Client(transport=httpx.MockTransport(answer)))
    ask = {"role": "user", "content": "go"}
    message = client.chat.completions.create(model="m", messages=[ask]).choices[0].message
    for held in (message, message.model_dump()):
        client.chat.completions.create(model="m", messages=[ask, held, {"role": "tool", "tool_call_id": "call_0", "content": "1"}])
        _, assistant, _ = parse_messages(sent[-1])
        assert assistant == Message("assistant", "on it", (ToolCall("f", '{"x": 1}', id="call_0"),))
