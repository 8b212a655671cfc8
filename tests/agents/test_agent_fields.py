"""A request body read strictly: sampling fields that would corrupt the trainer's logprobs, fields the endpoint does not
honour and fields nobody knows are refused with the field named; bookkeeping fields SDKs send are ignored."""

from __future__ import annotations

import pytest

from rlhf.agents.fields import Limits, check_reward_fields, known_fields, read_limits, read_tools
from rlhf.agents.messages import RequestError


def limits(route="chat", **body):
    return read_limits(body, temperature=1.0, top_p=1.0, max_new_tokens=16, max_n=4, route=route)


def refused(route="chat", **body) -> RequestError:
    with pytest.raises(RequestError) as err:
        limits(route, **body)
    assert err.value.status == 400
    return err.value


def test_sampling_fields_repeat_the_runs_or_are_refused_naming_the_key():
    assert limits(temperature=1.0, top_p=1, max_tokens=4, n=2, stop="\n") == limits(max_completion_tokens=4, n=2, stop=["\n"], temperature=1)
    assert limits(max_tokens=999).max_new_tokens == 16  # more than generator.max_new_tokens is cut to it
    with pytest.raises(RequestError, match="generator.temperature=1") as err:
        limits(temperature=0.7)
    assert err.value.field == "temperature"
    for body, field in [({"top_p": 0.9}, "top_p"), ({"presence_penalty": 0.5}, "presence_penalty"),
                        ({"logit_bias": {"5": 3}}, "logit_bias"), ({"max_tokens": 0}, "max_tokens"), ({"n": 5}, "n"),
                        ({"stop": ["", "x"]}, "stop"), ({"stream": "yes"}, "stream")]:
        assert refused(**body).field == field, body


@pytest.mark.parametrize("body, field", [
    ({"n": 0}, "n"), ({"n": -2}, "n"), ({"stop": 5}, "stop"), ({"stop": {"x": 1}}, "stop"),
    ({"logprobs": "yes"}, "logprobs"), ({"top_logprobs": 2}, "top_logprobs"), ({"top_logprobs": True}, "top_logprobs"),
])
def test_n_below_one_a_stop_not_of_strings_and_logprob_alternatives_are_refused_naming_the_field(body, field):
    """Before: n=0 was served as n=1, stop=5 failed as "the chat template cannot render this request: TypeError" with
    no field named."""
    assert refused(**body).field == field


def test_absent_or_null_n_stop_and_logprobs_are_the_defaults():
    assert limits(n=None, stop=None, logprobs=False) == limits() == limits(stop="", logprobs=None, top_logprobs=None)
    assert (limits().n, limits().stops, limits().logprobs) == (1, (), False)


def test_logprobs_are_asked_as_each_route_asks_and_alternatives_are_refused():
    """Before: logprobs=true was refused (chat) and logprobs=0 answered with logprobs null (completions)."""
    assert limits(logprobs=True).logprobs and limits(logprobs=True, top_logprobs=0).logprobs
    assert limits("completions", logprobs=0).logprobs and not limits("completions").logprobs
    assert "likeliest alternatives" in str(refused(logprobs=True, top_logprobs=5))
    assert refused("completions", logprobs=2).field == "logprobs"
    assert refused("completions", logprobs=True).field == "logprobs"  # an integer there, not a flag


@pytest.mark.parametrize("name, close", [
    ("temprature", "temperature"), ("max_token", "max_tokens"), ("top-p", "top_p"), ("stops", "stop"),
    ("stop_sequences", None), ("guided_json", None),
])
def test_a_field_nobody_knows_is_refused_naming_it_and_the_field_it_resembles(name, close):
    """Before: any unknown field was accepted and ignored, so a misspelt temperature sampled at the run's."""
    err = refused(**{name: 0.5})
    assert err.field == name and f"unrecognized field {name!r}" in str(err)
    assert (f"did you mean {close!r}?" in str(err)) if close else "did you mean" not in str(err)


@pytest.mark.parametrize("route, body, other", [
    ("completions", {"max_completion_tokens": 4}, "/v1/chat/completions"),
    ("completions", {"messages": []}, "/v1/chat/completions"),
    ("chat", {"echo": False}, "/v1/completions"),
    ("chat", {"prompt": "1+1="}, "/v1/completions"),
])
def test_a_field_of_the_other_route_is_refused_naming_where_it_belongs(route, body, other):
    assert f"is a field of {other}" in str(refused(route, **body))


@pytest.mark.parametrize("body", [
    {"response_format": {"type": "json_object"}}, {"response_format": {"type": "json_schema", "json_schema": {}}},
    {"frequency_penalty": -0.5}, {"repetition_penalty": 1.2}, {"top_k": 20}, {"min_p": 0.05}, {"min_tokens": 3},
    {"ignore_eos": True}, {"stop_token_ids": [2]}, {"reasoning_effort": "low"}, {"verbosity": "high"},
    {"chat_template_kwargs": {"enable_thinking": False}}, {"functions": [{"name": "f"}]}, {"function_call": "f"},
    {"audio": {"voice": "alloy"}}, {"modalities": ["text", "audio"]}, {"web_search_options": {}},
    {"moderation": {"model": "omni-moderation-latest"}},
])
def test_a_field_that_would_change_the_sample_or_the_answer_is_refused_unless_neutral(body):
    """Before: each was accepted and ignored (all but the penalties and logit_bias): a reply sampled freely was
    returned, and trained on, as if it had been drawn as the agent asked."""
    (name,) = body
    err = refused(**body)
    assert err.field == name and "leave it out" in str(err)


