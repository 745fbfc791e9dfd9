"""Tests for data/preference/pairs.py and data/preference/datamodule.py: small JSONL / Parquet files, the default tokenizer."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from data.preference.config import PreferenceDataConfig
from data.preference.datamodule import PreferenceDataModule
from data.preference.pairs import PreferenceEvalBatches, build_preference_data
from data.preference.records import load_chats
from tests.helpers import words, write_jsonl


def config(files, **kwargs) -> PreferenceDataConfig:
    kwargs.setdefault("val_fraction", 0.0)
    return PreferenceDataConfig(train=[str(f) for f in files], **kwargs)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def sides(data, index: int = 0) -> tuple[list[int], list[int]]:
    return data.train.chosen[index].tolist(), data.train.rejected[index].tolist()


def test_prompt_string_and_message_lists_encode_as_chat_ending_with_eot(tmp_path, tok):
    system = {"role": "system", "content": "Be brief."}
    records = [
        {"prompt": "Who speaks first?", "chosen": "ROMEO", "rejected": "JULIET"},
        {
            "prompt": [system, user("hi"), assistant("hello"), user("name a king")],
            "chosen": [assistant("Lear")],
            "rejected": "Hamlet",
        },
        # UltraFeedback-binarized style: the reply lists repeat the prompt first
        {"prompt": "2+2?", "chosen": [user("2+2?"), assistant("4")], "rejected": [user("2+2?"), assistant("5")]},
    ]
    data = build_preference_data(config([write_jsonl(tmp_path / "p.jsonl", records)]), tok)
    prompts = [[user("Who speaks first?")], records[1]["prompt"], [user("2+2?")]]
    replies = [("ROMEO", "JULIET"), ("Lear", "Hamlet"), ("4", "5")]
    for index, (prompt, (good, bad)) in enumerate(zip(prompts, replies)):
        chosen, rejected = sides(data, index)
        assert chosen == tok.encode_chat(prompt + [assistant(good)])[0]
        assert rejected == tok.encode_chat(prompt + [assistant(bad)])[0]
        assert chosen[-1] == rejected[-1] == tok.eot_id
    assert data.stats["train"]["pairs"] == 3 and data.stats["train"]["rows_read"] == 3


def test_parquet_pairs(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "pairs.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "chosen": ["yes", "no"], "rejected": ["no", "yes"]}), path)
    data = build_preference_data(config([path]), tok)
    assert sides(data, 1)[0] == tok.encode_chat([user("b"), assistant("no")])[0]


def test_hh_transcripts_prompt_is_the_shared_prefix(tmp_path, tok):
    records = [
        {
            "chosen": "\n\nHuman: Hi there\n\nAssistant: Hello! How can I help?",
            "rejected": "\n\nHuman: Hi there\n\nAssistant: Go away.",
        },
        {
            "chosen": "\n\nHuman: Name a play.\n\nAssistant: Hamlet.\n\nHuman: Another?\n\nAssistant: Macbeth.",
            "rejected": "\n\nHuman: Name a play.\n\nAssistant: Hamlet.\n\nHuman: Another?\n\nAssistant: No.",
        },
    ]
    path = write_jsonl(tmp_path / "hh.jsonl", records)
    chats, _ = load_chats(config([path]), [str(path)])  # schema auto-detected: no prompt column
    assert chats[0].prompt == [user("Hi there")]
    assert (chats[0].chosen, chats[0].rejected) == ([assistant("Hello! How can I help?")], [assistant("Go away.")])
    assert chats[1].prompt == [user("Name a play."), assistant("Hamlet."), user("Another?")]
    assert (chats[1].chosen, chats[1].rejected) == ([assistant("Macbeth.")], [assistant("No.")])
    data = build_preference_data(config([path]), tok)
    assert sides(data, 1)[0] == tok.encode_chat(chats[1].prompt + [assistant("Macbeth.")])[0]


def test_hh_transcripts_that_diverge_early_are_bad_rows(tmp_path, tok):
    good = {"chosen": "\n\nHuman: a\n\nAssistant: b", "rejected": "\n\nHuman: a\n\nAssistant: c"}
    early = {
        "chosen": "\n\nHuman: a\n\nAssistant: b\n\nHuman: d\n\nAssistant: e",
        "rejected": "\n\nHuman: a\n\nAssistant: x\n\nHuman: d\n\nAssistant: f",
    }
    plain = {"chosen": "just text", "rejected": "other text"}
    path = write_jsonl(tmp_path / "hh.jsonl", [good, early, plain])
    with pytest.raises(ValueError, match=r"hh\.jsonl, line 2: .*diverge at turn 2"):
        build_preference_data(config([path]), tok)
    data = build_preference_data(config([path], on_bad_row="skip"), tok)
    assert data.stats["train"]["skipped"] == {"malformed": 2} and data.stats["train"]["pairs"] == 1


def test_identical_and_empty_pairs_are_dropped_and_counted(tmp_path, tok):
    records = [
        {"prompt": "q", "chosen": "same", "rejected": "same"},
        {"prompt": "q", "chosen": "same ", "rejected": " same"},  # identical once encoded (content is stripped)
        {"prompt": "q", "chosen": "", "rejected": "no"},
        {"prompt": "q", "chosen": "yes", "rejected": "   "},
        {"prompt": "q", "chosen": [], "rejected": "no"},
        {"prompt": "q", "chosen": "yes", "rejected": "no"},
    ]
    hh = [
        {"chosen": "\n\nHuman: q\n\nAssistant: a", "rejected": "\n\nHuman: q\n\nAssistant: a"},
        {"chosen": "\n\nHuman: q\n\nAssistant: a", "rejected": "\n\nHuman: q\n\nAssistant:"},
    ]
    data = build_preference_data(config([write_jsonl(tmp_path / "p.jsonl", records)]), tok)
    stats = data.stats["train"]
    assert (stats["dropped_identical"], stats["dropped_empty"], stats["pairs"]) == (2, 3, 1)
    assert data.train.where == [f"{tmp_path / 'p.jsonl'}, line 6"]
    with pytest.raises(ValueError, match="no usable train pairs.*'dropped_empty': 1, 'dropped_identical': 1"):
        build_preference_data(config([write_jsonl(tmp_path / "hh.jsonl", hh)]), tok)


def test_long_prompts_are_cut_from_the_left_keeping_bos_reply_and_eot(tmp_path, tok):
    long_prompt = " ".join(f"word{i}" for i in range(200))
    records = [
        {"prompt": long_prompt, "chosen": "the final answer is here", "rejected": "no"},
        {"prompt": "short", "chosen": " ".join(["very"] * 80), "rejected": "no"},  # the reply alone is too long
        {"prompt": "short", "chosen": "fits", "rejected": "too"},
    ]
    path = write_jsonl(tmp_path / "p.jsonl", records)
    data = build_preference_data(config([path], seq_len=64), tok)
    assert (data.stats["train"]["truncated"], data.stats["train"]["dropped_too_long"]) == (1, 1)
    prompt_ids = tok.encode_chat([user(long_prompt)])[0]
    reply = {
        side: tok.encode_chat([user(long_prompt), assistant(text)])[0][len(prompt_ids) :]
        for side, text in (("chosen", "the final answer is here"), ("rejected", "no"))
    }
    kept_prompt = [tok.bos_id] + prompt_ids[len(prompt_ids) - (64 - len(reply["chosen"]) - 1) :]
    chosen, rejected = sides(data, 0)
    # the longer side fills seq_len: <|begin_of_text|>, the end of the prompt, the whole reply with its <|eot_id|>
    assert chosen == kept_prompt + reply["chosen"] and len(chosen) == 64 and chosen[-1] == tok.eot_id
    assert tok.decode(chosen[-len(reply["chosen"]) :]).endswith("the final answer is here<|eot_id|>")
    assert rejected == kept_prompt + reply["rejected"]  # the same prompt tokens: the sides differ only in the reply
    dropped = build_preference_data(config([path], seq_len=64, too_long="drop"), tok).stats["train"]
    assert (dropped["truncated"], dropped["dropped_too_long"], dropped["pairs"]) == (0, 2, 1)


def test_bad_rows_name_file_and_row_or_are_skipped_and_counted(tmp_path, tok):
    records = [
        {"prompt": "q", "chosen": "yes", "rejected": "no"},
        {"prompt": "q", "chosen": "yes", "rejected": "no"},
        {"prompt": "q", "chosen": "yes", "rejected": None},
        {"prompt": "q", "chosen": "yes", "rejected": [{"role": "wizard", "content": "no"}]},
    ]
    path = write_jsonl(tmp_path / "bad.jsonl", records[:3])
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 3: 'rejected' is null"):
        build_preference_data(config([path]), tok)
    path = write_jsonl(
        tmp_path / "roles.jsonl", [{**r, "rejected": [assistant("no")]} for r in records[:2]] + [records[3]]
    )
    with pytest.raises(ValueError, match=r"roles\.jsonl, line 3: .*unknown role 'wizard'"):
        build_preference_data(config([path]), tok)
    data = build_preference_data(config([path], on_bad_row="skip"), tok)
    assert data.stats["train"]["skipped"] == {"unknown_role": 1} and len(data.train) == 2
    with pytest.raises(ValueError, match="cannot tell the preference schema"):
        build_preference_data(config([write_jsonl(tmp_path / "x.jsonl", [{"question": "q", "answer": "a"}])]), tok)


def toy_pairs(tmp_path: Path, n: int, name: str = "toy.jsonl", seed: int = 0) -> Path:
    rng = random.Random(seed)
    records = [{"prompt": words(rng, rng.randint(1, 12)), "chosen": "yes", "rejected": "no"} for _ in range(n)]
    return write_jsonl(tmp_path / name, records)


def test_validation_hold_out_is_seeded_and_disjoint_or_from_files(tmp_path, tok):
    path = toy_pairs(tmp_path, 50)
    first = build_preference_data(config([path], val_fraction=0.2), tok)
    again = build_preference_data(config([path], val_fraction=0.2), tok)
    assert len(first.val) == 10 and len(first.train) == 40 and first.val.where == again.val.where
    assert not set(first.val.where) & set(first.train.where)
    other = build_preference_data(config([path], val_fraction=0.2, seed=7), tok)
    assert other.val.where != first.val.where
    files = build_preference_data(config([path], val=[str(toy_pairs(tmp_path, 6, "val.jsonl", seed=1))]), tok)
    assert len(files.train) == 50 and len(files.val) == 6 and files.stats["val"]["rows_read"] == 6


def test_batch_layout_right_padding_documents_and_score_index(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "a much longer prompt than the other one", "chosen": "yes", "rejected": "no thank you kindly"},
        {"prompt": "hi", "chosen": "ok", "rejected": "no"},
    ])  # fmt: skip
    pairs = build_preference_data(config([path]), tok).train
    batch = pairs.batch([0, 1, -1], step_pairs=6)
    rows = [pairs.chosen[0], pairs.chosen[1], [], pairs.rejected[0], pairs.rejected[1], []]
    T = batch["input_ids"].shape[1]
    assert T % 8 == 0 and max(len(r) for r in rows) <= T and batch["input_ids"].shape[0] == 6
    for k, row in enumerate(rows):
        n = len(row)
        assert batch["input_ids"][k, :n].tolist() == list(row)
        assert (batch["input_ids"][k, n:] == tok.pad_id).all()
        assert (batch["document_ids"][k, :n] == 0).all() and (batch["document_ids"][k, n:] == 1).all()
        if n:
            assert batch["score_index"][k] == n - 1 and batch["input_ids"][k, n - 1] == tok.eot_id
    assert batch["pair_mask"].tolist() == [True, True, False] and batch["step_pairs"].item() == 6.0
    pairs.pad_to_seq_len = True
    assert pairs.batch([0], step_pairs=1)["input_ids"].shape == (2, 256)


def test_eval_batches_give_every_rank_the_same_count_and_each_pair_once(tmp_path, tok):
    pairs = build_preference_data(config([toy_pairs(tmp_path, 11)]), tok).train
    per_rank = [PreferenceEvalBatches(pairs, 2, rank=r, world_size=2) for r in range(2)]
    assert len(per_rank[0]) == len(per_rank[1]) == 3
    seen = [s for b in range(3) for r in range(2) for s in per_rank[r].slots(b, r) if s >= 0]
    assert sorted(seen) == list(range(11))
    assert sum(int(per_rank[r][b]["pair_mask"].sum()) for r in range(2) for b in range(3)) == 11


def test_train_batches_carry_step_pairs_and_cover_the_same_pairs_for_any_accumulation(tmp_path):
    path = toy_pairs(tmp_path, 40)
    seen = {}
    for micro, accumulate in ((1, 8), (8, 1), (2, 4)):
        datamodule = PreferenceDataModule(config([path]), micro_batch_size=micro, accumulate_grad_batches=accumulate)
        loader = iter(datamodule.train_dataloader())
        batches = [next(loader) for _ in range(accumulate)]  # the first optimizer step
        assert all(b["step_pairs"].item() == 8 and b["input_ids"].shape[0] == 2 * micro for b in batches)
        seen[(micro, accumulate)] = sorted(
            tuple(row[row != datamodule.tokenizer.pad_id].tolist()) for b in batches for row in b["input_ids"]
        )
    assert seen[(1, 8)] == seen[(8, 1)] == seen[(2, 4)]
    datamodule = PreferenceDataModule(config([path]), micro_batch_size=8, accumulate_grad_batches=8)
    with pytest.raises(ValueError, match="40 train pairs are fewer than one optimizer step needs"):
        datamodule.train_dataloader()


def test_datamodule_resumes_at_the_next_pair(tmp_path):
    path = toy_pairs(tmp_path, 40)
    first = PreferenceDataModule(config([path]), micro_batch_size=4)
    loader = iter(first.train_dataloader())
    next(loader), first.mark_consumed(1)
    expected = next(loader)
    resumed = PreferenceDataModule(config([path]), micro_batch_size=4)
    resumed.load_state_dict(first.state_dict())
    torch.testing.assert_close(next(iter(resumed.train_dataloader()))["input_ids"], expected["input_ids"])
