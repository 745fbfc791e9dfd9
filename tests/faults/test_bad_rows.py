"""Bad rows in SFT, preference and prompt JSONL files: one row whose field has another JSON type (`"prompt": 5`
among strings) is named by file, line and field, and with on_bad_row=skip only that row goes, every other row
keeping its exact string value (`datasets` had turned the answer "4" into the int 4 in the whole column); a
file of only blank lines (or 0 bytes) is a one-line error naming it; a null field is called null, not missing;
and DPO's data statistics and skipped-row warnings are logged under DPO's name, not the reward model's."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from data.preference.config import PreferenceDataConfig
from data.preference.datamodule import PreferenceDataModule
from data.preference.dpo import DPODataModule
from data.preference.records import load_chats
from data.records.chat import load_conversations
from data.records.prompts import PromptDataConfig, load_prompts
from data.sft.rows import SFTDataConfig
from models.errors import DataError

SFT_ROW = {"prompt": "What is 2 + 2?", "response": "4"}
PAIR_ROW = {"prompt": "What is 2 + 2?", "chosen": "4", "rejected": "5"}
PROMPT_ROW = {"prompt": "What is 2 + 2?", "completion": "4"}  # TRL prompt / completion: "4" is the reference
BAD_SFT = {"prompt": 5, "response": 7}
BAD_PAIR = {"prompt": 5, "chosen": 7, "rejected": 8}
BAD_PROMPT = {"prompt": 5, "completion": 7}


def write_lines(path: Path, lines: list[dict | str]) -> Path:
    """A JSONL file; a string in `lines` is written as is (a blank line)."""
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def with_bad_row(path: Path, good: dict, bad: dict, blank_line: bool) -> tuple[Path, int]:
    """6 good rows, the bad one, then 10 good rows; with `blank_line` a blank line before the bad row (so its
    line is not its row). Returns the path and the bad row's line."""
    before: list[dict | str] = [good] * 6 + ([""] if blank_line else [])
    return write_lines(path, [*before, bad, *[good] * 10]), len(before) + 1


def sft_config(path: Path, **kwargs) -> SFTDataConfig:
    return SFTDataConfig(train=[str(path)], seq_len=64, val_fraction=0.0, **kwargs)


def pair_config(path: Path, **kwargs) -> PreferenceDataConfig:
    return PreferenceDataConfig(train=[str(path)], seq_len=64, val_fraction=0.0, **kwargs)


def prompt_config(path: Path, **kwargs) -> PromptDataConfig:
    return PromptDataConfig(train=[str(path)], val_fraction=0.0, **kwargs)