@pytest.mark.parametrize("route, body", [
    ("completions", {"best_of": 3}), ("completions", {"echo": True}), ("completions", {"suffix": "!"}),
    ("completions", {"stream": True}),
])
def test_completions_fields_that_are_not_honoured_are_refused(route, body):
    (name,) = body
    assert refused(route, **body).field == name


def test_neutral_values_and_bookkeeping_fields_sdks_send_are_accepted_and_ignored():
    neutral = {"response_format": {"type": "text"}, "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {},
               "top_k": -1, "min_p": 0, "repetition_penalty": 1.0, "modalities": ["text"], "function_call": "auto",
               "functions": None, "parallel_tool_calls": True, "stream": False, "stream_options": {"include_usage": True}}
    bookkeeping = {"user": "u1", "metadata": {"run": "a"}, "store": False, "seed": 7, "service_tier": "auto",
                   "safety_identifier": "x", "prompt_cache_key": "k", "prompt_cache_retention": "24h",
                   "prompt_cache_options": {}, "prediction": {"type": "content", "content": "4"}}
    assert limits(**neutral, **bookkeeping) == limits()
    assert limits("completions", user="u1", seed=7, best_of=1, echo=False, suffix=None) == limits("completions")
    assert set(bookkeeping) <= set(known_fields("chat"))


def test_stream_options_include_usage_asks_for_a_usage_chunk_when_streaming():
    assert limits(stream=True, stream_options={"include_usage": True}) == Limits(16, 1, (), True, False, True)
    assert not limits(stream_options={"include_usage": True}).usage_chunk  # not streaming: nothing to add it to
    assert refused(stream=True, stream_options={"include_usage": "yes"}).field == "stream_options.include_usage"
    assert refused(stream_options=True).field == "stream_options"


def test_max_completion_tokens_null_leaves_max_tokens_in_force_and_a_bad_one_is_named():
    """Before: a null max_completion_tokens hid max_tokens (the run's limit was used), and a bad one was reported as
    max_tokens."""
    assert limits(max_completion_tokens=None, max_tokens=5).max_new_tokens == 5
    assert refused(max_completion_tokens=0).field == "max_completion_tokens"


def test_tools_are_looked_for_unless_tool_choice_is_none():
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert read_tools({"tools": tools}) == (tools, True)
    assert read_tools({"tools": tools, "tool_choice": "none"}) == (tools, False)
    assert read_tools({}) == (None, False)
    with pytest.raises(RequestError, match="tool_choice"):
        read_tools({"tools": tools, "tool_choice": "required"})
    with pytest.raises(RequestError, match="tools must be a list"):
        read_tools({"tools": "f"})


def test_parallel_tool_calls_false_is_refused_where_tool_calls_are_looked_for():
    """Before: accepted and ignored, so an agent that asked for one call could get several (all of them trained)."""
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert read_tools({"tools": tools, "parallel_tool_calls": True}) == (tools, True)
    assert read_tools({"parallel_tool_calls": False}) == (None, False)  # no tools: nothing to call
    assert read_tools({"tools": tools, "tool_choice": "none", "parallel_tool_calls": False}) == (tools, False)
    with pytest.raises(RequestError) as err:
        read_tools({"tools": tools, "parallel_tool_calls": False})
    assert err.value.field == "parallel_tool_calls"


@pytest.mark.parametrize(("body", "message"), [
    ({"rewrad": 1.0}, r"unrecognized field 'rewrad'; did you mean 'reward'\?"),
    ({"reward": 1.0, "done": True}, r"unrecognized field 'done': a reward body is"),
    ({}, r"an empty reward body"),
])
def test_a_reward_body_with_an_unknown_field_or_none_is_refused(body, message):
    """Before, `{"rewrad": 1}` posted a reward of 0 and answered ok."""
    with pytest.raises(RequestError, match=message):
        check_reward_fields(body)


def test_a_reward_body_of_either_field_or_both_passes():
    for body in ({"reward": 0.5}, {"finished": True}, {"reward": 1, "finished": False}):
        check_reward_fields(body)


def test_the_presentation_fields_vllm_agents_send_are_accepted_at_their_defaults_and_refused_otherwise():
    """An agent written for vLLM's server sends these at their defaults; before this table they were ignored, and in
    its first form unknown fields (a 400 for `skip_special_tokens`)."""
    defaults = {"skip_special_tokens": True, "spaces_between_special_tokens": True, "include_stop_str_in_output": False,
                "return_tokens_as_token_ids": False, "add_generation_prompt": True, "continue_final_message": False,
                "request_id": "r-1", "priority": 0}
    assert limits(**defaults) == limits()
    assert limits("completions", skip_special_tokens=True, include_stop_str_in_output=False, request_id="r") == limits("completions")
    for name, other in (("include_stop_str_in_output", True), ("continue_final_message", True), ("skip_special_tokens", False)):
        assert refused(**{name: other}).field == name
    assert "not of /v1/completions" in str(refused("completions", add_generation_prompt=True))


def test_logprobs_off_as_other_sdks_write_it_is_accepted():
    """Chat's `logprobs: 0` and completions' `logprobs: false` mean no logprobs (both were accepted before the table)."""
    assert not limits(logprobs=0).logprobs and not limits("completions", logprobs=False).logprobs
