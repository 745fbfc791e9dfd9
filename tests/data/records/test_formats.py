"""Tests for the data formats people's datasets come in (data/records/chat.py, data/preference/records.py,
data/records/prompts.py): ShareGPT conversations, TRL prompt / completion rows and TRL implicit-prompt preference pairs,
read through the real loaders from JSONL files, and the one-line errors for rows that fit no format."""

from __future__ import annotations

import pytest

from data.preference.config import PreferenceDataConfig
from data.preference.pairs import build_preference_data
from data.preference.records import load_chats, record_to_chat, split_implicit_prompt
from data.records.chat import BadRow, detect_schema, load_conversations, record_to_messages
from data.records.prompts import PromptDataConfig, load_prompts, record_to_prompt
from data.sft.datamodule import build_sft_data
from data.sft.rows import SFTDataConfig
from models.config_checks import check_config
from tests.helpers import write_jsonl

IGNORE = -100


def sft_config(files, **kwargs) -> SFTDataConfig:
    kwargs.setdefault("val_fraction", 0.0)
    return SFTDataConfig(train=[str(f) for f in files], **kwargs)


def preference_config(files, **kwargs) -> PreferenceDataConfig:
    kwargs.setdefault("val_fraction", 0.0)
    return PreferenceDataConfig(train=[str(f) for f in files], **kwargs)


def system(text: str) -> dict:
    return {"role": "system", "content": text}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def turn(speaker: str, text: str) -> dict:
    """A ShareGPT turn."""
    return {"from": speaker, "value": text}


# --- SFT: ShareGPT ----------------------------------------------------------------


def test_sharegpt_conversations_load_as_chat_messages(tmp_path):
    records = [
        {
            "id": "a",
            "conversations": [
                turn("system", "Answer briefly."),
                turn("human", "Who is the king?"),
                turn("gpt", "The king is dead."),
                turn("user", "And the queen?"),
                turn("assistant", "Long live the queen."),
            ],
        },
        {  # LLaMA-Factory's tool turns: the call is the assistant's, the observation the tool's output
            "id": "b",
            "conversations": [
                turn("human", "Weather in Verona?"),
                turn("function_call", '{"name": "weather", "arguments": {"city": "Verona"}}'),
                turn("observation", '{"sky": "clear"}'),
                turn("gpt", "Clear skies."),
            ],
        },
    ]
    path = write_jsonl(tmp_path / "sharegpt.jsonl", records)
    conversations, load = load_conversations(sft_config([path], system_prompt="Be kind."), [str(path)])
    assert load == {"rows_read": 2, "skipped": {}}
    assert conversations[0].messages == [
        system("Answer briefly."),  # the row's own system turn: the configured one is not added
        user("Who is the king?"),
        assistant("The king is dead."),
        user("And the queen?"),
        assistant("Long live the queen."),
    ]
    assert conversations[1].messages == [
        system("Be kind."),
        user("Weather in Verona?"),
        assistant('{"name": "weather", "arguments": {"city": "Verona"}}'),
        {"role": "ipython", "content": '{"sky": "clear"}'},
        assistant("Clear skies."),
    ]
    assert conversations[1].where.endswith("sharegpt.jsonl, line 2") and conversations[1].record["id"] == "b"


def test_message_lists_in_sharegpt_keys_are_read_in_every_schema():
    config = SFTDataConfig(train=[])
    record = {"messages": [turn("human", "hi"), turn("gpt", "hello")]}
    assert record_to_messages(record, "messages", config) == [user("hi"), assistant("hello")]
    record = {"conversations": [user("hi"), assistant("hello")]}  # role / content keys under "conversations"
    assert record_to_messages(record, "sharegpt", config) == [user("hi"), assistant("hello")]
    renamed = SFTDataConfig(train=[], schema="sharegpt", conversations_field="dialog")
    assert record_to_messages({"dialog": [turn("human", "a"), turn("gpt", "b")]}, "sharegpt", renamed) == [
        user("a"),
        assistant("b"),
    ]


SHAREGPT_BAD = {
    "unknown_role": (
        [turn("human", "hi"), turn("narrator", "hello")],
        "conversations[1] has unknown 'from' value 'narrator'",
    ),
    "missing_field": ([turn("human", "hi"), {"from": "gpt"}], "conversations[1] (assistant) has no 'value'"),
    "not_ending_with_assistant": ([turn("gpt", "hello"), turn("human", "hi")], "must end with an assistant turn"),
    "non_string_content": ([turn("human", "hi"), turn("gpt", 42)], "content must be a string, got int"),
}


