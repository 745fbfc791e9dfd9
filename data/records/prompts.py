"""Prompts for PPO rollouts and evaluation: chat prompts encoded up to the assistant header.

Rows are ``{"messages": [...]}``, ShareGPT ``{"conversations": [...]}`` (a trailing assistant turn is kept
aside as the reference answer) or ``{"prompt": "..." | [...]}``, with TRL's ``"completion"`` (if there is one)
the reference answer, so SFT's files serve as prompts too; other columns (task, meta, answer) travel with the
prompt so ground-truth checkers can score the answers. Loading, file resolution and message validation (either
key style, role/content or ShareGPT's from/value) are SFT's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from torch.utils.data import BatchSampler, DataLoader

from data.records.chat import BadRow, as_written, check_messages, field_turns, resolve_sources
from data.records.files import read_records
from data.streams.datamodule import StreamDataModule, StreamLoader, StreamSampler
from data.tokenizer.tokenizer import Tokenizer
from models.config_checks import bounded
from models.errors import DataError

log = logging.getLogger("lantern.prompts")


@dataclass
class PromptDataConfig:
    train: list[str] = field(default_factory=list)  # files / globs (json, jsonl, parquet) or a hub name
    val: list[str] = field(default_factory=list)  # empty: hold out val_fraction of train
    val_fraction: float = bounded(0.1, ge=0, lt=1)
    format: str = "auto"
    messages_field: str = "messages"
    conversations_field: str = "conversations"  # ShareGPT
    prompt_field: str = "prompt"
    completion_field: str = "completion"  # TRL prompt / completion rows: the reference answer
    tokenizer: str = "auto"
    max_prompt_tokens: int = bounded(192, ge=1)
    # truncate: keep <|begin_of_text|> and the last tokens (the question)
    too_long: Literal["truncate", "drop"] = "truncate"
    on_bad_row: Literal["error", "skip"] = "error"  # skip: counted
    seed: int = bounded(1234, ge=0)
    # train only on rows whose task_field is one of these (empty: every row); held-out prompts are never filtered
    train_tasks: list[str] = field(default_factory=list)
    task_field: str = "task"


def record_to_prompt(record: dict[str, Any], config: PromptDataConfig) -> tuple[list[dict[str, str]], str | None]:
    """(messages up to the assistant's turn, reference answer or None)."""
    if record.get(config.messages_field) is not None:
        messages = check_messages(record[config.messages_field], config.messages_field)
    elif record.get(config.conversations_field) is not None:
        messages = check_messages(record[config.conversations_field], config.conversations_field)
    elif record.get(config.prompt_field) is not None:
        messages = field_turns(record[config.prompt_field], config.prompt_field, "user")
        if record.get(config.completion_field) is not None:  # its last assistant turn becomes the reference below
            messages += field_turns(record[config.completion_field], config.completion_field, "assistant")
    else:
        names = (config.messages_field, config.conversations_field, config.prompt_field)
        null = next((name for name in names if name in record), None)  # there, but null
        if null is not None:
            raise BadRow("missing_field", f"{null!r} is null")
        raise BadRow("missing_field", f"no {names[0]!r}, {names[1]!r} or {names[2]!r} field")
    reference = record.get("answer")
    if messages and messages[-1]["role"] == "assistant":
        reference = messages.pop()["content"]
    if not messages or messages[-1]["role"] not in ("user", "ipython", "tool"):
        raise BadRow("no_prompt", "the prompt must end with a user (or tool) turn")
    return messages, reference


def load_prompts(
    config: PromptDataConfig, sources: list[str], tokenizer: Tokenizer, tasks: Sequence[str] = ()
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Encoded prompts ``{"prompt_ids", "reference", "record", "where", "messages"}`` and counts of what was changed;
    with ``tasks``, only rows whose ``config.task_field`` is one of them (the others counted as not selected)."""
    fmt, files = resolve_sources(config, sources)
    prompts: list[dict[str, Any]] = []
    stats: dict[str, Any] = {"rows_read": 0, "skipped": {}, "truncated": 0, "dropped_too_long": 0}
    if tasks:
        stats["not_selected"] = 0
    for source in files:
        file = read_records(fmt, source)
        for index, (record, where) in enumerate(zip(file.rows, file.where)):
            stats["rows_read"] += 1
            if tasks:
                if not isinstance(record, dict) or record.get(config.task_field) is None:  # datasets fills None
                    raise ValueError(f"{where}: no '{config.task_field}' field to select data.train_tasks by")
                if record[config.task_field] not in tasks:
                    stats["not_selected"] += 1
                    continue
            try:
                messages, reference = record_to_prompt(record, config)
            except BadRow as error:
                bad = as_written(error, file, index, lambda row: record_to_prompt(row, config))
                if config.on_bad_row == "error":
                    raise DataError(
                        f"{where}: {bad.problem} ({bad.reason}); fix the row or set on_bad_row: skip"
                    ) from None
                stats["skipped"][bad.reason] = stats["skipped"].get(bad.reason, 0) + 1
                continue
            ids = tokenizer.encode_chat_prompt(messages)
            if len(ids) > config.max_prompt_tokens:
                if config.too_long == "drop":
                    stats["dropped_too_long"] += 1
                    continue
                # keep the start-of-text token and the end, where the question and the assistant header are
                ids = ids[:1] + ids[len(ids) - config.max_prompt_tokens + 1 :]
                stats["truncated"] += 1
            prompts.append(
                {"prompt_ids": ids, "reference": reference, "record": record, "where": where, "messages": messages}
            )
    if not prompts:
        selection = f"; {stats['not_selected']} not in data.train_tasks {list(tasks)}" if tasks else ""
        raise ValueError(
            f"no usable prompts in {sources} (read {stats['rows_read']} rows; skipped {stats['skipped']}{selection})"
        )
    return prompts, stats


class PromptDataModule(StreamDataModule):
    """Batches of ``batch_size`` prompts per rank (lists of prompt dicts), from one deterministic global
    stream like the other datamodules; ``mark_consumed`` after each rollout makes resumes exact. Rank / world
    size from the trainer, stream position and checkpoint state: StreamDataModule's."""

    def __init__(self, config: PromptDataConfig, *, batch_size: int) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"rollout batch size must be >= 1, got {batch_size}")
        self.config = config
        self.micro_batch_size = batch_size  # names StreamDataModule's methods read
        self.seq_len = config.max_prompt_tokens
        self.train_prompts: list[dict] | None = None
        self.val_prompts: list[dict] = []
        self.stats: dict[str, Any] = {}

    def setup(self, stage: str | None = None) -> None:
        if self.train_prompts is not None:
            return
        tokenizer = Tokenizer.load(self.config.tokenizer)
        prompts, self.stats["train"] = load_prompts(
            self.config, list(self.config.train), tokenizer, tasks=list(self.config.train_tasks)
        )
        if self.config.val:
            self.val_prompts, self.stats["val"] = load_prompts(self.config, list(self.config.val), tokenizer)
        elif self.config.val_fraction > 0:
            held_out = max(1, round(len(prompts) * self.config.val_fraction))
            self.val_prompts, prompts = prompts[:held_out], prompts[held_out:]
        self.train_prompts = prompts
        log.info("prompts: %d train, %d held out; %s", len(prompts), len(self.val_prompts), self.stats)

    def train_dataloader(self) -> DataLoader:
        self.setup()
        if len(self.train_prompts) < self.micro_batch_size * self.world_size:
            raise ValueError(
                f"{len(self.train_prompts)} training prompts cannot fill one rollout of {self.micro_batch_size} "
                f"prompts on each of {self.world_size} ranks"
            )
        sampler = StreamSampler(
            len(self.train_prompts), rank=self.rank, world_size=self.world_size, seed=self.config.seed
        )
        batches = BatchSampler(self._attach_sampler(sampler), self.micro_batch_size, drop_last=True)
        return StreamLoader(self.train_prompts, batch_sampler=batches, collate_fn=list)
