"""Observation templates: the first turn opens the conversation, later turns follow an action that ends with the
stop token, and every text is hand-written here (a tiny ChatML tokenizer, no hub)."""

from __future__ import annotations

import pytest

from rlhf.envs.templates import TEMPLATES, check, render
from rlhf.errors import ConfigError
from rlhf.models.tiny import build_char_tokenizer

# ChatML, as Qwen's chat models write it: each message closed by <|im_end|> and a newline
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# renders the last assistant message differently (as a thinking model might): no later turn can be appended
UNSTABLE = (
    "{% for m in messages %}{% if loop.last and m['role'] == 'assistant' %}<final>{% endif %}{{ m['content'] }}|"
    "{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
)
GAME_TURN = (
    "<|im_start|>user\nYou are playing language games. Make valid actions to win.\nObservation: hi"
    "\nPlease reason step by step, and put your final answer within \\boxed{}.<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def chat_tokenizer():
    """A char tokenizer whose EOS is <|im_end|> and whose chat template is ChatML."""
    tokenizer = build_char_tokenizer("abcdefghijklmnopqrstuvwxyz ")
    tokenizer.add_special_tokens({"eos_token": "<|im_end|>", "additional_special_tokens": ["<|im_start|>"]})
    tokenizer.chat_template = CHATML
    return tokenizer


def test_no_passes_the_observation_through(chat_tokenizer):
    assert render("no", "x = 1\n", chat_tokenizer, first=True) == "x = 1\n"
    assert render("no", "x = 1\n", chat_tokenizer, first=False) == "x = 1\n"


def test_qwen3_game_first_turn_is_a_user_turn_and_an_assistant_header(chat_tokenizer):
    assert render("qwen3_game", "hi", chat_tokenizer, first=True) == GAME_TURN


def test_qwen3_later_turn_after_im_end_adds_only_the_newline(chat_tokenizer):
    """The action already ends with <|im_end|> (the EOS), so only the newline that follows it is written."""
    assert render("qwen3_game", "hi", chat_tokenizer, first=False) == "\n" + GAME_TURN


def test_qwen3_later_turn_after_another_stop_token_closes_the_turn(chat_tokenizer):
    assert render("qwen3_game", "hi", chat_tokenizer, first=False, stop_token="<eos>") == "<|im_end|>\n" + GAME_TURN


def test_qwen3_general_asks_a_question(chat_tokenizer):
    expected = (
        "<|im_start|>user\nQuestion: 2+2?\nPlease reason step by step, and put your final answer within \\boxed{}."
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render("qwen3_general", "2+2?", chat_tokenizer, first=True) == expected


def test_chat_first_turn_is_the_chat_template_with_generation_prompt(chat_tokenizer):
    assert render("chat", "hi", chat_tokenizer, first=True) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_chat_later_turn_continues_after_the_stop_token(chat_tokenizer):
    """Appended after "...answer<|im_end|>", it makes the text of the whole conversation rendered at once."""
    later = render("chat", "try again", chat_tokenizer, first=False)
    assert later == "\n<|im_start|>user\ntry again<|im_end|>\n<|im_start|>assistant\n"
    first = render("chat", "hi", chat_tokenizer, first=True)
    conversation = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "answer"},
        {"role": "user", "content": "try again"},
    ]
    whole = chat_tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert first + "answer<|im_end|>" + later == whole


def test_chat_later_turn_keeps_the_closing_when_the_stop_token_differs(chat_tokenizer):
    later = render("chat", "again", chat_tokenizer, first=False, stop_token="<eos>")
    assert later == "<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"


def test_unknown_template_names_the_key_and_the_choices(chat_tokenizer):
    with pytest.raises(ConfigError, match=r"env.template='qwen'.*no, qwen3_game, qwen3_general, chat"):
        render("qwen", "hi", chat_tokenizer, first=True)
    assert TEMPLATES == ("no", "qwen3_game", "qwen3_general", "chat")


def test_chat_without_a_chat_template_is_refused():
    with pytest.raises(ConfigError, match="env.template=chat needs a tokenizer with a chat template"):
        check("chat", build_char_tokenizer("ab"))


def test_chat_template_that_rewrites_earlier_turns_is_refused(chat_tokenizer):
    tokenizer = build_char_tokenizer("ab")
    tokenizer.chat_template = UNSTABLE
    check("chat", chat_tokenizer)  # ChatML is fine
    with pytest.raises(ConfigError, match="env.template=chat: .* renders an assistant message differently"):
        check("chat", tokenizer)
