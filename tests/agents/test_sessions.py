"""Sessions turn requests into trustworthy rows: history is never rendered twice, retries and races leave no orphan
rows, rewritten histories fork, budgets end chains. Token for token, with a ChatML char tokenizer (no hub): the
sampled token ids are handed to `Session.record` as a generator would hand them."""

from __future__ import annotations

import string

import pytest

from rlhf.agents.messages import Message, ToolCall, parse_hermes, parse_messages
from rlhf.agents.sessions import Budget, Renderer, Session, stop_cut
from rlhf.data.prompts import PromptExample
from rlhf.envs.rows import episode_rows
from rlhf.models.tiny import build_char_tokenizer

# ChatML with Qwen-style tools: a system turn listing them, calls as <tool_call> JSON, results as <tool_response>
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>{{ m['content'] }}</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}</tool_call>{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tokenizer():
    tok = build_char_tokenizer(string.printable[:95] + "\n")
    tok.add_special_tokens({"eos_token": "<|im_end|>", "additional_special_tokens": ["<|im_start|>"]})
    tok.chat_template = TOOLS_TEMPLATE
    return tok


@pytest.fixture
def render(tokenizer):
    return Renderer(tokenizer, "<|im_end|>")


def session(max_tokens=4096, max_turns=8):
    return Session("s1", "k1", 0, 7, PromptExample("q", (), ground_truth=None), Budget(max_tokens, max_turns))


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def reply(s, plan, tokenizer, render, text, parse=None, stopped=True, stops=()):
    """Record ``text`` (and the stop token when ``stopped``) as the sampled reply to ``plan``."""
    sampled = ids(tokenizer, text) + ([tokenizer.eos_token_id] if stopped else [])
    logp = [-0.5 - k for k in range(len(sampled))]
    return s.record(plan, [(sampled, logp, stopped)], 3, render, parse, stops)


def chat(*pairs):
    return parse_messages([{"role": role, "content": content} for role, content in pairs])


def test_a_tool_call_round_trip_is_trained_token_for_token(tokenizer, render):
    s = session()
    ask = [{"role": "user", "content": "Paris?"}]
    plan = s.plan_chat(parse_messages(ask), TOOLS, render)
    opening = tokenizer.apply_chat_template(ask, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert plan.context == tokenizer(opening)["input_ids"]  # as a dataset prompt: the tokenizer's BOS first
    call_text = '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>'
    answer = reply(s, plan, tokenizer, render, call_text, parse_hermes)
    (choice,) = answer.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == ""
    assert choice.message.tool_calls == (ToolCall("weather", '{"city": "Paris"}'),)
    call = choice.message.tool_calls[0]
    # the agent sends back the reply as the SDK returns it, and the tool's result
    back = ask + [
        {"role": "assistant", "content": None, "tool_calls": [call.as_openai()]},
        {"role": "tool", "content": "sunny", "tool_call_id": call.id},
    ]
    plan2 = s.plan_chat(parse_messages(back), TOOLS, render)
    observation = "\n<|im_start|>user\n<tool_response>sunny</tool_response><|im_end|>\n<|im_start|>assistant\n"
    first_action = ids(tokenizer, call_text) + [tokenizer.eos_token_id]
    assert plan2.chain is plan.chain and len(s.chains) == 1  # extended, never re-rendered
    assert plan2.context == plan.context + first_action + ids(tokenizer, observation)
    reply(s, plan2, tokenizer, render, "Sunny.")
    s.reward = 1.0
    (episode,) = s.episodes("last", render)
    row = episode_rows([episode], "sum", tokenizer.pad_token_id)
    second_action = ids(tokenizer, "Sunny.") + [tokenizer.eos_token_id]
    assert row.input_ids[0].tolist() == plan2.context + second_action
    window = row.window_ids[0].tolist()
    mask = row.loss_mask[0].tolist()
    assert [t for t, m in zip(window, mask) if m] == first_action + second_action  # exactly the sampled tokens
    assert [t for t, m in zip(window, mask) if not m] == ids(tokenizer, observation)
    assert row.gen_logp[0][row.loss_mask[0].bool()].tolist() == [-0.5 - k for k in range(len(first_action))] + [
        -0.5 - k for k in range(len(second_action))]
    assert row.scores.tolist() == [1.0] and [t.version for t in episode.turns] == [3, 3]


def test_a_template_that_drops_old_reasoning_cannot_change_what_is_trained(tokenizer, render):
    """Qwen3's template strips <think> from earlier replies; the endpoint never re-renders them."""
    s = session()
    plan = s.plan_chat(chat(("user", "hi")), None, render)
    reply(s, plan, tokenizer, render, "<think>hmm</think>hello")
    # the agent sends back the reply without its reasoning, as such templates (and many SDK users) do
    plan2 = s.plan_chat(chat(("user", "hi"), ("assistant", "<think>hmm</think>hello"), ("user", "again")), None, render)
    assert plan2.chain is plan.chain
    assert ids(tokenizer, "<think>hmm</think>hello") == plan2.context[len(plan.context) :][: len(ids(tokenizer, "<think>hmm</think>hello"))]


def test_a_retry_returns_the_recorded_reply_and_leaves_no_orphan_row(tokenizer, render):
    s = session()
    first = s.plan_chat(chat(("user", "hi")), None, render)
    again = s.plan_chat(chat(("user", "hi")), None, render)  # the SDK timed out and retried while generating
    assert again.waiting is first.waiting and again.context is None
    answer = reply(s, first, tokenizer, render, "yo")
    assert again.waiting.result() is answer
    late = s.plan_chat(chat(("user", "hi")), None, render)  # a retry after the answer
    assert late.recorded is answer and late.context is None
    assert len(s.chains) == 1 and s.counts["env/retried_requests"] == 2 and s.counts["env/forked_chains"] == 0


def test_a_rewritten_reply_forks_a_chain_that_masks_it(tokenizer, render):
    s = session()
    plan = s.plan_chat(chat(("user", "hi")), None, render)
    reply(s, plan, tokenizer, render, "yo")
    fork = s.plan_chat(chat(("user", "hi"), ("assistant", "HELLO"), ("user", "and?")), None, render)
    assert fork.chain is not plan.chain and len(s.chains) == 2
    assert s.counts["env/forked_chains"] == 1 and s.counts["env/rewritten_messages"] == 1
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "HELLO"}, {"role": "user", "content": "and?"}],
        tokenize=False, add_generation_prompt=True,
    )
    assert fork.context == tokenizer(rendered)["input_ids"]  # nothing sampled is kept: the whole history is an observation
    reply(s, fork, tokenizer, render, "ok")
    s.reward = 0.5
    assert [e.turns[-1].action for e in s.episodes("last", render)] == ["ok"]
    assert len(s.episodes("all", render)) == 2


