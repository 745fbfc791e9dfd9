"""Multi-turn tool episodes: an ``Environment`` gives a task's first messages and its tools, and answers each policy
turn with the tools' observations; ``run_episodes`` advances every episode of a rollout together, one batched
sampling call per turn. An episode ends on a final answer (a turn without a tool call), the turn limit or the token
limit. Only the tokens the policy sampled carry loss (``Episode.policy``): the first messages, the template's
headers and every observation are context. docs/tools.md says how an environment is written and named.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from alignment.shared.rewards import import_named
from alignment.shared.tools import CALCULATOR, Tool, parse_tool_calls, run_tool_call
from models.errors import ConfigError


class Environment:
    """A task's first messages and tools, and the answer to each policy turn. Subclass it in one file and name the
    class in the config (``module:Class``); the defaults: the prompt's own messages, the calculator, and a turn
    without a tool call is the final answer. A subclass keeps an episode's turn state in ``Episode.state`` (an
    episode ends within its rollout's step, so it never spans a checkpoint) and draws from ``self.rng``, whose
    state the run's checkpoints hold."""

    tools: tuple[Tool, ...] = (CALCULATOR,)

    def __init__(self) -> None:  # a subclass's own __init__ takes no arguments and calls this one
        self.rng = random.Random(0)  # seeded with run.seed by the run; its state is part of the run's checkpoints

    def first_messages(self, prompt: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The conversation the episode starts from (a prompt of ``data.records.prompts``)."""
        return [dict(message) for message in prompt["messages"]]

    def respond(self, episode: Episode, text: str) -> list[dict[str, Any]] | None:
        """The messages that answer the policy's turn ``text`` (one tool turn per call, a malformed call's error
        included), or None: ``text`` is the final answer."""
        calls = parse_tool_calls(text)
        if not calls:
            return None
        tools = {tool.name: tool for tool in self.tools}
        episode.tool_calls += len(calls)
        episode.malformed_calls += sum(bool(call.error) for call in calls)
        return [{"role": "tool", "name": call.name, "content": run_tool_call(call, tools)} for call in calls]


@dataclass
class Episode:
    """One episode: its transcript, every token as the policy read and wrote them, and how it went."""

    prompt: Mapping[str, Any]
    messages: list[dict[str, Any]]
    ids: list[int]
    policy: list[bool]  # True on the tokens the policy sampled: the only ones that carry loss
    prompt_len: int  # tokens before the first sampled one
    turns: int = 0  # policy turns
    tool_calls: int = 0
    malformed_calls: int = 0
    ended: str = ""  # "answer" | "turns" (turn limit) | "tokens" (token limit, or a turn cut off)
    answer: str = ""  # the final answer: what the reward terms judge ("" when the episode ended without one)
    state: dict[str, Any] = field(default_factory=dict)  # the environment's own turn state for this episode
    opening: int = 0  # how many of ``messages`` are the environment's first messages


# (rows of token ids, max new tokens) -> each row's sampled tokens, its stop token last when it stopped
Sampler = Callable[[list[list[int]], int], list[list[int]]]


def start_episode(environment: Environment, tokenizer: Any, prompt: Mapping[str, Any]) -> Episode:
    messages = environment.first_messages(prompt)
    ids = tokenizer.encode_chat_prompt(messages, tools=schemas(environment))
    return Episode(prompt, messages, ids, [False] * len(ids), len(ids), opening=len(messages))


def schemas(environment: Environment) -> list[dict[str, Any]] | None:
    return [tool.schema() for tool in environment.tools] or None


def observation_ids(
    tokenizer: Any, messages: list[dict[str, Any]], answer: list[dict[str, Any]], tools: Any
) -> list[int]:
    """The tokens after the policy's last end-of-turn token up to the next turn's generation prompt, as the chat
    template renders ``messages`` (ending with the policy's turn) followed by the ``answer`` messages."""
    through, mask = tokenizer.encode_chat(messages, tools=tools)
    after = tokenizer.encode_chat_prompt([*messages, *answer], tools=tools)
    if after[: len(through)] != through:
        raise ValueError(
            "the chat template renders a conversation's earlier turns differently once tool turns follow them: a "
            "multi-turn episode's tokens would not be what the policy read"
        )
    last = max(index for index, masked in enumerate(mask) if masked)  # the policy's end-of-turn token
    return after[last + 1 :]


def run_episodes(
    environment: Environment,
    tokenizer: Any,
    prompts: Sequence[Mapping[str, Any]],
    sample: Sampler,
    *,
    max_turns: int,
    turn_tokens: int,
    episode_tokens: int,
) -> list[Episode]:
    """Every prompt's episode, advanced together: each turn samples the unfinished episodes in one ``sample`` call
    (at most ``turn_tokens`` new tokens each). As rows of one RL batch the episodes are left-padded to the longest
    first prompt (``episode_rows``), so an episode holds at most ``episode_tokens`` less its padding there: every
    row fits ``episode_tokens``. Rows within a turn of their limit are sampled in calls of their own, by what they
    may still take, so that no call's longest row plus its budget passes ``episode_tokens`` either."""
    episodes = [start_episode(environment, tokenizer, prompt) for prompt in prompts]
    tools = schemas(environment)
    stops = set(tokenizer.stop_ids)
    widest = max((episode.prompt_len for episode in episodes), default=0)
    limit = {id(episode): episode_tokens - (widest - episode.prompt_len) for episode in episodes}
    active = []
    for episode in episodes:
        if len(episode.ids) < limit[id(episode)]:
            active.append(episode)
        else:  # the first messages alone fill the episode
            episode.ended = "tokens"
    while active:
        by_budget: dict[int, list[Episode]] = {}
        for episode in active:
            by_budget.setdefault(min(turn_tokens, limit[id(episode)] - len(episode.ids)), []).append(episode)
        sampled: dict[int, list[int]] = {}
        for budget, rows in sorted(by_budget.items(), reverse=True):  # most rows first: those with a whole turn
            sampled.update(zip(map(id, rows), sample([episode.ids for episode in rows], budget)))
        still = []
        for episode in active:
            tokens = sampled[id(episode)][: limit[id(episode)] - len(episode.ids)]
            episode.ids += tokens
            episode.policy += [True] * len(tokens)
            episode.turns += 1
            text = tokenizer.decode([token for token in tokens if token not in stops])
            episode.messages.append({"role": "assistant", "content": text})  # a turn cut off too: it was judged
            if not tokens or tokens[-1] not in stops:  # cut off inside the turn
                episode.ended, episode.answer = "tokens", text
                continue
            answer = environment.respond(episode, text)
            if answer is None:
                episode.ended, episode.answer = "answer", text
            elif episode.turns >= max_turns:
                episode.ended = "turns"
            else:
                context = observation_ids(tokenizer, episode.messages, answer, tools)
                if len(episode.ids) + len(context) >= limit[id(episode)]:
                    episode.ended = "tokens"
                    continue
                episode.messages += answer
                episode.ids += context
                episode.policy += [False] * len(context)
                still.append(episode)
        active = still
    return episodes


def generate_sampler(model: Any, tokenizer: Any, generator: Any = None, **sampling: Any) -> Sampler:
    """``run_episodes``' sampler through ``models.generation.generate`` (its shared-prefix prefill and compiled decode
    included): ``sampling`` is generate's temperature, top_k, top_p, decode. Each turn's prompts keep their keys and
    values for the next turn, which prefills only the policy's turn and the observations after them
    (``models.prefix_cache``; the sampler's ``prefix_cache``)."""
    from models.generation import generate
    from models.prefix_cache import PrefixCache

    cache = PrefixCache()

    def sample(rows: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        out = generate(
            model, rows, max_new_tokens=max_new_tokens, stop_ids=tokenizer.stop_ids, pad_id=tokenizer.pad_id,
            generator=generator, prefix_cache=cache, **sampling,
        )  # fmt: skip
        return [tokens[mask].tolist() for tokens, mask in zip(out.tokens, out.mask)]

    sample.prefix_cache = cache  # type: ignore[attr-defined]  (how much of each turn's prompts was reused)
    return sample


def episode_rows(episodes: Sequence[Episode], pad_id: int) -> tuple[Tensor, Tensor, int, Tensor]:
    """(input_ids, real, P, mask) of episodes as an RL rollout's rows: each episode's tokens before its first sampled
    one left-padded to P, the rest right-padded; ``mask`` (B, N) True on the policy's sampled tokens alone."""
    width = max(e.prompt_len for e in episodes)
    length = max(len(e.ids) - e.prompt_len for e in episodes)
    input_ids = torch.full((len(episodes), width + length), pad_id, dtype=torch.long)
    real = torch.zeros_like(input_ids, dtype=torch.bool)
    mask = torch.zeros(len(episodes), length, dtype=torch.bool)
    for row, e in enumerate(episodes):
        start, end = width - e.prompt_len, width + len(e.ids) - e.prompt_len
        input_ids[row, start:end] = torch.tensor(e.ids)
        real[row, start:end] = True
        mask[row, : len(e.ids) - e.prompt_len] = torch.tensor(e.policy[e.prompt_len :], dtype=torch.bool)
    return input_ids, real, width, mask


def episode_stats(episodes: Sequence[Episode]) -> dict[str, float]:
    """Means per episode: turns, tool calls, malformed calls, tokens, and how episodes ended."""
    count = max(len(episodes), 1)
    stats = {
        "turns": sum(e.turns for e in episodes) / count,
        "tool_calls": sum(e.tool_calls for e in episodes) / count,
        "malformed_calls": sum(e.malformed_calls for e in episodes) / count,
        "episode_tokens": sum(len(e.ids) for e in episodes) / count,
    }
    for reason in ("answer", "turns", "tokens"):
        stats[f"ended_{reason}"] = sum(e.ended == reason for e in episodes) / count
    return stats


def load_environment(path: str, key: str) -> Environment | None:
    """The environment ``path`` ("package.module:Class", or an instance's name) names, made with no arguments;
    nothing in the config runs; None for "". Errors name ``key``."""
    if not path:
        return None
    if not path.partition(":")[2].isidentifier():
        raise ConfigError(f"{key}: {path!r} is not an import path of the form 'package.module:Class'")
    found = import_named(path, key, "Class")
    if isinstance(found, type) and issubclass(found, Environment):
        return found()
    if isinstance(found, Environment):
        return found
    raise ConfigError(f"{key}: {path} is not an Environment (a subclass of alignment.shared.episodes.Environment)")
