"""Rewards and checkers: what a sampling stage optimises, and the ground truth it measures answers against,
both named in the config, never known to the stage.

A checker is a plain function ``f(record, answer) -> float | None``: ``record`` is a prompt row as the data
files hold it (the demo's rows carry ``task`` and ``meta``), ``answer`` the decoded response; it returns a
score in [0, 1] (1: correct), or None when it cannot judge that record (which is then left out of the mean).

Configs name a checker by import path, ``"package.module:function"`` (the demo's is
``data.demo.scoring:score_example``), so that the demo is one checker among others and a user's own is one
line of YAML. Nothing is evaluated from the string: it is split at ':' and looked up with ``importlib``.

A reward (``Reward``, built from a config's ``reward.terms`` by ``build_reward``) is a weighted sum of terms: a
frozen reward model (normalised by its exported mean / std), a checker (a verifiable reward) or exact match
against the prompt's reference. PPO, GRPO and rejection sampling all score responses through it.
"""

from __future__ import annotations

import functools
import importlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from models.errors import ConfigError, DataError, one_line
from models.generation import flex_bucketed, ids_and_positions
from models.heads import ScalarModel, gather_last, load_scalar_model

Checker = Callable[[dict[str, Any], str], "float | None"]


def import_named(path: str, key: str, form: str) -> Any:
    """What ``path`` ("package.module:name") names, None if its module has no such name; a ConfigError naming
    ``key`` for a path not of that form (``form``: the name's kind in the message) or a module that does not import.
    Nothing of the config runs: the module is imported, the name looked up."""
    module_name, _, name = path.partition(":")
    if not module_name or not name or not all(part.isidentifier() for part in module_name.split(".")):
        raise ConfigError(f"{key}: {path!r} is not an import path of the form 'package.module:{form}'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(f"{key}: cannot import {module_name!r} ({error})") from error
    return getattr(module, name, None)


def load_checker(path: str, key: str) -> Checker | None:
    """The function ``path`` ("module:function") names, or None for an empty path. Errors name ``key``."""
    if not path:
        return None
    module_name, _, function_name = path.partition(":")
    checker = import_named(path, key, "function")
    if not callable(checker):
        raise ConfigError(f"{key}: {module_name!r} has no function {function_name!r}")

    @functools.wraps(checker)
    def named(record: dict[str, Any], answer: str) -> float | None:
        try:
            return checker(record, answer)
        except Exception as error:  # a bug of the user's checker: stop, saying whose and on which row
            row = json.dumps(record, default=str)
            row = row if len(row) <= 160 else row[:157] + "..."
            raise DataError(
                f"{key} {path} raised {type(error).__name__} ({one_line(error)[:200]}) on the row {row} and the "
                f"answer {answer[:80]!r}"
            ) from error

    return named


def normalize_reward(reward: Tensor, metadata: dict[str, Any], eps: float = 1e-6) -> Tensor:
    """(reward - mean) / std with a reward model's exported statistics; unchanged when it has none."""
    if "reward_mean" not in metadata:
        return reward
    return (reward - metadata["reward_mean"]) / max(float(metadata["reward_std"]), eps)


def exact_match_score(prompt: dict[str, Any], answer: str) -> float | None:
    """1.0 when ``answer`` equals the prompt's reference answer (stripped), 0.0 when not; None without one."""
    reference = prompt.get("reference")
    return None if reference is None else float(answer.strip() == str(reference).strip())


class RewardModelScore:
    """A frozen reward model scoring prompt + response rows at their last real token, normalised by the mean and
    std it exported (``normalize_reward``), so one unit means one training-set standard deviation."""

    def __init__(self, model: ScalarModel, stats: dict[str, float], path: str) -> None:
        self.model, self.stats, self.path = model.eval().requires_grad_(False), stats, path

    def place(self, device: torch.device, dtype: torch.dtype) -> None:
        self.model = self.model.to(device=device, dtype=dtype)

    @torch.no_grad()
    def __call__(self, input_ids: Tensor, real: Tensor) -> Tensor:
        device = next(self.model.parameters()).device  # may be the CPU while the policy is on a GPU
        # under FlexAttention, rows padded to a length bucket: few lengths for its compiled kernel
        ids, real = flex_bucketed(getattr(self.model, "config", None), input_ids.to(device), real.to(device))
        document_ids, position_ids = ids_and_positions(real)
        scores = self.model(ids, position_ids=position_ids, document_ids=document_ids)
        return normalize_reward(gather_last(scores, real).float(), self.stats).to(input_ids.device)


@dataclass
class RewardTerm:
    name: str  # how its scores are logged: "reward_model", "exact_match" or the checker's import path
    weight: float
    tokens: Callable[[Tensor, Tensor], Tensor] | None = None  # scores (input_ids, real) token rows
    judge: Callable[[dict[str, Any], str], float | None] | None = None  # scores (prompt dict, answer text)


class Reward:
    """The one reward every sampling stage uses: a weighted sum of terms, each a reward model, a checker or exact
    match. ``score`` returns the total and each term's scores; a checker that cannot judge a prompt (None)
    scores 0 there, and ``unjudged`` counts how often that happened."""

    def __init__(self, terms: list[RewardTerm]) -> None:
        if not terms:
            raise ConfigError("reward.terms is empty: name at least one reward (reward_model, checker or exact_match)")
        self.terms = terms
        self.unjudged = 0

    @property
    def models(self) -> list[RewardModelScore]:
        return [term.tokens for term in self.terms if isinstance(term.tokens, RewardModelScore)]

    def place(self, device: torch.device, dtype: torch.dtype) -> None:
        for model in self.models:
            model.place(device, dtype)

    @torch.no_grad()
    def score(
        self, prompts: Sequence[dict[str, Any]], answers: Sequence[str], input_ids: Tensor, real: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """(total (B,), {term name: scores (B,)}) for prompt dicts (``data.records.prompts``), decoded answers and the
        prompt + response rows (left-padded prompt, right-padded response; ``real`` marks real tokens)."""
        parts: dict[str, Tensor] = {}
        total = torch.zeros(len(answers), device=input_ids.device)
        for term in self.terms:
            if term.tokens is not None:
                scores = term.tokens(input_ids, real).float()
            else:
                judged = [term.judge(prompt, answer) for prompt, answer in zip(prompts, answers)]
                self.unjudged += sum(score is None for score in judged)
                scores = torch.tensor([0.0 if s is None else float(s) for s in judged], device=input_ids.device)
            parts[term.name] = scores
            total = total + term.weight * scores
        return total, parts


def checker_on_record(checker: Checker) -> Callable[[dict[str, Any], str], float | None]:
    """A checker (which reads a data row) as a judge of prompt dicts (which carry their row as ``record``)."""
    return lambda prompt, answer: checker(prompt["record"], answer)


def load_reward_model_score(path: str, key: str) -> RewardModelScore:
    try:
        model, metadata = load_scalar_model(path)
    except FileNotFoundError as error:
        raise ConfigError(f"{key}: {error}") from error
    stats = {k: metadata[k] for k in ("reward_mean", "reward_std") if k in metadata}
    return RewardModelScore(model, stats, path)


def build_reward(terms: Sequence[Any], key: str = "reward.terms") -> Reward:
    """A ``Reward`` from config terms (``alignment.schemas.rl.RewardTermConfig``: kind, path, weight); every path is
    checked and every model loaded here, before any compute. Errors name ``key[i]``."""
    built = []
    for index, term in enumerate(terms):
        where = f"{key}[{index}]"
        if not math.isfinite(term.weight):  # range checks do not reach into lists of sections: checked here
            raise ConfigError(f"{where}.weight must be a finite number, got {term.weight}")
        if term.kind == "reward_model":
            if not term.path:
                raise ConfigError(f"{where}.path: a reward_model term needs the reward-model folder (`lantern rm`)")
            built.append(RewardTerm("reward_model", term.weight, tokens=load_reward_model_score(term.path, where)))
        elif term.kind == "checker":
            checker = load_checker(term.path, f"{where}.path")
            if checker is None:
                raise ConfigError(f"{where}.path: a checker term needs 'package.module:function'")
            built.append(RewardTerm(term.path, term.weight, judge=checker_on_record(checker)))
        elif term.kind == "exact_match":
            built.append(RewardTerm("exact_match", term.weight, judge=exact_match_score))
        else:
            raise ConfigError(f"{where}.kind: {term.kind!r} is not one of reward_model, checker, exact_match")
    return Reward(built)