def test_a_branch_from_an_earlier_reply_keeps_the_sampled_tokens_before_it(tokenizer, render):
    s = session()
    p1 = s.plan_chat(chat(("user", "a")), None, render)
    reply(s, p1, tokenizer, render, "b")
    p2 = s.plan_chat(chat(("user", "a"), ("assistant", "b"), ("user", "c")), None, render)
    reply(s, p2, tokenizer, render, "d")
    branch = s.plan_chat(chat(("user", "a"), ("assistant", "b"), ("user", "X")), None, render)
    assert branch.chain not in (p1.chain,) and len(s.chains) == 2
    sampled_b = ids(tokenizer, "b") + [tokenizer.eos_token_id]
    assert branch.context[: len(p1.context) + len(sampled_b)] == p1.context + sampled_b
    assert branch.chain.turns[0].action_logp == p1.chain.turns[0].action_logp  # the sampled reply, as sampled


def test_n_choices_get_a_chain_each_and_the_agents_pick_is_continued(tokenizer, render):
    s = session()
    plan = s.plan_chat(chat(("user", "pick")), None, render)
    samples = [(ids(tokenizer, t) + [tokenizer.eos_token_id], [-1.0] * (len(t) + 1), True) for t in ("x", "y", "z")]
    answer = s.record(plan, samples, 0, render, None)
    assert [c.message.content for c in answer.choices] == ["x", "y", "z"] and len(s.chains) == 3
    nxt = s.plan_chat(chat(("user", "pick"), ("assistant", "y"), ("user", "more")), None, render)
    assert nxt.chain.turns[0].action == "y" and s.counts["env/forked_chains"] == 0
    reply(s, nxt, tokenizer, render, "w")
    s.reward = 1.0
    (last,) = s.episodes("last", render)
    assert [t.action for t in last.turns] == ["y", "w"]


