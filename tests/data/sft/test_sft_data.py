"""Tests for data/sft/datamodule.py and data/sft/datamodule.py: small JSONL files in tmp dirs, the default tokenizer."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from data.records.chat import load_conversations
from data.sft.batches import SFTBatchPlan, SFTValBatches
from data.sft.datamodule import SFTDataModule, build_sft_data
from data.sft.rows import SFTDataConfig, pack_first_fit_decreasing
from data.tokenizer.tokenizer import Tokenizer
from models.config_checks import check_config
from models.errors import DataError
from tests.helpers import WORDS, words, write_jsonl

IGNORE = -100


def config(files, **kwargs) -> SFTDataConfig:
    kwargs.setdefault("val_fraction", 0.0)
    return SFTDataConfig(train=[str(f) for f in files], **kwargs)


def chat(user: str, answer: str, system: str | None = None) -> dict:
    turns = [{"role": "system", "content": system}] if system else []
    return {"messages": turns + [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


def row_examples(rows, index: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(inputs, targets) of each document of row `index`, split by document id."""
    row = rows.row(index)
    docs = row["document_ids"]
    n = len(rows.examples_in(index))
    return [(row["input_ids"][docs == d], row["targets"][docs == d]) for d in range(n)]


# --- loss mask ----------------------------------------------------------------


MULTI_TURN = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Who is the king?"},
    {"role": "assistant", "content": "The king is dead."},
    {"role": "user", "content": "And the queen?"},
    {"role": "assistant", "content": "Long live the queen."},
]


def expected_chat(tok: Tokenizer, messages) -> tuple[list[int], list[bool]]:
    """Ids and training mask built by hand from the template pieces."""
    ids, supervised = [tok.bos_id], [False]
    for message in messages:
        header = [tok.start_header_id, *tok.encode(message["role"]), tok.end_header_id, *tok.encode("\n\n")]
        body = tok.encode(message["content"]) + [tok.eot_id]
        ids += header + body
        supervised += [False] * len(header) + [message["role"] == "assistant"] * len(body)
    return ids, supervised


@pytest.mark.parametrize("train_on_prompt", [False, True])
def test_loss_mask_is_exact_on_a_multi_turn_example(tmp_path, tok, train_on_prompt):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": MULTI_TURN}])
    data = build_sft_data(config([path], seq_len=128, packing=False, train_on_prompt=train_on_prompt), tok)
    ids, supervised = expected_chat(tok, MULTI_TURN)
    assert len(data.train) == 1 and data.train.examples_in(0) == [0]
    row = data.train.row(0)
    n = len(ids) - 1
    assert row["input_ids"][:n].tolist() == ids[:-1]
    for i in range(n):  # target i predicts ids[i + 1]
        want = ids[i + 1] if (supervised[i + 1] or train_on_prompt) else IGNORE
        assert row["targets"][i] == want, f"position {i}: {tok.id_to_piece(ids[i + 1])!r}"
    assert (row["targets"][n:] == IGNORE).all() and (row["input_ids"][n:] == tok.pad_id).all()
    # Supervised targets are exactly the two answers, each followed by <|eot_id|>.
    answers = [tok.encode(m["content"]) + [tok.eot_id] for m in MULTI_TURN if m["role"] == "assistant"]
    got = row["targets"][row["targets"] != IGNORE].tolist()
    assert got == (ids[1:] if train_on_prompt else answers[0] + answers[1])
    example = data.train_examples[0]
    assert example.answer_tokens == len(answers[1]) and example.kind == "long"


