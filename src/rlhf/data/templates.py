"""Chat templates: turn a conversation (a list of {role, content}) into the prompt text the policy sees.

`dataset.chat_template` is `tokenizer` (the tokenizer's own template), a built-in name below, a path to
a `.jinja` file, or an inline Jinja string. Templates are rendered by the tokenizer's
`apply_chat_template`, with `add_generation_prompt=True` so the prompt ends where the response starts.
"""

from __future__ import annotations

from pathlib import Path

from jinja2 import TemplateError

from rlhf.errors import ConfigError

# One space between message contents; nothing marks the response (TL;DR-style completion prompts).
SIMPLE_CONCAT_WITH_SPACE = (
    "{% for m in messages %}{% if not loop.first %} {% endif %}{{ m['content'] }}{% endfor %}"
    "{% if not add_generation_prompt %}{{ eos_token }}{% endif %}"
)

# Tulu's role markers: `<|role|>` on its own line before each message; assistant turns end with EOS.
TULU = (
    "{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>\\n' + m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

BUILTIN_TEMPLATES = {"simple_concat_with_space": SIMPLE_CONCAT_WITH_SPACE, "tulu": TULU}

EXAMPLE_CONVERSATION = [{"role": "user", "content": "What is 1+1?"}]  # what every template must render

# The roles of Hugging Face's chat-template conversations; a template may drop a message of any other role without a
# word (Qwen2.5's does), so a dataset row with one is a bad row, unless it is one of the roles some templates add
# (OpenAI's developer, Llama 3.1's ipython) and the chosen template renders it.
CHAT_ROLES = ("system", "user", "assistant", "tool")
TEMPLATE_ROLES = ("developer", "ipython")
_PROBE = "rlhf-role-probe"  # the content of the probe message whose role is asked about


def renders_role(tokenizer, template: str, role: str) -> bool:
    """Whether ``template`` shows a message of ``role`` (one of `TEMPLATE_ROLES`): a conversation of that message and
    a user's renders with the message's content in it (a template that does not know the role drops it, or refuses)."""
    conversation = [{"role": role, "content": _PROBE}, {"role": "user", "content": "x"}]
    try:
        text = tokenizer.apply_chat_template(conversation, chat_template=template, add_generation_prompt=True, tokenize=False)
    except (TemplateError, TypeError, ValueError):
        return False
    return _PROBE in text


def _shown(name: str) -> str:
    """`dataset.chat_template`'s value as a message shows it: a name or path as is, inline Jinja quoted and cut short."""
    if "{{" in name or "{%" in name:
        return repr(name if len(name) <= 60 else name[:57] + "...")
    return name


def _template_error(name: str, where: str, err: Exception) -> ConfigError:
    """The error for a template that fails to compile or render on ``where``, with Jinja's own reason and line."""
    why = " ".join(str(getattr(err, "message", None) or err).split())
    line = f" at line {err.lineno}" if getattr(err, "lineno", None) else ""
    return ConfigError(
        f"dataset.chat_template={_shown(name)} fails on {where} ({type(err).__name__}{line}: {why}); fix the template "
        f"(Jinja over `messages`, a list of {{role, content}}, and `add_generation_prompt`) or choose tokenizer, "
        f"{', '.join(BUILTIN_TEMPLATES)}"
    )


def resolve_template(name: str, tokenizer) -> str:
    """The Jinja source for `dataset.chat_template`, checked: it compiles and renders a one-message conversation."""
    template = _template_source(name, tokenizer)
    render_prompt(tokenizer, EXAMPLE_CONVERSATION, template, name=name, where="a one-message example conversation")
    return template


def _template_source(name: str, tokenizer) -> str:
    """The Jinja source `dataset.chat_template` names (unchecked)."""
    if name == "tokenizer":
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise ValueError(
                "dataset.chat_template=tokenizer but this tokenizer has no chat template; choose "
                f"{', '.join(BUILTIN_TEMPLATES)}, a .jinja file, or an inline Jinja string"
            )
        return template
    if name in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[name]
    if name.endswith(".jinja"):
        path = Path(name).expanduser()
        if not path.is_file():
            raise ValueError(f"dataset.chat_template={name}: no such file")
        return path.read_text()
    if "{{" in name or "{%" in name:
        return name
    raise ValueError(
        f"dataset.chat_template={name!r} is not `tokenizer`, a built-in template ({', '.join(BUILTIN_TEMPLATES)}), "
        "a .jinja file or an inline Jinja string"
    )


def render_prompt(tokenizer, messages: list[dict[str, str]], template: str, name: str = "", where: str = "") -> str:
    """The prompt text for ``messages``, ending with the template's generation prompt. A template that fails is a
    ConfigError naming `dataset.chat_template` (``name``, its value) and ``where`` (the conversation's row)."""
    try:
        return tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True, tokenize=False)
    except (TemplateError, TypeError) as err:  # a syntax error, an undefined name, a wrong operation on a value
        raise _template_error(name or template, where or "a conversation", err) from None


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of a rendered prompt; the tokenizer adds its special tokens (BOS) unless the text already has them."""
    bos = tokenizer.bos_token
    return tokenizer(text, add_special_tokens=not (bos and text.startswith(bos)))["input_ids"]
