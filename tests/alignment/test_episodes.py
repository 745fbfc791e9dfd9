"""Multi-turn tool episodes (alignment/shared/episodes.py): an episode's tokens are, token for token, the chat
template's rendering of its transcript, with loss on the policy's own tokens alone (tool turns, headers and the first
messages are context); a malformed call is an observation and the episode goes on; episodes end on a final answer,
the turn limit or the token limit; every unfinished episode is sampled in one call per turn."""

from __future__ import annotations

import pytest
import torch

from alignment.shared.episodes import (
    Environment,
    episode_rows,
    episode_stats,
    generate_sampler,
    load_environment,
    run_episodes,
)
from data.tokenizer.base import TOOL_INSTRUCTIONS, load_tokenizer
from models.errors import ConfigError
from tests.data.tokenizer.test_hf_tokenizer import bpe_json, folder_with, masked_runs  # noqa: F401 (the fixture)

QUESTION = [{"role": "user", "content": "What is 12345 * 6789?"}]
TOOLS = [tool.schema() for tool in Environment.tools]  # the calculator
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12345 * 6789"}}\n</tool_call>'


@pytest.fixture(scope="module")
def smol(tmp_path_factory, bpe_json):  # noqa: F811
    """A tokenizer with SmolLM2-135M-Instruct's chat template (which writes no tools)."""
    return load_tokenizer(folder_with(tmp_path_factory.mktemp("smol"), bpe_json, "chatml-smollm2"))


def scripted(tokenizer, turns: list[str | list[str]], calls: list | None = None):
    """A sampler that writes ``turns`` in order (per row: a list of rows' texts), each encoded as the tokenizer
    encodes it and ended with its end-of-turn token unless it ends with "..." (cut off)."""
    queue = list(turns)

    def sample(rows, max_new_tokens):
        if calls is not None:
            calls.append(len(rows))
        texts = queue.pop(0)
        texts = texts if isinstance(texts, list) else [texts] * len(rows)
        out = []
        for text in texts:
            ids = tokenizer.encode(text, bos=False)
            out.append(ids if text.endswith("...") else ids + [tokenizer.eot_id])
        return out

    return sample


def test_an_episodes_tokens_are_the_templates_rendering_and_only_the_policys_carry_loss(smol):
    environment = Environment()
    sample = scripted(smol, [CALL, "The product is 83810205."])
    [episode] = run_episodes(
        environment, smol, [{"messages": QUESTION}], sample, max_turns=4, turn_tokens=64, episode_tokens=1024
    )
    assert episode.ended == "answer" and episode.answer == "The product is 83810205."
    assert [m["role"] for m in episode.messages] == ["user", "assistant", "tool", "assistant"]
    assert episode.messages[2]["content"] == "83810205"  # the calculator's observation
    prompt = smol.decode(episode.ids[: episode.prompt_len])  # the template writes no tools: the system turn has them
    assert TOOL_INSTRUCTIONS.split("\n")[0] in prompt and '"name": "calculator"' in prompt
    ids, mask = smol.encode_chat(episode.messages, tools=TOOLS)
    # the whole transcript as the template renders it, but for the newline it writes after the last turn
    assert episode.ids == ids[: len(episode.ids)] and smol.decode(ids[len(episode.ids) :]) == "\n"
    assert episode.policy == mask[: len(episode.ids)]  # token by token: the policy's turns, nothing else
    assert [smol.decode(run) for run in masked_runs(episode.ids, episode.policy)] == [
        CALL + "<|im_end|>",
        "The product is 83810205.<|im_end|>",
    ]
    assert episode.prompt_len == len(smol.encode_chat_prompt(episode.messages[:1], tools=TOOLS))
    assert (episode.turns, episode.tool_calls, episode.malformed_calls) == (2, 1, 0)


def test_a_malformed_call_is_an_observation_and_counted(smol):
    sample = scripted(smol, ["<tool_call>{not json</tool_call>", CALL, "83810205"])
    [episode] = run_episodes(
        Environment(), smol, [{"messages": QUESTION}], sample, max_turns=4, turn_tokens=64, episode_tokens=1024
    )
    assert episode.messages[2]["content"].startswith("error: the tool call is not JSON")
    assert (episode.ended, episode.answer, episode.tool_calls, episode.malformed_calls) == ("answer", "83810205", 2, 1)
    assert episode.policy == smol.encode_chat(episode.messages, tools=TOOLS)[1][: len(episode.ids)]


