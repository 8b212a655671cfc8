"""Final answers as math datasets write them, for `dataset.ground_truth_format`.

GSM8K ends each worked answer with `#### 1,234`; MATH puts it in the solution's last `\\boxed{...}`, whose
braces may nest (`\\boxed{\\frac{1}{2}}`). A verifier compares a response with the extracted string, not the
whole text.
`with_suffix` adds the instruction that asks a model for its answer in such a format.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

GSM8K_MARK = "####"
BOXED = "\\boxed{"


def boxed_contents(text: str) -> list[str | None]:
    """The text in each top-level ``\\boxed{...}`` of ``text`` (nested braces kept); None if never closed."""
    contents: list[str | None] = []
    start = text.find(BOXED)
    while start != -1:
        depth, end = 1, start + len(BOXED)
        while end < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            end += 1
        contents.append(text[start + len(BOXED) : end - 1] if depth == 0 else None)
        start = text.find(BOXED, end)
    return contents


def gsm8k_answer(text: str) -> Optional[str]:
    """The text after the last `####`, thousands separators dropped ("1,234" -> "1234"); None when none."""
    if GSM8K_MARK not in text:
        return None
    answer = text.rpartition(GSM8K_MARK)[2].strip().replace(",", "")
    return answer or None


def last_boxed(text: str) -> Optional[str]:
    """The contents of the last `\\boxed{...}`, nested braces kept; None when there is none or it never closes."""
    boxes = boxed_contents(text)
    answer = boxes[-1].strip() if boxes and boxes[-1] is not None else ""
    return answer or None


def raw_answer(value: Any) -> Any:
    """The column's value as it is."""
    return value


GROUND_TRUTH_FORMATS: dict[str, Callable[[Any], Any]] = {
    "raw": raw_answer, "gsm8k": gsm8k_answer, "boxed": last_boxed, "json": raw_answer,
}


def with_suffix(messages: list[dict[str, str]], suffix: str | None) -> list[dict[str, str]]:
    """``messages`` with ``suffix`` (e.g. the answer format to use) after the last message's text, space-separated."""
    if not suffix:
        return messages
    return messages[:-1] + [{**messages[-1], "content": f"{messages[-1]['content']} {suffix}"}]