def test_budgets_end_a_chain_with_an_empty_length_answer(tokenizer, render):
    s = session(max_turns=1)
    plan = s.plan_chat(chat(("user", "a")), None, render)
    reply(s, plan, tokenizer, render, "b")
    over = s.plan_chat(chat(("user", "a"), ("assistant", "b"), ("user", "c")), None, render)
    assert over.ended == "max_turns" and over.context is None and len(plan.chain.turns) == 1
    s2 = session(max_tokens=40)
    plan = s2.plan_chat(chat(("user", "a")), None, render)
    room = 40 - len(plan.context)
    answer = reply(s2, plan, tokenizer, render, "z" * (room + 5), stopped=False)
    assert answer.choices[0].finish_reason == "length" and len(plan.chain.turns[-1].action_ids) == room
    assert plan.chain.ended == "max_tokens"


def test_a_reply_cut_without_its_stop_token_keeps_the_templates_one(tokenizer, render):
    s = session()
    plan = s.plan_chat(chat(("user", "a")), None, render)
    reply(s, plan, tokenizer, render, "bb", stopped=False)
    nxt = s.plan_chat(chat(("user", "a"), ("assistant", "bb"), ("user", "c")), None, render)
    assert tokenizer.decode(nxt.context[len(plan.context) + 2 :]) == "<|im_end|>\n<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n"


def test_stop_strings_cut_the_reply_after_the_token_that_completes_them(tokenizer, render):
    decode = lambda t: tokenizer.decode(t)  # noqa: E731
    assert stop_cut(ids(tokenizer, "abcXYde"), ("XY",), decode) == (5, "abc")
    assert stop_cut(ids(tokenizer, "abc"), ("XY",), decode) is None
    s = session()
    plan = s.plan_chat(chat(("user", "a")), None, render)
    answer = reply(s, plan, tokenizer, render, "12;34", stopped=False, stops=(";",))
    assert answer.choices[0].message.content == "12" and answer.choices[0].finish_reason == "stop"
    assert plan.chain.turns[-1].action_ids == ids(tokenizer, "12;")


def test_completions_extend_the_text_the_chain_holds(tokenizer, render):
    s = session()
    plan = s.plan_text("1+1=", render)
    answer = reply(s, plan, tokenizer, render, "2", stopped=False)
    assert answer.choices[0].message.content == "2"
    nxt = s.plan_text("1+1=2\n2+2=", render)
    assert nxt.chain is plan.chain and nxt.context == plan.context + ids(tokenizer, "2") + ids(tokenizer, "\n2+2=")
    assert s.plan_text("1+1=", render).recorded is answer
    other = s.plan_text("5+5=", render)
    assert other.chain is not plan.chain and s.counts["env/forked_chains"] == 1


def test_the_last_message_may_not_be_the_assistants(tokenizer, render):
    from rlhf.agents.messages import RequestError

    with pytest.raises(RequestError, match="continuing a reply"):
        session().plan_chat(chat(("user", "a"), ("assistant", "b")), None, render)


def test_a_message_name_reaches_a_template_that_renders_it(tokenizer):
    """A name the agent sends is rendered where the template reads it, not dropped on the way."""
    named = tokenizer.chat_template.replace("{{ m['role'] }}\n", "{{ m['role'] }}{{ (' ' + m['name']) if m.get('name') else '' }}\n")
    ask = [{"role": "user", "content": "Paris?", "name": "ann"}]
    plan = session().plan_chat(parse_messages(ask), None, Renderer(tokenizer, "<|im_end|>", named))
    assert tokenizer.decode(plan.context).endswith("<|im_start|>user ann\nParis?<|im_end|>\n<|im_start|>assistant\n")