CALCULATOR = {"type": "function", "function": {"name": "calculator", "description": "exact arithmetic",
              "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}  # fmt: skip
TOOL_TRANSCRIPT = [
    {"role": "user", "content": "What is 23 * 7?"},
    {"role": "assistant", "content": '<tool_call>\n{"name": "calculator", "arguments": {"expression": "23 * 7"}}\n</tool_call>'},
    {"role": "tool", "name": "calculator", "content": "161"},
    {"role": "assistant", "content": "161"},
]  # fmt: skip


def test_a_tool_transcript_trains_on_the_models_turns_only_and_offers_the_rows_tools(tmp_path, tok):
    """SFT on a multi-turn tool transcript with a ``tools`` column: the row is the template's rendering with the
    tools offered (the built-in format: in the system turn), and only the model's turns (the call and the answer)
    are targets; the tool's output is context. A ``tools`` value that is not a list of functions is a bad row."""
    from data.tokenizer.base import with_tool_instructions

    path = write_jsonl(tmp_path / "tools.jsonl", [{"messages": TOOL_TRANSCRIPT, "tools": [CALCULATOR]}])
    data = build_sft_data(config([path], seq_len=512, packing=False), tok)
    ids, supervised = expected_chat(tok, with_tool_instructions(TOOL_TRANSCRIPT, [CALCULATOR]))
    row = data.train.row(0)
    n = len(ids) - 1
    assert row["input_ids"][:n].tolist() == ids[:-1]
    for i in range(n):  # token by token: target i is ids[i + 1] exactly where the model wrote it
        assert row["targets"][i] == (ids[i + 1] if supervised[i + 1] else IGNORE), f"position {i}"
    targets = tok.decode(row["targets"][row["targets"] != IGNORE].tolist())
    assert targets == TOOL_TRANSCRIPT[1]["content"] + "<|eot_id|>161<|eot_id|>"  # not the tool's own "161"
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": TOOL_TRANSCRIPT, "tools": "calculator"}])
    with pytest.raises(DataError, match="tools must be a list"):
        build_sft_data(config([bad], seq_len=512, packing=False), tok)


def test_padding_is_never_a_stop_token_and_every_eot_after_an_answer_is_a_target(tmp_path, tok):
    assert tok.pad_id not in {tok.eos_id, tok.eot_id, tok.eom_id, tok.bos_id}
    records = [{"messages": MULTI_TURN}] + [
        chat(f"question {i}", "yes" if i % 2 else "the king is dead") for i in range(6)
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", records)
    for packing in (True, False):
        rows = build_sft_data(config([path], seq_len=96, packing=packing), tok).train
        eot_targets = 0
        for r in range(len(rows)):
            row = rows.row(r)
            real = row["document_ids"] < len(rows.examples_in(r))
            assert (row["input_ids"][~real] == tok.pad_id).all() and (row["targets"][~real] == IGNORE).all()
            assert not np.isin(row["input_ids"][~real], list(tok.stop_ids)).any()
            for _inputs, targets in row_examples(rows, r):
                assert targets[-1] == tok.eot_id  # the last target: the final answer's <|eot_id|>
                eot_targets += int((targets == tok.eot_id).sum())
        assistant_turns = sum(sum(m["role"] == "assistant" for m in r["messages"]) for r in records)
        assert eot_targets == assistant_turns


# --- schemas --------------------------------------------------------------------


@pytest.mark.parametrize(
    "record, kwargs, expected",
    [
        (
            {"messages": MULTI_TURN, "id": 1},
            {},
            MULTI_TURN,
        ),
        (
            {"prompt": "Who is the king?", "response": "Nobody."},
            {},
            [{"role": "user", "content": "Who is the king?"}, {"role": "assistant", "content": "Nobody."}],
        ),
        (
            {
                "prompt": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}],
                "response": "Yo",
            },
            {"system_prompt": "ignored: the row has one"},
            [
                {"role": "system", "content": "Be terse."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Yo"},
            ],
        ),
        (
            {"instruction": "Name the king.", "input": "Act 1, scene 2", "output": "Claudius"},
            {},
            [
                {"role": "user", "content": "Name the king.\n\nAct 1, scene 2"},
                {"role": "assistant", "content": "Claudius"},
            ],
        ),
        (
            {"instruction": "Name the king.", "input": "", "output": "Claudius"},
            {"system_prompt": "You are helpful."},
            [
                {"role": "system", "content": "You are helpful."},
                {"role": "user", "content": "Name the king."},
                {"role": "assistant", "content": "Claudius"},
            ],
        ),
        (
            {"instruction": "Name the king.", "output": "Claudius"},
            {},
            [{"role": "user", "content": "Name the king."}, {"role": "assistant", "content": "Claudius"}],
        ),
        (  # custom column names
            {"q": "Who?", "a": "Me."},
            {"schema": "prompt_response", "prompt_field": "q", "response_field": "a"},
            [{"role": "user", "content": "Who?"}, {"role": "assistant", "content": "Me."}],
        ),
    ],
    ids=["messages", "prompt-string", "prompt-list", "alpaca-input", "alpaca-empty-input", "alpaca-no-input", "custom"],
)
def test_each_schema_maps_to_the_expected_messages(tmp_path, record, kwargs, expected):
    path = write_jsonl(tmp_path / "rows.jsonl", [record, record])
    conversations, load = load_conversations(config([path], **kwargs), [str(path)])
    assert load == {"rows_read": 2, "skipped": {}}
    assert [c.messages for c in conversations] == [expected, expected]
    assert conversations[1].record == record and conversations[1].where.endswith("rows.jsonl, line 2")


# --- bad rows --------------------------------------------------------------------

GOOD = [chat("hello", "hi there"), chat("who are you", "a king")]
BAD = {
    "missing_field": {"prompt": "no messages column here", "response": "x"},
    "empty_assistant": chat("hello", "   \n"),
    "not_ending_with_assistant": {"messages": [{"role": "user", "content": "hello"}]},
    "unknown_role": {"messages": [{"role": "narrator", "content": "hello"}, {"role": "assistant", "content": "hi"}]},
    "non_string_content": {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": 42}]},
}


@pytest.mark.parametrize("reason", list(BAD))
def test_a_bad_row_is_an_error_naming_file_and_row(tmp_path, reason):
    path = write_jsonl(tmp_path / f"bad_{reason}.jsonl", GOOD + [BAD[reason]])
    with pytest.raises(ValueError) as error:
        load_conversations(config([path]), [str(path)])
    message = str(error.value)
    assert f"bad_{reason}.jsonl, line 3" in message and reason in message


def test_bad_rows_are_skipped_and_counted_by_reason(tmp_path):
    records, expected = [], []
    for i, reason in enumerate(BAD):
        records += [chat(f"question {i}", f"answer {i}"), BAD[reason], BAD[reason]]
        expected.append(records[-3])
    path = write_jsonl(tmp_path / "mixed.jsonl", records)
    conversations, load = load_conversations(config([path], on_bad_row="skip"), [str(path)])
    assert load == {"rows_read": 15, "skipped": {reason: 2 for reason in BAD}}
    assert [c.messages for c in conversations] == [r["messages"] for r in expected]  # kept rows unchanged
    assert [c.where.rsplit(" ", 1)[1] for c in conversations] == ["1", "4", "7", "10", "13"]
    data = build_sft_data(config([path], on_bad_row="skip"))
    assert data.stats["train"]["skipped"] == {reason: 2 for reason in BAD} and data.stats["train"]["examples"] == 5


# --- truncation ------------------------------------------------------------------


def test_truncate_and_drop_are_counted_and_targetless_examples_dropped(tmp_path, tok):
    seq_len = 32
    long_answer = chat("hi", " ".join(WORDS * 2))  # answer runs past seq_len + 1 ids
    long_prompt = chat(" ".join(WORDS * 3), "yes")  # the answer starts after seq_len + 1 ids
    fits = chat("hi", "good night")
    path = write_jsonl(tmp_path / "long.jsonl", [fits, long_answer, long_prompt, fits])
    full = len(tok.encode_chat(long_answer["messages"])[0])
    assert full > seq_len + 1

    data = build_sft_data(config([path], seq_len=seq_len, packing=False), tok)
    s = data.stats["train"]
    assert (s["examples"], s["truncated"], s["dropped_too_long"], s["dropped_no_target"]) == (4, 2, 0, 1)
    assert s["examples_kept"] == 3 and len(data.train) == 3
    truncated = [e for e in data.train_examples if e.truncated]
    assert len(truncated) == 1 and len(truncated[0].ids) == seq_len + 1
    assert truncated[0].ids.tolist() == tok.encode_chat(long_answer["messages"])[0][: seq_len + 1]
    assert data.train.row_lengths.max() == seq_len

    data = build_sft_data(config([path], seq_len=seq_len, packing=False, too_long="drop"), tok)
    s = data.stats["train"]
    assert (s["truncated"], s["dropped_too_long"], s["dropped_no_target"], s["examples_kept"]) == (0, 2, 0, 2)


# --- short-answer upsampling ------------------------------------------------------


def upsampling_file(tmp_path: Path, n_short: int, n_long: int) -> Path:
    rng = random.Random(0)
    records = [chat(f"short {i}", "Yes") for i in range(n_short)]
    records += [chat(f"long {i}", words(rng, 8)) for i in range(n_long)]
    rng.shuffle(records)
    return write_jsonl(tmp_path / "mix.jsonl", records)


def copies_per_example(data) -> dict[int, int]:
    counts: dict[int, int] = {}
    for r in range(len(data.train)):
        for e in data.train.examples_in(r):
            counts[e] = counts.get(e, 0) + 1
    return counts


def test_short_answer_upsampling_by_factor_and_by_target_share(tmp_path, tok):
    path = upsampling_file(tmp_path, n_short=4, n_long=12)
    assert len(tok.encode("Yes")) + 1 == 2  # "Yes" + eot: a short answer under the default threshold

    data = build_sft_data(config([path], seq_len=64, short_answer_factor=3), tok)
    assert data.stats["train"]["upsampling"] == {
        "examples_before": 16,
        "short_before": 4,
        "examples_after": 24,
        "short_after": 12,
    }
    copies = copies_per_example(data)
    assert all(copies[i] == (3 if e.kind == "short" else 1) for i, e in enumerate(data.train_examples))

    # share 0.55 of examples: round(0.55 * 12 / 0.45) = 15 short examples = 4 x 3 + 3 extra (a seeded choice)
    data = build_sft_data(config([path], seq_len=64, short_answer_target_share=0.55), tok)
    assert data.stats["train"]["upsampling"] == {
        "examples_before": 16,
        "short_before": 4,
        "examples_after": 27,
        "short_after": 15,
    }
    copies = copies_per_example(data)
    short = sorted(copies[i] for i, e in enumerate(data.train_examples) if e.kind == "short")
    assert short == [3, 4, 4, 4]
    again = build_sft_data(config([path], seq_len=64, short_answer_target_share=0.55), tok)
    assert copies_per_example(again) == copies and again.train.fingerprint() == data.train.fingerprint()
    choices = {
        tuple(
            sorted(
                copies_per_example(
                    build_sft_data(config([path], seq_len=64, short_answer_target_share=0.55, seed=s), tok)
                ).items()
            )
        )
        for s in range(4)
    }
    assert len(choices) > 1  # the extra copies depend on the seed

    none = build_sft_data(config([path], seq_len=64, short_answer_target_share=0.2), tok)  # already >= 20% short
    assert none.stats["train"]["upsampling"]["examples_after"] == 16
    with pytest.raises(ValueError, match="not both"):  # refused where the config is loaded
        check_config(config([path], short_answer_factor=2, short_answer_target_share=0.5), "SFT data config")


# --- packing ----------------------------------------------------------------------


def test_first_fit_decreasing_packs_random_lengths_tightly():
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 121, size=500)
    bins = pack_first_fit_decreasing(lengths, 256)
    assert sorted(i for b in bins for i in b) == list(range(500))  # every item exactly once, never split
    assert max(lengths[b].sum() for b in bins) <= 256
    efficiency = lengths.sum() / (len(bins) * 256)
    print(f"\nFFD packing efficiency, 500 lengths in [5, 120], seq_len 256: {efficiency:.4f} ({len(bins)} rows)")
    assert efficiency >= 0.95
    assert pack_first_fit_decreasing(lengths, 256) == bins  # deterministic
    assert pack_first_fit_decreasing([3, 5, 3, 5, 2], 10) == [[1, 3], [0, 2, 4]]  # longest first, ties by index


def realistic_file(tmp_path: Path, n: int = 500) -> Path:
    """Many short answers and long ones: lengths from ~15 to ~120 tokens."""
    rng = random.Random(1)
    records = []
    for i in range(n):
        answer = rng.choice(["Yes", "no", "ROMEO"]) if rng.random() < 0.4 else words(rng, rng.randint(3, 90))
        records.append(chat(f"q{i}: " + words(rng, rng.randint(1, 20)), answer))
    return write_jsonl(tmp_path / "realistic.jsonl", records)


def test_packing_keeps_examples_whole_and_documents_separate(tmp_path, tok):
    path = realistic_file(tmp_path)
    seq_len = 256
    data = build_sft_data(config([path], seq_len=seq_len), tok)
    rows, examples = data.train, data.train_examples
    seen = []
    for r in range(len(rows)):
        row = rows.row(r)
        members = rows.examples_in(r)
        seen += members
        sizes = [examples[e].num_inputs for e in members]
        assert sum(sizes) <= seq_len
        expected_docs = np.concatenate(
            [np.full(s, d) for d, s in enumerate(sizes)] + [np.full(seq_len - sum(sizes), len(sizes))]
        )
        assert row["document_ids"].tolist() == expected_docs.tolist()  # 0, 1, ... then padding's own id
        for (inputs, targets), e in zip(row_examples(rows, r), members):  # each example whole, in one piece
            want_inputs, want_targets = examples[e].inputs_targets()
            assert inputs.tolist() == want_inputs.tolist() and targets.tolist() == want_targets.tolist()
    assert sorted(seen) == list(range(len(examples))) == list(range(500))
    efficiency = data.stats["train"]["packing_efficiency"]
    print(
        f"\nSFT packing efficiency, 500 chats of {min(e.num_inputs for e in examples)}-"
        f"{max(e.num_inputs for e in examples)} tokens, seq_len {seq_len}: {efficiency:.4f} ({len(rows)} rows)"
    )
    assert efficiency >= 0.95
    assert data.stats["train"]["real_tokens"] == sum(e.num_inputs for e in examples)

    unpacked = build_sft_data(config([path], seq_len=seq_len, packing=False), tok)
    assert len(unpacked.train) == 500 and all(unpacked.train.examples_in(r) == [r] for r in range(500))
    row = unpacked.train.row(0)
    n = examples[0].num_inputs
    assert row["document_ids"].tolist() == [0] * n + [1] * (seq_len - n)
    assert unpacked.stats["train"]["supervised_tokens"] == data.stats["train"]["supervised_tokens"]


# --- the batch plan ------------------------------------------------------------------


@pytest.fixture(scope="module")
def plan_data(tmp_path_factory, tok):
    path = realistic_file(tmp_path_factory.mktemp("plan"), n=300)
    return build_sft_data(config([path], seq_len=128, val_fraction=0.1), tok)


def datamodule(data, micro: int, accumulate: int, rank: int = 0, world: int = 1) -> SFTDataModule:
    dm = SFTDataModule(
        SFTDataConfig(train=["unused"], seq_len=128), micro_batch_size=micro, accumulate_grad_batches=accumulate
    )
    dm.data, dm.tokenizer = data, Tokenizer.load("default")  # share the built rows instead of rebuilding
    dm.trainer = SimpleNamespace(global_rank=rank, world_size=world)  # what the datamodule reads of a Trainer
    return dm


def run_steps(data, micro: int, accumulate: int, world: int, steps: int) -> list[dict]:
    """Simulate `world` ranks for `steps` optimizer steps: per step the rows seen (in stream order), the
    step totals every micro-batch carried, and the totals counted from the batches themselves."""
    modules = [datamodule(data, micro, accumulate, r, world) for r in range(world)]
    loaders = [iter(dm.train_dataloader()) for dm in modules]
    assert len(modules[0].train_dataloader()) == len(data.train) // (micro * accumulate * world) * accumulate
    out = []
    for _ in range(steps):
        slots, totals, tokens, examples = {}, set(), 0, 0
        for _j in range(accumulate):
            for r, (dm, loader) in enumerate(zip(modules, loaders)):
                batch = next(loader)
                assert batch["input_ids"].shape == (micro, 128) and batch["step_tokens"].shape == ()
                plan = dm.train_sampler
                base = plan.consumed + r * micro
                for i in range(micro):  # the documented position of every row of the micro-batch
                    slots[base + i] = batch["input_ids"][i].tolist()
                totals.add((float(batch["step_tokens"]), float(batch["step_examples"])))
                valid = batch["targets"] != IGNORE
                tokens += int(valid.sum())
                for i in range(micro):
                    examples += len(set(batch["document_ids"][i][valid[i]].tolist()))
            for dm in modules:
                dm.mark_consumed()  # every rank trained on one more micro-batch
        assert len(totals) == 1  # every micro-batch of the step, on every rank, carries the same totals
        assert sorted(slots) == list(range(min(slots), min(slots) + micro * accumulate * world))
        out.append({"rows": [slots[p] for p in sorted(slots)], "totals": totals.pop(), "counted": (tokens, examples)})
    return out


def test_batch_plan_is_the_same_for_any_split_of_a_step(plan_data):
    assert len(plan_data.train) >= 48
    reference = run_steps(plan_data, micro=1, accumulate=8, world=1, steps=5)
    for micro, accumulate, world in [(8, 1, 1), (4, 1, 2), (2, 2, 2), (1, 4, 2)]:
        other = run_steps(plan_data, micro=micro, accumulate=accumulate, world=world, steps=5)
        for step, (a, b) in enumerate(zip(reference, other)):
            assert a["rows"] == b["rows"], f"step {step}: {micro}x{accumulate}x{world} saw other rows"
            assert a["totals"] == b["totals"]
    for step in reference:  # the totals are the real counts over the step's rows
        assert step["totals"] == tuple(float(x) for x in step["counted"])
    # consecutive steps cover distinct rows of the epoch's permutation
    seen = [tuple(r) for step in reference for r in step["rows"]]
    assert len(set(seen)) == len(seen)


def test_resume_continues_with_exactly_the_next_micro_batch(plan_data):
    first = datamodule(plan_data, micro=2, accumulate=2)
    loader = iter(first.train_dataloader())
    for _ in range(7):  # stop mid-step (7 micro-batches of 2 accumulated)
        next(loader)
        first.mark_consumed()
    state = first.state_dict()
    assert state["sampler"]["consumed"] == 14
    expected = [next(loader) for _ in range(3)]

    resumed = datamodule(plan_data, micro=2, accumulate=2)
    resumed.load_state_dict(state)  # before the loader exists: kept pending, applied when it is built
    assert resumed.consumed_samples == 14
    got = iter(resumed.train_dataloader())
    for want in expected:
        batch = next(got)
        assert batch.keys() == want.keys()
        assert all(torch.equal(batch[k], want[k]) for k in want)

    # at a step boundary the stream carries over to another world size: 1 rank x 4 -> 2 ranks x 2
    single = datamodule(plan_data, micro=4, accumulate=1)
    loader = iter(single.train_dataloader())
    for _ in range(3):
        next(loader)
        single.mark_consumed()
    state = single.state_dict()
    want = next(loader)
    halves = []
    for r in range(2):
        dm = datamodule(plan_data, micro=2, accumulate=1, rank=r, world=2)
        dm.load_state_dict(state)
        halves.append(next(iter(dm.train_dataloader())))
    assert torch.equal(torch.cat([h["input_ids"] for h in halves]), want["input_ids"])
    assert float(halves[0]["step_tokens"]) == float(halves[1]["step_tokens"]) == float(want["step_tokens"])

    with pytest.raises(ValueError, match="seq_len"):
        other = datamodule(plan_data, micro=2, accumulate=2)
        other.seq_len = 64
        other.load_state_dict(state)


def test_plan_needs_a_whole_step_of_rows(plan_data):
    with pytest.raises(ValueError, match="fewer than one optimizer step"):
        SFTBatchPlan(plan_data.train, micro_batch_size=len(plan_data.train), accumulate=2)


# --- validation ----------------------------------------------------------------------


def test_val_examples_and_example_kinds(tmp_path, tok):
    train = write_jsonl(tmp_path / "train.jsonl", [chat(f"q{i}", "good night sweet prince") for i in range(8)])
    val_records = [
        {**chat("Who speaks first?", "ROMEO"), "task": "first_speaker"},
        {**chat("Repeat the line.", "long live the king of england", system="Be exact."), "task": "repeat"},
        {
            "messages": [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "no"},
                {"role": "user", "content": "b"},
                {"role": "assistant", "content": "the queen is dead"},
            ],
            "task": None,
        },
        {**chat("Yes or no?", "no"), "task": "yes_no"},
        {**chat("Again?", "thou art my lord"), "task": "repeat"},
    ]  # every record has every column: datasets reads an absent column as null
    val = write_jsonl(tmp_path / "val.jsonl", val_records)
    dm = SFTDataModule(config([train], val=[str(val)], seq_len=64), micro_batch_size=2, val_micro_batch_size=2)
    dm.setup("fit")
    examples = dm.val_examples
    assert [e["record"] for e in examples] == val_records
    assert [e["reference"] for e in examples] == [r["messages"][-1]["content"] for r in val_records]
    assert [e["kind"] for e in examples] == ["short", "long", "long", "short", "long"]
    for e, r in zip(examples, val_records):
        assert e["prompt_ids"] == tok.encode_chat_prompt(r["messages"][:-1])
        assert tok.decode(e["prompt_ids"]).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")

    # example_kinds: each example's tokens carry its kind, padding -1; rows shard over 2 ranks, none lost
    rows = dm.data.val
    kinds = [0 if e.kind == "short" else 1 for e in dm.data.val_examples]
    covered = []
    per_rank = [SFTValBatches(rows, 2, rank=r, world_size=2) for r in range(2)]
    assert len(per_rank[0]) == len(per_rank[1]) == -(-len(rows) // 4)
    for b in range(len(per_rank[0])):
        batches = [ds[b] for ds in per_rank]
        step_tokens = sum(int((x["targets"] != IGNORE).sum()) for x in batches)
        for x in batches:
            assert x.keys() == {"input_ids", "targets", "document_ids", "example_kinds", "step_tokens", "step_examples"}
            assert float(x["step_tokens"]) == step_tokens
        for r, x in enumerate(batches):
            for i, slot in enumerate(per_rank[r].slots(b, r)):
                if slot < 0:  # an all-padding row filling the last batch
                    assert (x["targets"][i] == IGNORE).all() and (x["example_kinds"][i] == -1).all()
                    continue
                covered.append(slot)
                members = rows.examples_in(slot)
                docs = x["document_ids"][i]
                for d, e in enumerate(members):
                    assert (x["example_kinds"][i][docs == d] == kinds[e]).all()
                assert (x["example_kinds"][i][docs == len(members)] == -1).all()
    assert sorted(covered) == list(range(len(rows)))
    loader_batch = next(iter(dm.val_dataloader()))
    assert torch.equal(loader_batch["example_kinds"], SFTValBatches(rows, 2)[0]["example_kinds"])


def test_datamodule_summary_stats_and_config_schema(tmp_path, caplog):
    from omegaconf import OmegaConf

    path = upsampling_file(tmp_path, n_short=6, n_long=34)
    caplog.set_level("INFO", logger="lantern.sft")
    dm = SFTDataModule(
        config([path], seq_len=64, val_fraction=0.1, short_answer_factor=2),
        micro_batch_size=2,
        accumulate_grad_batches=2,
    )
    dm.setup("fit")
    s = dm.stats
    assert s["train"]["examples"] + s["val"]["examples"] == 40 and s["val"]["held_out_from_train"] == 4
    assert s["train"]["upsampling"]["short_after"] == 2 * s["train"]["upsampling"]["short_before"]
    assert dm.tokens_per_micro_batch == 2 * 64
    assert dm.supervised_tokens_per_row == s["train"]["supervised_tokens"] / s["train"]["rows"]
    assert "SFT train" in caplog.text and "upsampling" in caplog.text and "efficiency" in caplog.text
    # same seed, same hold-out
    again = build_sft_data(config([path], seq_len=64, val_fraction=0.1, short_answer_factor=2))
    assert [e.conversation.where for e in again.val_examples] == [e["where"] for e in dm.val_examples]

    schema = OmegaConf.structured(SFTDataConfig)
    merged = OmegaConf.merge(schema, {"train": [str(path)], "system_prompt": "hi", "short_answer_target_share": 0.3})
    assert OmegaConf.to_object(merged).short_answer_target_share == 0.3


def test_parquet_input_and_unreadable_json_are_located(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "pairs.parquet"
    pq.write_table(pa.table({"prompt": ["Who?", "Where?", "When?"], "response": ["Me.", " \t", "Now."]}), path)
    conversations, load = load_conversations(config([path], on_bad_row="skip"), [str(path)])
    assert [c.messages[-1]["content"] for c in conversations] == ["Me.", "Now."]
    assert load == {"rows_read": 3, "skipped": {"empty_assistant": 1}}
    with pytest.raises(ValueError, match=r"pairs\.parquet, row 2: .*empty"):
        load_conversations(config([path]), [str(path)])

    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(GOOD[0]) + "\n" + '{"messages": [\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"broken\.jsonl, line 2: invalid JSON"):
        load_conversations(config([broken], format="jsonl"), [str(broken)])