def test_episodes_end_on_the_turn_limit_and_the_token_limit_and_advance_together(smol):
    calls: list[int] = []
    # row 0 answers at once, row 1 calls forever (turn limit 2), row 2 is cut off inside its turn
    sample = scripted(smol, [["42", CALL, "I think..."], [CALL]], calls)
    prompts = [{"messages": QUESTION}] * 3
    episodes = run_episodes(Environment(), smol, prompts, sample, max_turns=2, turn_tokens=64, episode_tokens=1024)
    assert [e.ended for e in episodes] == ["answer", "turns", "tokens"]
    assert [e.answer for e in episodes] == ["42", "", "I think..."]
    assert episodes[2].messages[-1] == {"role": "assistant", "content": "I think..."}  # the cut turn, as judged
    assert calls == [3, 1]  # one sampling call per turn, every unfinished episode in it
    assert episode_stats(episodes)["ended_answer"] == pytest.approx(1 / 3)
    # room for the first turn but not for the observation after it: the episode ends there, on the token limit
    limit = episodes[0].prompt_len + len(smol.encode(CALL, bos=False)) + 1 + 2
    [short] = run_episodes(
        Environment(), smol, [{"messages": QUESTION}], scripted(smol, [CALL]), max_turns=4, turn_tokens=64,
        episode_tokens=limit,
    )  # fmt: skip
    assert (short.ended, short.turns, short.answer, short.tool_calls) == ("tokens", 1, "", 1) and len(short.ids) < limit


def test_the_default_sampler_batches_episodes_through_generate(smol):
    """On a real (random) model: each episode's policy tokens are what generate sampled, ended by a stop token or
    the turn's token limit."""
    from models.model import ModelConfig, Transformer

    torch.manual_seed(0)
    model = Transformer(ModelConfig(dim=32, n_layers=1, n_heads=2, vocab_size=smol.vocab_size, max_seq_len=2048))
    sample = generate_sampler(model.eval(), smol, torch.Generator().manual_seed(0), temperature=1.0)
    episodes = run_episodes(
        Environment(), smol, [{"messages": QUESTION}] * 4, sample, max_turns=3, turn_tokens=8, episode_tokens=2048
    )
    for episode in episodes:
        sampled = [t for t, p in zip(episode.ids, episode.policy) if p]
        assert 1 <= len(sampled) <= 8 * episode.turns and episode.ended in ("answer", "tokens", "turns")
        assert episode.ids[: episode.prompt_len] == smol.encode_chat_prompt(episode.messages[:1], tools=TOOLS)


class Echo(Environment):
    tools = ()


class FollowUp(Environment):
    """No tools: every turn but the third is answered with a user turn."""

    tools = ()

    def respond(self, episode, text):
        return None if episode.turns >= 3 else [{"role": "user", "content": f"And then? ({episode.turns})"}]


def ended_early(sample, eot: int):
    """``sample`` with each turn ended (its end-of-turn token appended) after at most 4 tokens: turns that end."""

    def wrapped(rows, max_new_tokens):
        return [tokens if eot in tokens else [*tokens[:4], eot] for tokens in sample(rows, max_new_tokens)]

    return wrapped


def test_each_turn_prefills_only_its_new_tokens_and_the_episodes_are_those_of_whole_prefills(smol):
    """The default sampler keeps each turn's prompts (``models.prefix_cache``): the next turn prefills only the
    policy's turn and the observation after it, and the greedy episodes are token for token those of a sampler
    that prefills every turn whole."""
    from models.generation import generate
    from models.model import ModelConfig, Transformer

    torch.manual_seed(0)
    model = Transformer(ModelConfig(dim=32, n_layers=2, n_heads=2, vocab_size=smol.vocab_size, max_seq_len=2048))
    prompts = [{"messages": [{"role": "user", "content": f"Count to {n}."}]} for n in (3, 12, 123)]
    limits = {"max_turns": 3, "turn_tokens": 8, "episode_tokens": 2048}
    kept = generate_sampler(model.eval(), smol, temperature=0.0)
    episodes = run_episodes(FollowUp(), smol, prompts, ended_early(kept, smol.eot_id), **limits)

    def whole(rows, max_new_tokens):
        out = generate(model, rows, max_new_tokens=max_new_tokens, temperature=0.0, stop_ids=smol.stop_ids)
        return [tokens[mask].tolist() for tokens, mask in zip(out.tokens, out.mask)]

    again = run_episodes(FollowUp(), smol, prompts, ended_early(whole, smol.eot_id), **limits)
    assert [e.ids for e in episodes] == [e.ids for e in again] and all(e.turns == 3 for e in episodes)
    # each turn's prompt ends where the policy's tokens of that turn start; turn t + 1 reuses turn t's prompt whole
    starts = [[i for i, p in enumerate(e.policy) if p and not e.policy[i - 1]] for e in episodes]
    assert kept.prefix_cache.reused_tokens == sum(s[0] + s[1] for s in starts)
    assert kept.prefix_cache.prefilled_tokens == sum(s[2] for s in starts)  # each token of the prompts once


