"""Fixtures the alignment tests share: a tiny SFT-like policy, a reward model over it, and demo prompts."""

from pathlib import Path

import pytest
import torch
from torch import nn

from alignment.shared.episodes import Environment
from data.demo.tasks import write_demo_dataset
from data.tokenizer.tokenizer import Tokenizer
from models.formats.checkpoint import save_checkpoint
from models.heads import ScalarModel, save_scalar_model
from models.model import ModelConfig, Transformer

TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=4096, multiple_of=32, max_seq_len=256)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    """A tiny SFT-like policy and a reward model over it, saved as the stages would, plus demo prompts."""
    root = tmp_path_factory.mktemp("ppo")
    tokenizer = Tokenizer.load("default")
    torch.manual_seed(0)
    policy = Transformer(ModelConfig(**TINY))
    for p in policy.parameters():  # less flat than the 0.02 init: some tokens are sampled often enough to learn
        if p.ndim == 2:
            nn.init.normal_(p, std=0.08)
    nn.init.normal_(policy.output.weight, std=0.4)
    policy_dir = save_checkpoint(policy, root / "sft", tokenizer_path=tokenizer.path)
    reward_dir = save_scalar_model(
        ScalarModel.from_backbone(policy),
        root / "rm",
        tokenizer_path=tokenizer.path,
        metadata={"reward_mean": 0.1, "reward_std": 2.0},
    )
    demo = write_demo_dataset(root / "demo", n_train=20, n_val=40, n_pairs=10, seed=0)
    return {
        "root": root,
        "policy": policy_dir,
        "reward": reward_dir,
        "prompts": demo["prompts"],
        "train_prompts": demo["train_prompts"],
        "tokenizer": tokenizer,
    }


# ---- multi-turn episodes on the tiny policy ----


class AskAgain(Environment):
    """No tools: answers the policy's first turn with a user turn drawn from its own ``rng`` (so a resume must restore
    it), and takes the second as the final answer. Every episode that is not cut off has two policy turns, the second
    after context the policy did not write."""

    tools = ()

    def respond(self, episode, text):
        if episode.turns > 1:
            return None
        return [{"role": "user", "content": self.rng.choice(["Once more, briefly.", "Again, in other words."])}]


@pytest.fixture
def turns_that_end(monkeypatch):
    """The tiny policy seldom samples its end-of-turn token within a turn's limit, so each of its turns is ended
    after half the limit (the token appended, as if sampled): episodes then reach their second turn."""
    from alignment.stages import rl_module

    real = rl_module.generate_sampler

    def sampler(model, tokenizer, generator=None, **sampling):
        inner = real(model, tokenizer, generator, **sampling)

        def sample(rows, max_new_tokens):
            ended = []
            for tokens in inner(rows, max_new_tokens):
                stop = next((i for i, t in enumerate(tokens) if t in tokenizer.stop_ids), None)
                ended.append(tokens if stop is not None else [*tokens[: max_new_tokens // 2], tokenizer.eot_id])
            return ended

        return sample

    monkeypatch.setattr(rl_module, "generate_sampler", sampler)
