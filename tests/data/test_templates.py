"""Chat templates: the built-ins, a user .jinja file, inline Jinja and the tokenizer's own, rendered exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlhf.data.mix import MixDatasetConfig, mixed_dataset
from rlhf.data.templates import BUILTIN_TEMPLATES, resolve_template, render_prompt
from rlhf.errors import ConfigError
from rlhf.models.tiny import build_char_tokenizer

# A fixed conversation: a system turn, a user turn, an assistant answer and a follow-up user turn.
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2+2="},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "3+3="},
]

# A user template as a file would hold it: one line per message, a trailing newline after the last tag.
USER_JINJA = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}\n"
)

# An inline template: role initial, content, a separator; `A:` starts the response.
INLINE_JINJA = (
    "{% for m in messages %}{{ m['role'][0] | upper }}: {{ m['content'] }} | {% endfor %}"
    "{% if add_generation_prompt %}A:{% endif %}"
)


@pytest.fixture
def tok():
    """A char tokenizer without a chat template of its own."""
    return build_char_tokenizer("0123456789+=")


def render(tokenizer, name: str) -> str:
    """The fixed conversation rendered with `dataset.chat_template=name`, with the generation prompt."""
    return render_prompt(tokenizer, CONVERSATION, resolve_template(name, tokenizer))


def test_builtin_names():
    """The built-in templates are exactly simple_concat_with_space and tulu."""
    assert sorted(BUILTIN_TEMPLATES) == ["simple_concat_with_space", "tulu"]


def test_simple_concat_with_space(tok):
    """Contents joined by single spaces; nothing marks the response and no EOS is added."""
    assert render(tok, "simple_concat_with_space") == "Be brief. 2+2= 4 3+3="


def test_simple_concat_without_generation_prompt_ends_with_eos(tok):
    """Without the generation prompt, the text ends with the tokenizer's EOS (a finished document)."""
    template = resolve_template("simple_concat_with_space", tok)
    text = tok.apply_chat_template(CONVERSATION, chat_template=template, add_generation_prompt=False, tokenize=False)
    assert text == "Be brief. 2+2= 4 3+3=<eos>"


def test_tulu(tok):
    """Each message after a `<|role|>` line; assistant turns end with EOS; `<|assistant|>` opens the response."""
    assert render(tok, "tulu") == (
        "<|system|>\nBe brief.\n"
        "<|user|>\n2+2=\n"
        "<|assistant|>\n4<eos>\n"
        "<|user|>\n3+3=\n"
        "<|assistant|>\n"
    )


def test_user_jinja_file(tok, tmp_path):
    """A `.jinja` path is read and rendered (Jinja trims the newline after the file's last block tag)."""
    path = tmp_path / "chat.jinja"
    path.write_text(USER_JINJA)
    assert render(tok, str(path)) == "[system] Be brief.\n[user] 2+2=\n[assistant] 4\n[user] 3+3=\n[assistant] "


def test_missing_jinja_file_errors(tok, tmp_path):
    """A `.jinja` path that does not exist names the key and says so."""
    missing = tmp_path / "nope.jinja"
    with pytest.raises(ValueError, match=rf"^dataset\.chat_template={missing}: no such file$"):
        resolve_template(str(missing), tok)


def test_inline_jinja(tok):
    """A string holding Jinja markup is the template itself."""
    assert render(tok, INLINE_JINJA) == "S: Be brief. | U: 2+2= | A: 4 | U: 3+3= | A:"


def test_tokenizer_uses_its_own_template(tok):
    """`tokenizer` resolves to the tokenizer's chat_template and renders with it."""
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    assert resolve_template("tokenizer", tok) == tok.chat_template
    assert render(tok, "tokenizer") == "<system>Be brief.<user>2+2=<assistant>4<user>3+3=>"


def test_tokenizer_without_template_errors(tok):
    """`tokenizer` with no template of its own says so and lists the alternatives."""
    assert getattr(tok, "chat_template", None) is None
    with pytest.raises(ValueError) as err:
        resolve_template("tokenizer", tok)
    message = str(err.value)
    assert message.startswith("dataset.chat_template=tokenizer but this tokenizer has no chat template")
    assert "simple_concat_with_space, tulu, a .jinja file, or an inline Jinja string" in message


@pytest.mark.parametrize("name", ["chatml", "Tulu", "templates/chat.j2"])
def test_unknown_name_errors(tok, name):
    """A name that is no template names `dataset.chat_template` and the accepted forms."""
    with pytest.raises(ValueError) as err:
        resolve_template(name, tok)
    assert str(err.value) == (
        f"dataset.chat_template={name!r} is not `tokenizer`, a built-in template (simple_concat_with_space, tulu), "
        "a .jinja file or an inline Jinja string"
    )


def test_rendered_text_does_not_depend_on_vocabulary(tok):
    """The same template renders the same text for tokenizers with different alphabets."""
    wide = build_char_tokenizer("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+=.|<>[]: \n")
    for name in ("simple_concat_with_space", "tulu", INLINE_JINJA):
        assert render(wide, name) == render(tok, name)
    text = render(wide, "tulu")
    ids = wide(text, add_special_tokens=False)["input_ids"]
    assert wide.unk_token_id not in ids, "the wide alphabet covers every character of the tulu prompt"
    assert wide.decode(ids) == text


def test_a_jinja_file_with_a_syntax_error_names_the_key(tok, tmp_path):
    """A .jinja file cut short was Jinja's TemplateSyntaxError; now a config error with Jinja's reason and line."""
    path = tmp_path / "bad.jinja"
    path.write_text("{% for m in messages %}{{ m.content ")
    with pytest.raises(ConfigError) as err:
        resolve_template(str(path), tok)
    message = str(err.value)
    assert message.startswith(
        f"dataset.chat_template={path} fails on a one-message example conversation (TemplateSyntaxError at line 1: "
    )
    assert message.endswith("fix the template (Jinja over `messages`, a list of {role, content}, and "
                            "`add_generation_prompt`) or choose tokenizer, simple_concat_with_space, tulu")
    assert "\n" not in message


def test_an_inline_template_calling_an_unknown_function_names_the_key(tok):
    """`{{ nope(1) }}` compiles but fails to render: UndefinedError, named with the key."""
    with pytest.raises(ConfigError) as err:
        resolve_template("{{ nope(1) }}", tok)
    assert str(err.value).startswith(
        "dataset.chat_template='{{ nope(1) }}' fails on a one-message example conversation (UndefinedError: "
        "'nope' is undefined); fix the template"
    )


def test_a_template_failing_on_one_row_names_the_row(tok, tmp_path, monkeypatch):
    """A template that renders the example but not a row's conversation names the file and the row's line."""
    monkeypatch.chdir(tmp_path)
    Path("p.jsonl").write_text('{"prompt": "1+1="}\n{"prompt": "2+2="}\n')
    template = "{% if messages[0]['content'] == '2+2=' %}{{ 1 + 'a' }}{% endif %}{{ messages[0]['content'] }}"
    cfg = OmegaConf.structured(MixDatasetConfig(name="mix", path="p.jsonl", chat_template=template, cache_dir="cache"))
    with pytest.raises(ConfigError) as err:
        mixed_dataset(cfg, tok, 1)
    message = str(err.value)
    assert message.startswith(  # inline Jinja is shown quoted, cut at 60 characters
        """dataset.chat_template="{% if messages[0]['content'] == '2+2=' %}{{ 1 + 'a' }}{% ..." fails on p.jsonl line 2 """
        "(TypeError: "
    )