@pytest.mark.parametrize("reason", list(SHAREGPT_BAD))
def test_bad_sharegpt_rows_name_file_row_reason_and_value(tmp_path, reason):
    turns, problem = SHAREGPT_BAD[reason]
    good = {"conversations": [turn("human", "hi"), turn("gpt", "hello")]}
    path = write_jsonl(tmp_path / "bad.jsonl", [good, {"conversations": turns}])
    with pytest.raises(ValueError) as error:
        load_conversations(sft_config([path]), [str(path)])
    message = str(error.value)
    assert message.startswith(f"{path}, line 2: ") and problem in message
    assert f"({reason}; schema sharegpt)" in message and "\n" not in message


def test_a_list_mixing_key_styles_is_a_bad_row():
    with pytest.raises(BadRow, match=r"conversations\[1\] has no 'from'") as bad:
        record_to_messages({"conversations": [turn("human", "hi"), assistant("hello")]}, "sharegpt", SFTDataConfig([]))
    assert bad.value.reason == "missing_field"


# --- SFT: TRL prompt / completion ---------------------------------------------------


def test_trl_prompt_completion_rows_standard_and_conversational(tmp_path):
    standard = write_jsonl(tmp_path / "standard.jsonl", [{"prompt": "2+2?", "completion": "4"}])
    conversational = write_jsonl(
        tmp_path / "conversational.jsonl",
        [
            {
                "prompt": [system("Be brief."), user("hi"), assistant("hello"), user("name a king")],
                "completion": [assistant("Lear")],
            },
            {"prompt": [user("count to two")], "completion": "one, two"},
        ],
    )
    conversations, load = load_conversations(sft_config([]), [str(standard), str(conversational)])
    assert load == {"rows_read": 3, "skipped": {}}
    assert [c.messages for c in conversations] == [
        [user("2+2?"), assistant("4")],
        [system("Be brief."), user("hi"), assistant("hello"), user("name a king"), assistant("Lear")],
        [user("count to two"), assistant("one, two")],
    ]


def test_only_the_completion_is_supervised(tmp_path, tok):
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "Who speaks first?", "completion": "ROMEO"}])
    data = build_sft_data(sft_config([path], packing=False, seq_len=64), tok)
    ids, supervised = tok.encode_chat([user("Who speaks first?"), assistant("ROMEO")])
    targets = data.train.row(0)["targets"][: len(ids) - 1].tolist()
    assert targets == [ids[i] if supervised[i] else IGNORE for i in range(1, len(ids))]
    assert tok.decode([t for t in targets if t != IGNORE]) == "ROMEO<|eot_id|>"


def test_bad_prompt_completion_rows():
    config = SFTDataConfig(train=[])
    with pytest.raises(BadRow, match="must end with an assistant turn, it has a user turn"):
        record_to_messages({"prompt": "q", "completion": [assistant("a"), user("and?")]}, "prompt_completion", config)
    with pytest.raises(BadRow, match="'completion' must be a string or a list of messages, got int"):
        record_to_messages({"prompt": "q", "completion": 4}, "prompt_completion", config)
    with pytest.raises(BadRow, match=r"no 'completion' field \(the row has \['prompt', 'response'\]\)"):
        record_to_messages({"prompt": "q", "response": "a"}, "prompt_completion", config)


# --- SFT: telling the schema ------------------------------------------------------


@pytest.mark.parametrize(
    "columns, schema",
    [
        (["messages"], "messages"),
        (["messages", "prompt", "prompt_id"], "messages"),  # UltraChat's columns: the messages win
        (["conversations", "id"], "sharegpt"),
        (["prompt", "response"], "prompt_response"),
        (["prompt", "completion"], "prompt_completion"),
        (["prompt", "response", "completion"], "prompt_response"),  # the first that fits, in a fixed order
        (["instruction", "input", "output"], "alpaca"),
    ],
)
def test_schema_detection_order(columns, schema):
    assert detect_schema(columns, SFTDataConfig(train=[]), "f.jsonl") == schema


def test_the_new_schemas_can_be_chosen_and_unknown_ones_are_refused():
    for schema in ("sharegpt", "prompt_completion"):
        config = SFTDataConfig(train=["x.jsonl"], schema=schema)
        check_config(config, "SFT data config")
        assert detect_schema(["messages"], config, "f.jsonl") == schema
    with pytest.raises(ValueError, match="SFT data config: schema"):
        check_config(SFTDataConfig(train=["x.jsonl"], schema="openai"), "SFT data config")  # type: ignore[arg-type]


