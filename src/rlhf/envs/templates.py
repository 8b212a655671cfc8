"""How an environment's observation becomes the text appended to a trajectory (`env.template`).

The agent loop keeps one growing token sequence per episode: the first observation (``first=True``) opens it, and
each later observation is appended right after the policy's action, whose last token is the generator's stop token
(`generator.stop_token`: the tokenizer's EOS unless named). Sampled tokens are never re-tokenised, so a later
observation's text must itself close the assistant turn where the stop token did not, and open the next one.

Templates:

- ``no``: the observation as is, on every turn (the environment writes its own formatting).
- ``qwen3_game`` / ``qwen3_general``: Qwen chat markup around a fixed instruction (a language game to win; a
  question to answer), with the answer asked for in ``\\boxed{}``, as in GEM's examples. Every turn is one user turn
  and an assistant header. Later turns assume the action ended a Qwen assistant turn: if the stop token is
  ``<|im_end|>`` (the EOS of Qwen's chat tokenizers) only the newline after it is written, else ``<|im_end|>\\n``.
- ``chat``: the tokenizer's own chat template. The first turn is ``[user: observation]`` with the generation
  prompt. A later turn is the text that the template writes after an assistant message and before the next
  assistant reply: rendered as the difference between a conversation (user, assistant) and the same conversation
  with the observation as a new user message and the generation prompt, minus the stop token the action already
  ends with. This assumes the template renders an earlier assistant message the same whether or not a later
  message follows (true of ChatML/Qwen, Llama 3 and most others); `check` refuses a template where it is not.

Texts may hold special tokens (``<|im_start|>``, a BOS written by the chat template): tokenise them without adding
special tokens.
"""

from __future__ import annotations

from rlhf.errors import ConfigError

TEMPLATES = ("no", "qwen3_game", "qwen3_general", "chat")

QWEN_END = "<|im_end|>"
_GAME_INSTRUCTION = "You are playing language games. Make valid actions to win.\nObservation: "
_QUESTION_INSTRUCTION = "Question: "
_ANSWER_FORMAT = "\nPlease reason step by step, and put your final answer within \\boxed{}."
# stands in for an action's text when rendering a conversation; letters only, so templates that trim keep it whole
_ACTION_PROBE = "ACTIONPROBE7F3A"


def render(template: str, observation: str, tokenizer, first: bool, stop_token: str | None = None) -> str:
    """The text appended for ``observation``: the trajectory's start (``first``) or what follows an action.

    ``stop_token`` is the text of the token that ends actions (`generator.stop_token`); None = the tokenizer's EOS.
    """
    if template == "no":
        return observation
    if template in ("qwen3_game", "qwen3_general"):
        instruction = _GAME_INSTRUCTION if template == "qwen3_game" else _QUESTION_INSTRUCTION
        turn = f"<|im_start|>user\n{instruction}{observation}{_ANSWER_FORMAT}{QWEN_END}\n<|im_start|>assistant\n"
        return turn if first else _qwen_closing(_stop_text(tokenizer, stop_token)) + turn
    if template == "chat":
        _require_chat_template(tokenizer)
        if first:
            return tokenizer.apply_chat_template(
                [{"role": "user", "content": observation}], tokenize=False, add_generation_prompt=True
            )
        return _chat_after_action(observation, tokenizer, _stop_text(tokenizer, stop_token))
    raise ConfigError(f"env.template={template!r} is not a template; choose one of {', '.join(TEMPLATES)}")


def check(template: str, tokenizer, stop_token: str | None = None) -> None:
    """Refuse, before any episode runs, a template name or a tokenizer that `render` cannot work with."""
    render(template, "observation", tokenizer, first=True, stop_token=stop_token)
    render(template, "observation", tokenizer, first=False, stop_token=stop_token)


def _stop_text(tokenizer, stop_token: str | None) -> str:
    """The text of the token that ends an action: ``stop_token``, else the tokenizer's EOS ("" when it has none)."""
    return stop_token if stop_token is not None else (tokenizer.eos_token or "")


def _qwen_closing(stop_text: str) -> str:
    """What closes a Qwen assistant turn after an action that ended with ``stop_text``."""
    return "\n" if stop_text == QWEN_END else QWEN_END + "\n"


def _require_chat_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "env.template=chat needs a tokenizer with a chat template, and this one has none; use a chat model, or "
            "env.template=qwen3_game, qwen3_general or no"
        )


def _chat_after_action(observation: str, tokenizer, stop_text: str) -> str:
    """The chat template's text between an assistant message's content and the next generation prompt's end."""
    try:
        return chat_after_reply([{"role": "user", "content": observation}], tokenizer, stop_text)
    except ValueError as err:
        raise ConfigError(f"env.template=chat: {err}; use env.template=qwen3_game, qwen3_general or no") from None


def chat_after_reply(messages: list[dict], tokenizer, stop_text: str, tools=None, chat_template=None) -> str:
    """The text a chat template writes after an assistant reply's content for the later ``messages``, up to the next
    generation prompt's end, minus the stop token the reply already ends with. ValueError for a template that renders
    an assistant message differently once a later message follows (nothing can then be appended after the sampled
    reply)."""
    history = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _ACTION_PROBE}]
    options = dict(tools=tools, chat_template=chat_template, tokenize=False)
    before = tokenizer.apply_chat_template(history, **options)
    after = tokenizer.apply_chat_template(history + list(messages), add_generation_prompt=True, **options)
    cut = before.rfind(_ACTION_PROBE) + len(_ACTION_PROBE)
    if cut < len(_ACTION_PROBE) or after[:cut] != before[:cut]:
        raise ValueError(
            "this tokenizer's chat template renders an assistant message differently once a later message follows, "
            "so later messages cannot be appended after the sampled reply"
        )
    tail = after[cut:]
    return tail[len(stop_text) :] if stop_text and tail.startswith(stop_text) else tail