def one_line_error(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert error.type is DataError and "\n" not in message, message
    return message


# ---- 1. one row of another type in a column


@pytest.mark.parametrize("blank_line", [False, True], ids=["no-blank-line", "blank-line-before-it"])
def test_sft_names_the_row_of_another_type_and_skips_only_it(tmp_path, blank_line):
    path, line = with_bad_row(tmp_path / "sft.jsonl", SFT_ROW, BAD_SFT, blank_line)
    with pytest.raises(DataError) as error:
        load_conversations(sft_config(path), [str(path)])
    assert one_line_error(error).startswith(f"{path}, line {line}: 'prompt' must be a string")
    assert "got int 5" in str(error.value)

    conversations, load = load_conversations(sft_config(path, on_bad_row="skip"), [str(path)])
    assert load == {"rows_read": 17, "skipped": {"non_string_content": 1}}
    assert [c.messages[-1]["content"] for c in conversations] == ["4"] * 16  # strings, not the int 4
    assert [c.record["response"] for c in conversations] == ["4"] * 16
    assert f"{path}, line {line}" not in [c.where for c in conversations]


@pytest.mark.parametrize("blank_line", [False, True], ids=["no-blank-line", "blank-line-before-it"])
def test_preference_names_the_row_of_another_type_and_skips_only_it(tmp_path, blank_line):
    path, line = with_bad_row(tmp_path / "pairs.jsonl", PAIR_ROW, BAD_PAIR, blank_line)
    with pytest.raises(DataError) as error:
        load_chats(pair_config(path), [str(path)])
    assert one_line_error(error).startswith(f"{path}, line {line}: 'prompt' must be a string")
    assert "got int 5" in str(error.value)

    chats, load = load_chats(pair_config(path, on_bad_row="skip"), [str(path)])
    assert load == {"rows_read": 17, "skipped": {"non_string_content": 1}}
    assert {(c.chosen[-1]["content"], c.rejected[-1]["content"]) for c in chats} == {("4", "5")}
    assert len(chats) == 16


@pytest.mark.parametrize("blank_line", [False, True], ids=["no-blank-line", "blank-line-before-it"])
def test_prompts_name_the_row_of_another_type_and_skip_only_it(tmp_path, tok, blank_line):
    path, line = with_bad_row(tmp_path / "prompts.jsonl", PROMPT_ROW, BAD_PROMPT, blank_line)
    with pytest.raises(DataError) as error:
        load_prompts(prompt_config(path), [str(path)], tok)
    assert one_line_error(error).startswith(f"{path}, line {line}: 'prompt' must be a string")

    prompts, stats = load_prompts(prompt_config(path, on_bad_row="skip"), [str(path)], tok)
    assert stats["rows_read"] == 17 and stats["skipped"] == {"non_string_content": 1}
    assert [p["reference"] for p in prompts] == ["4"] * 16
    assert all(p["record"]["prompt"] == "What is 2 + 2?" for p in prompts)


def test_strings_that_read_as_json_stay_strings(tmp_path):
    """A column typed as JSON text decodes "true", "null" and "[1]" too: they are answers, not JSON."""
    answers = ["true", "null", "[1]", "4", "ok"]
    rows = [{"prompt": "Say it.", "response": answer} for answer in answers] + [BAD_SFT]
    path = write_lines(tmp_path / "answers.jsonl", rows)
    conversations, _ = load_conversations(sft_config(path, on_bad_row="skip"), [str(path)])
    assert [c.messages[-1]["content"] for c in conversations] == answers


# ---- 2. files without records


@pytest.mark.parametrize(
    ("text", "held"),
    [("\n\n   \n\t\n", "it holds only blank lines"), ("", "it is empty (0 bytes)")],
    ids=["blank", "empty"],
)
def test_a_file_without_records_is_one_line_naming_it(tmp_path, tok, text, held):
    path = tmp_path / "nothing.jsonl"
    path.write_text(text)
    for load in (
        lambda: load_conversations(sft_config(path), [str(path)]),
        lambda: load_chats(pair_config(path), [str(path)]),
        lambda: load_prompts(prompt_config(path), [str(path)], tok),
    ):
        with pytest.raises(DataError) as error:
            load()
        assert one_line_error(error) == f"{path} has no records: {held}"


# ---- 3. null fields


def test_a_null_field_is_called_null_not_missing(tmp_path, tok):
    cases = [
        ("sft.jsonl", SFT_ROW, lambda p: load_conversations(sft_config(p), [str(p)])),
        ("pairs.jsonl", PAIR_ROW, lambda p: load_chats(pair_config(p), [str(p)])),
        ("prompts.jsonl", PROMPT_ROW, lambda p: load_prompts(prompt_config(p), [str(p)], tok)),
    ]
    for name, good, load in cases:
        path = write_lines(tmp_path / name, [good, good, {**good, "prompt": None}, good])
        with pytest.raises(DataError) as error:
            load(path)
        assert one_line_error(error).startswith(f"{path}, line 3: 'prompt' is null"), name


def test_an_absent_field_is_still_called_missing(tmp_path):
    """`datasets` fills an absent field with null: the row as written tells the two apart."""
    path = write_lines(tmp_path / "sft.jsonl", [SFT_ROW, {"prompt": "Who?", "answer": "Me."}])
    with pytest.raises(DataError, match=rf"{path}, line 2: no 'response' field \(the row has \['answer', 'prompt'\]\)"):
        load_conversations(sft_config(path), [str(path)])
    path = write_lines(tmp_path / "sft2.jsonl", [SFT_ROW, {"prompt": "Who?", "response": None}])
    with pytest.raises(DataError, match=rf"{path}, line 2: 'response' is null"):
        load_conversations(sft_config(path), [str(path)])


# ---- 4. DPO's data statistics are DPO's


def test_dpo_logs_its_data_statistics_as_dpo_not_the_reward_model(tmp_path, caplog):
    path = write_lines(tmp_path / "pairs.jsonl", [PAIR_ROW] * 8 + [{**PAIR_ROW, "rejected": None}])
    config = PreferenceDataConfig(train=[str(path)], seq_len=64, val_fraction=0.0, on_bad_row="skip")
    with caplog.at_level(logging.INFO, logger="lantern"):
        DPODataModule(config, micro_batch_size=2).setup("fit")
    dpo = [r for r in caplog.records if r.name.startswith("lantern.") and "train" in r.getMessage()]
    assert {r.name for r in dpo} == {"lantern.dpo"}, [(r.name, r.getMessage()) for r in dpo]
    assert any(r.getMessage().startswith("DPO train: 9 rows read") for r in dpo)
    assert any("skipping bad rows" in r.getMessage() for r in dpo)  # the skipped-row warning too
    assert not any(r.getMessage().startswith("RM ") for r in caplog.records)

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lantern"):
        PreferenceDataModule(config, micro_batch_size=2).setup("fit")
    assert any(r.name == "lantern.rm" and r.getMessage().startswith("RM train: 9 rows read") for r in caplog.records)


def test_bad_sft_data_is_one_line_before_any_weights_are_read(tmp_path, monkeypatch):
    """Before: an Alpaca file with nested `instances` (Self-Instruct's layout) was reported in one clear line, but
    only after the model had loaded (seconds to minutes for a real one). Now the stage reads and checks its data
    first: the error comes with no weights read."""
    import alignment.stages.sft as sft_stage
    from alignment.stages.sft import run_sft
    from tests.alignment.test_sft import sft_config as stage_config

    rows = [{"instruction": "Add the numbers.", "instances": [{"input": "2 3", "output": "5"}]}] * 4
    path = write_lines(tmp_path / "alpaca.jsonl", rows)
    monkeypatch.setattr(sft_stage, "load_initial_model", lambda *a, **k: pytest.fail("weights read before the data"))
    config = stage_config({"train": path, "val": path}, tmp_path / "runs", "trainer.max_steps=1")
    with pytest.raises(ValueError, match="cannot tell the schema from the columns") as error:
        run_sft(config)
    assert str(error.value).startswith(str(path)) and "\n" not in str(error.value)


def test_a_chat_template_that_fails_on_one_row_names_the_row(tmp_path, tok, monkeypatch):
    """Before: the template's error alone, naming no row of the data."""
    from data.records.chat import Conversation
    from data.sft.rows import encode_examples
    from data.tokenizer.chat_template import ChatTemplateError

    real = type(tok).encode_chat

    def strict(self, messages, tools=None):  # a template that raises on one row's content, as a user's may
        if any("boom" in m["content"] for m in messages):
            raise ChatTemplateError("tokenizer.json chat_template: raise_exception('no boom here')")
        return real(self, messages, tools)

    monkeypatch.setattr(type(tok), "encode_chat", strict)
    rows = [("hi", "hello", "a.jsonl, line 1"), ("boom?", "no", "a.jsonl, line 2")]
    conversations = [
        Conversation([{"role": "user", "content": q}, {"role": "assistant", "content": a}], {}, where)
        for q, a, where in rows
    ]
    with pytest.raises(DataError, match=r"^a.jsonl, line 2: the chat template cannot render this row \(tokenizer"):
        encode_examples(conversations, tok, SFTDataConfig(train=["a.jsonl"]))
