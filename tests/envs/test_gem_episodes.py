"""GEM's GuessTheNumber through the agent loop and through the CLI: masks, turn rewards and returns of recorded
trajectories checked against the game's secret (the CLI run is in tests/e2e/test_env_cli.py)."""

from __future__ import annotations

import string

import pytest
import torch

from rlhf.envs.gem import GemConfig
from rlhf.envs.gem import GemMaker
from rlhf.envs.loop import EpisodeRunner
from rlhf.envs.rows import episode_rows
from rlhf.functional import rebn_advantages
from rlhf.generators.base import SamplingParams
from rlhf.models.tiny import build_char_tokenizer, build_tiny_llama
from rlhf.trajectory import from_completions

GUESS = "game:GuessTheNumber-v0-easy"  # a secret in 1..10, 4 guesses
ALPHABET = string.ascii_letters + string.digits + string.punctuation + " \n"


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer(ALPHABET)


@pytest.fixture(scope="module")
def maker():
    return GemMaker(cfg=GemConfig(name="gem", id=GUESS, template="no", max_tokens=256), tokenizer=None, rewards=None)


class CountingUp:
    """A scripted policy (the game is what is under test): guess 1, then 2, ... one more than the guesses so far
    (counted in the game's hints, "At turn k, you guessed ...")."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def generate(self, prompts, sampling):
        texts = [f"\\boxed{{{self.tokenizer.decode(p).count('you guessed') + 1}}}" for p in prompts]
        actions = [self.tokenizer(t, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id] for t in texts]
        width = max(map(len, actions))
        ids = torch.tensor([a + [0] * (width - len(a)) for a in actions])
        mask = torch.tensor([[1.0] * len(a) + [0.0] * (width - len(a)) for a in actions])
        query_width = max(map(len, prompts))
        query = torch.tensor([[0] * (query_width - len(p)) + p for p in prompts])
        return from_completions(query, (query != 0).long(), ids, mask, -0.5 * mask, torch.ones(len(prompts), dtype=torch.bool))


def expected_rewards(secret: int) -> list[float]:
    """GuessTheNumber's rewards for guesses 1, 2, ...: 0 per wrong guess, 1 when right, partial credit after 4."""
    if secret <= 4:
        return [0.0] * (secret - 1) + [1.0]
    return [0.0, 0.0, 0.0, 1 - abs(4 - secret) / 9]


def test_guess_the_number_rows_have_the_games_rewards_and_masks(maker, tokenizer):
    cfg = GemConfig(name="gem", id=GUESS, template="no", max_turns=4, max_tokens=4096)
    runner = EpisodeRunner(maker, cfg, tokenizer, tokenizer.eos_token_id)
    seeds = list(range(10))
    episodes = runner.run(CountingUp(tokenizer), [None] * 10, seeds, 2, SamplingParams(16))
    secrets = {}
    for seed in seeds:
        env = maker.make(None)
        env.reset(seed)
        secrets[seed] = env.env.unwrapped.game_number
    assert len(set(secrets.values())) > 3
    batch = episode_rows(episodes, "sum", tokenizer.pad_token_id)
    for row, ep in enumerate(episodes):
        rewards = expected_rewards(secrets[ep.seed])
        assert [t.reward for t in ep.turns] == pytest.approx(rewards)
        assert ep.success == (secrets[ep.seed] <= 4)
        assert batch.scores[row].item() == pytest.approx(sum(rewards))
        # every turn's action (\boxed{k} + EOS) is trained; the game's hints between them are not
        window = batch.window_ids[row]
        trained = tokenizer.decode(window[batch.loss_mask[row].bool()])
        assert trained == "".join(f"\\boxed{{{k}}}<eos>" for k in range(1, len(rewards) + 1))
        hints = tokenizer.decode(window[(batch.loss_mask[row] == 0) & (batch.attention_mask[row, batch.window_start :] == 1)])
        assert hints.count("higher") == len(rewards) - 1  # counting up from 1, every wrong guess is too low
    # per-turn credit: a turn's return is the discounted win (or partial credit) that follows it
    advantages = rebn_advantages(batch.turn_rewards, batch.loss_mask, gamma=0.9)
    assert advantages.shape == batch.loss_mask.shape and (advantages[batch.loss_mask == 0] == 0).all()