def test_a_file_that_fits_no_schema_names_the_file_and_every_schema(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(ValueError) as error:
        load_conversations(sft_config([path]), [str(path)])
    message = str(error.value)
    assert message.startswith(f"{path}: cannot tell the schema from the columns ['question', 'answer']")
    for name in ("(messages)", "'conversations' (sharegpt)", "(prompt_response)", "'completion' (prompt_completion)"):
        assert name in message
    assert "(alpaca)" in message and "\n" not in message


def test_a_row_of_another_format_is_a_bad_row_showing_its_fields(tmp_path):
    rows = [{"messages": [user("hi"), assistant("hello")]}, {"conversations": [turn("human", "hi"), turn("gpt", "yo")]}]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    with pytest.raises(ValueError) as error:
        load_conversations(sft_config([path]), [str(path)])
    assert str(error.value) == (
        f"{path}, line 2: no 'messages' field (the row has ['conversations']) (missing_field; schema messages); "
        "fix the row or set on_bad_row: skip"
    )
    conversations, load = load_conversations(sft_config([path], on_bad_row="skip"), [str(path)])
    assert len(conversations) == 1 and load["skipped"] == {"missing_field": 1}


# --- preference: TRL implicit-prompt pairs -----------------------------------------


def test_implicit_prompt_pairs_split_at_the_shared_prefix(tmp_path, tok):
    shared = [system("Be brief."), user("Name a play."), assistant("Hamlet."), user("Another?")]
    records = [
        {"chosen": [*shared, assistant("Macbeth.")], "rejected": [*shared, assistant("No.")]},
        {"chosen": [user("2+2?"), assistant("4")], "rejected": [user("2+2?"), assistant("5")]},
        {  # ShareGPT keys
            "chosen": [turn("human", "hi"), turn("gpt", "hello")],
            "rejected": [turn("human", "hi"), turn("gpt", "go away")],
        },
    ]
    path = write_jsonl(tmp_path / "implicit.jsonl", records)
    chats, load = load_chats(preference_config([path]), [str(path)])  # schema auto-detected: no prompt column
    assert load == {"rows_read": 3, "skipped": {}}
    assert [(c.prompt, c.chosen, c.rejected) for c in chats] == [
        (shared, [assistant("Macbeth.")], [assistant("No.")]),
        ([user("2+2?")], [assistant("4")], [assistant("5")]),
        ([user("hi")], [assistant("hello")], [assistant("go away")]),
    ]
    data = build_preference_data(preference_config([path]), tok)
    assert data.train.chosen[0].tolist() == tok.encode_chat([*shared, assistant("Macbeth.")])[0]
    assert data.train.rejected[0].tolist() == tok.encode_chat([*shared, assistant("No.")])[0]


def test_implicit_prompt_split_by_hand():
    config = PreferenceDataConfig(train=[])
    tool_call, tool_output = assistant('{"name": "clock"}'), {"role": "tool", "content": "12:00"}
    chosen = [user("What time is it?"), tool_call, tool_output, assistant("Noon.")]
    rejected = [user("What time is it?"), assistant("I cannot tell.")]
    assert split_implicit_prompt(chosen, rejected, config) == (
        [user("What time is it?")],
        [tool_call, tool_output, assistant("Noon.")],  # a reply may be several turns, ending with the assistant
        [assistant("I cannot tell.")],
    )
    same = [user("q"), assistant("a")]
    assert split_implicit_prompt(same, list(same), config) == ([user("q")], [assistant("a")], [assistant("a")])


IMPLICIT_BAD = {  # case: (row, reason, problem)
    "no shared prompt": (
        {"chosen": [user("a"), assistant("b")], "rejected": [user("c"), assistant("d")]},
        "malformed",
        "'chosen' and 'rejected' differ from their first turn on: there is no shared prompt",
    ),
    "last turn not assistant": (
        {"chosen": [user("a"), assistant("b")], "rejected": [user("a"), assistant("b"), user("more?")]},
        "not_ending_with_assistant",
        "'rejected' must end with an assistant turn, it ends with a user turn",
    ),
    "diverge early": (
        {
            "chosen": [user("a"), assistant("b"), user("d"), assistant("e")],
            "rejected": [user("a"), assistant("x"), user("d"), assistant("f")],
        },
        "malformed",
        "the conversations diverge at turn 2 but may differ only in the assistant turns at their end (3 and 3 turns "
        "follow the shared prompt, a user or system one among them)",
    ),
    "not a list": (
        {"chosen": [user("a"), assistant("b")], "rejected": {"x": 1}},
        "non_string_content",
        "'rejected' must be an HH transcript or a list of messages, got dict",
    ),
}


@pytest.mark.parametrize("case", list(IMPLICIT_BAD))
def test_bad_implicit_prompt_pairs_say_why_in_one_line(case):
    record, reason, problem = IMPLICIT_BAD[case]
    with pytest.raises(BadRow) as bad:
        record_to_chat(record, "implicit_prompt", PreferenceDataConfig(train=[]), "f.jsonl, row 1")
    assert (bad.value.reason, bad.value.problem) == (reason, problem)


def test_bad_implicit_prompt_pairs_through_the_loader_name_file_and_row(tmp_path):
    good = {"chosen": [user("q"), assistant("yes")], "rejected": [user("q"), assistant("no")]}
    records = [good, IMPLICIT_BAD["no shared prompt"][0], IMPLICIT_BAD["last turn not assistant"][0], good]
    path = write_jsonl(tmp_path / "pairs.jsonl", records)
    with pytest.raises(ValueError) as error:
        load_chats(preference_config([path]), [str(path)])
    _, reason, problem = IMPLICIT_BAD["no shared prompt"]
    assert str(error.value) == (
        f"{path}, line 2: {problem} ({reason}; schema implicit_prompt); fix the row or set on_bad_row: skip"
    )
    chats, load = load_chats(preference_config([path], on_bad_row="skip"), [str(path)])
    assert len(chats) == 2 and load["skipped"] == {"malformed": 1, "not_ending_with_assistant": 1}


def test_sharegpt_lists_in_explicit_prompt_pairs_and_the_hh_name(tmp_path):
    record = {"prompt": [turn("human", "hi")], "chosen": [turn("gpt", "hello")], "rejected": "go away"}
    chats, _ = load_chats(preference_config([]), [str(write_jsonl(tmp_path / "p.jsonl", [record]))])
    assert (chats[0].prompt, chats[0].chosen, chats[0].rejected) == (
        [user("hi")],
        [assistant("hello")],
        [assistant("go away")],
    )
    hh = {"chosen": "\n\nHuman: hi\n\nAssistant: hello", "rejected": "\n\nHuman: hi\n\nAssistant: no"}
    path = write_jsonl(tmp_path / "hh.jsonl", [hh])
    chats, _ = load_chats(preference_config([path], schema="hh"), [str(path)])  # the former name still works
    assert (chats[0].prompt, chats[0].chosen) == ([user("hi")], [assistant("hello")])


def test_a_preference_file_that_fits_no_schema_lists_both(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(ValueError) as error:
        load_chats(preference_config([path]), [str(path)])
    message = str(error.value)
    assert message.startswith(f"{path}: cannot tell the preference schema from the columns ['question', 'answer']")
    assert "(pairs)" in message and "(implicit_prompt)" in message


# --- prompts for the RL stages -----------------------------------------------------


def test_prompts_from_sharegpt_and_trl_files(tmp_path, tok):
    sharegpt = write_jsonl(
        tmp_path / "sharegpt.jsonl",
        [{"conversations": [turn("system", "Be brief."), turn("human", "Who speaks first?"), turn("gpt", "ROMEO")]}],
    )
    trl = write_jsonl(
        tmp_path / "trl.jsonl",
        [
            {"prompt": [user("2+2?")], "completion": [assistant("4")]},
            {"prompt": [user("name a king")], "completion": None},
        ],
    )
    prompts, stats = load_prompts(PromptDataConfig(), [str(sharegpt), str(trl)], tok)
    assert stats["rows_read"] == 3 and stats["skipped"] == {}
    expected = [
        ([system("Be brief."), user("Who speaks first?")], "ROMEO"),
        ([user("2+2?")], "4"),  # the completion is kept aside as the reference answer
        ([user("name a king")], None),
    ]
    assert [(p["prompt_ids"], p["reference"]) for p in prompts] == [
        (tok.encode_chat_prompt(messages), reference) for messages, reference in expected
    ]


def test_train_tasks_keep_only_the_named_tasks_and_a_row_without_a_task_is_named(tmp_path, tok):
    rows = [{"prompt": [user(f"q{i}")], "task": task} for i, task in enumerate(["count", "copy", "count"])]
    source = write_jsonl(tmp_path / "tasks.jsonl", rows)
    prompts, stats = load_prompts(PromptDataConfig(), [str(source)], tok, tasks=["count"])
    assert [p["record"]["prompt"][0]["content"] for p in prompts] == ["q0", "q2"] and stats["not_selected"] == 1
    with pytest.raises(ValueError, match=r"no usable prompts .* 3 not in data.train_tasks \['sort'\]"):
        load_prompts(PromptDataConfig(), [str(source)], tok, tasks=["sort"])
    untagged = write_jsonl(tmp_path / "untagged.jsonl", [*rows, {"prompt": [user("q3")]}])
    with pytest.raises(ValueError, match=r"untagged.jsonl, line 4: no 'task' field to select data.train_tasks by"):
        load_prompts(PromptDataConfig(), [str(untagged)], tok, tasks=["count"])


def test_a_prompt_row_with_no_prompt_field_names_every_accepted_one():
    with pytest.raises(BadRow, match="no 'messages', 'conversations' or 'prompt' field"):
        record_to_prompt({"question": "q"}, PromptDataConfig())
    assert record_to_prompt({"prompt": "q", "completion": "a"}, PromptDataConfig()) == ([user("q")], "a")