def test_an_environment_is_named_by_import_path_and_bad_paths_name_the_key():
    assert isinstance(load_environment("tests.alignment.test_episodes:Echo", "env.name"), Echo)
    for path, message in [
        ("no_colon", "is not an import path"),
        ("no_such_module:Env", "cannot import 'no_such_module'"),
        ("json:dumps", "is not an Environment"),
    ]:
        with pytest.raises(ConfigError, match=f"^env.name: .*{message}"):
            load_environment(path, "env.name")


def test_episodes_become_rl_rows_with_the_mask_on_the_policys_tokens(smol):
    """``episode_rows``: the tokens before the first sampled one left-padded to P, the rest right-padded; the mask
    (what the RL loss, KL and entropy count) is exactly ``Episode.policy`` after the prompt."""
    sample = scripted(smol, [["42", CALL], ["83810205"]])
    episodes = run_episodes(
        Environment(), smol, [{"messages": QUESTION}] * 2, sample, max_turns=4, turn_tokens=64, episode_tokens=1024
    )
    input_ids, real, width, mask = episode_rows(episodes, smol.pad_id)
    assert width == max(e.prompt_len for e in episodes) and mask.shape[1] == input_ids.shape[1] - width
    for row, episode in enumerate(episodes):
        assert input_ids[row][real[row]].tolist() == episode.ids
        response = episode.policy[episode.prompt_len :]
        assert mask[row, : len(response)].tolist() == response and not mask[row, len(response) :].any()
    assert not all(episodes[1].policy[episodes[1].prompt_len :])  # the tool turn inside the row is context


class Chatty(Environment):
    """No tools and no final answer: every turn is followed up, so episodes end on their token limit."""

    tools = ()

    def respond(self, episode, text):
        return [{"role": "user", "content": "Go on."}]


def test_episodes_of_different_lengths_fill_their_rows_to_the_context_and_never_past_it(smol):
    """``episode_tokens`` equal to the model's context, first prompts of different lengths, turns of up to 64 tokens
    ended early: every turn's sampling calls fit the context (rows within a turn of their limit get calls of their
    own, by what they may still take), and every episode fits one row of ``episode_tokens`` once left-padded to the
    longest first prompt, as ``episode_rows`` pads them."""
    from models.model import ModelConfig, Transformer

    torch.manual_seed(0)
    model = Transformer(ModelConfig(dim=32, n_layers=1, n_heads=2, vocab_size=smol.vocab_size, max_seq_len=160))
    sample = generate_sampler(model.eval(), smol, temperature=0.0)
    budgets: list[int] = []

    def ended_after_11(rows, max_new_tokens):
        budgets.append(max_new_tokens)
        return [tokens if smol.eot_id in tokens else [*tokens[:11], smol.eot_id] for tokens in sample(rows, max_new_tokens)]  # fmt: skip

    questions = ["Hi.", "Tell me, at some length, how many lines a sonnet has and why that is so."]
    prompts = [{"messages": [{"role": "user", "content": q}]} for q in questions]
    episodes = run_episodes(Chatty(), smol, prompts, ended_after_11, max_turns=50, turn_tokens=64, episode_tokens=160)
    widest = max(e.prompt_len for e in episodes)
    assert all(e.ended == "tokens" for e in episodes) and min(e.turns for e in episodes) > 2
    assert all(len(e.ids) + widest - e.prompt_len <= 160 for e in episodes)
    assert any(len(e.ids) + widest - e.prompt_len > 160 - 12 for e in episodes)  # filled to within a turn
    input_ids, _, _, _ = episode_rows(episodes, smol.pad_id)
    assert input_ids.shape[1] <= 160 and min(budgets) < 64  # the last turns asked for less than a whole turn
