"""`generator.compile`: the hf generator's model under torch.compile samples what the eager one samples, follows
weight pushes and sleep/wake without compiling again, and is refused for a backend that does not read the key."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from rlhf.config import ConfigError, compose_config, validate
from rlhf.generators.base import SamplingParams
from rlhf.models.logprobs import window_logprobs

pytestmark = pytest.mark.slow  # compiling takes seconds

PROMPTS = ["1+1=", "12+34=", "5", "9+9+9+9=", "3+4=", "0=", "77+", "8+8=", "40+2=", "6", "123=", "2+2+2="]
GREEDY = SamplingParams(max_new_tokens=10, greedy=True)


def assert_same_rollout(a, b) -> None:
    """Equal tokens, masks and stop flags; logprobs within 1e-5."""
    for name in ("input_ids", "attention_mask", "loss_mask", "stopped"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    torch.testing.assert_close(a.gen_logp, b.gen_logp, atol=1e-5, rtol=0)


def test_compiled_generator_samples_what_the_eager_one_samples(make_generator, tiny_model_dir, other_model_dir, encode):
    """Greedy and seeded sampling on batches of several sizes (a single prompt too, and rows leaving as they stop)
    give the eager generator's tokens and logprobs; a second round of other batches, a weight push and a sleep/wake
    compile nothing more, and the compiled model answers with the pushed weights."""
    torch._dynamo.reset()  # graphs an earlier test compiled would be reused: this test compiles its own
    eager, compiled = make_generator(tiny_model_dir), make_generator(tiny_model_dir, compile=True, decode="eager")
    graphs = counters["stats"]["unique_graphs"]
    sampled = SamplingParams(max_new_tokens=10, temperature=1.3)

    def both(prompts, sampling):
        torch.manual_seed(7)
        want = eager.generate(encode(prompts), sampling)
        torch.manual_seed(7)
        assert_same_rollout(compiled.generate(encode(prompts), sampling), want)
        return want

    first = both(PROMPTS, GREEDY)
    assert first.stopped.any() and not first.stopped.all(), "rows should leave the batch at different steps"
    both(PROMPTS[:1], GREEDY)  # one row: dynamo specialises a batch of one, once
    both(PROMPTS, sampled)
    assert counters["stats"]["unique_graphs"] > graphs, "nothing was compiled"

    donor = make_generator(other_model_dir)
    with torch._dynamo.config.patch(error_on_recompile=True):  # other sizes and lengths, new weights: no new graph
        both(PROMPTS[3:10], GREEDY)
        both(PROMPTS[::-1][:5], sampled)
        for generator in (eager, compiled):
            generator.update_weights(donor.model.state_dict())
        after = both(PROMPTS, GREEDY)
        assert_same_rollout(after, donor.generate(encode(PROMPTS), GREEDY))
        for generator in (eager, compiled):
            generator.sleep()
            generator.update_weights(make_generator(tiny_model_dir).model.state_dict())
        both(PROMPTS[2:], GREEDY)
    expected, _ = window_logprobs(make_generator(tiny_model_dir).model, first, 1.0)
    torch.testing.assert_close(first.gen_logp, expected, atol=1e-4, rtol=0)


def test_generator_compile_is_refused_where_no_backend_reads_it(tiny_model_dir):
    with pytest.raises(ConfigError, match="generator.compile is not a key of generator vllm"):
        validate(compose_config([f"model.name_or_path={tiny_model_dir}", "generator=vllm", "generator.compile=true"]))
