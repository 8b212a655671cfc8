"""A reward function that gives every response the same non-dyadic score (no signal), for tests/algorithms."""


def seven_tenths(prompts, responses, ground_truths, **_) -> list[float]:
    return [0.7] * len(responses)
