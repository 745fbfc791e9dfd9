"""Tests for data/demo/tasks.py: the code-checkable demo tasks, their checkers, and the
train/val/prompts/pairs files. Small sizes so the whole module runs in a few seconds."""

import hashlib
import json
import os
import random
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from data.demo import corpus as demo_corpus
from data.demo import examples, scoring
from data.demo import tasks as dt

REPO = Path(__file__).resolve().parents[3]
SMALL = dict(n_train=600, n_val=120, n_pairs=400)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> dict[str, Path]:
    return dt.write_demo_dataset(tmp_path_factory.mktemp("demo"), seed=0, **SMALL)


@pytest.fixture(scope="module")
def records(dataset) -> dict[str, list[dict]]:
    return {key: dt.load_jsonl(dataset[key]) for key in dt.DATA_FILES}


@pytest.fixture(scope="module")
def default_mix() -> list[dict]:
    return examples.build_examples(2000, seed=0, split="train")


def digests(paths: dict[str, Path]) -> dict[str, str]:
    return {key: hashlib.sha256(paths[key].read_bytes()).hexdigest() for key in dt.DATA_FILES}


def speech_lines(passage: str) -> list[str]:
    """Lines of a rendered passage minus the "NAME:" header of each blank-line group."""
    return [line for group in passage.split("\n\n") for line in group.split("\n")[1:]]


# --- determinism, idempotence, files --------------------------------------------------


def test_same_seed_same_files_different_seed_different(tmp_path, dataset):
    again = dt.write_demo_dataset(tmp_path / "again", seed=0, **SMALL)
    other = dt.write_demo_dataset(tmp_path / "other", seed=1, **SMALL)
    assert digests(again) == digests(dataset)
    assert all(digests(other)[k] != digests(dataset)[k] for k in dt.DATA_FILES)


def test_cli_matches_api_under_another_hash_seed(tmp_path, dataset):
    # A subprocess with a different PYTHONHASHSEED catches any set/dict-order dependence.
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO)}
    args = ["--n-train", "600", "--n-val", "120", "--n-pairs", "400", "--seed", "0"]
    out = subprocess.run(
        [sys.executable, "-m", "data.demo.tasks", str(tmp_path / "cli"), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    cli_paths = {key: tmp_path / "cli" / name for key, name in dt.DATA_FILES.items()}
    assert digests(cli_paths) == digests(dataset)
    assert re.search(r"^train\s+600\b", out, re.M) and re.search(r"^pairs\s+400\b", out, re.M)
    assert re.search(r"short tasks' share of supervised answer tokens: \d+\.\d%", out)


def test_write_is_idempotent_and_rebuilds_on_change(tmp_path):
    out = tmp_path / "demo"
    paths = dt.write_demo_dataset(out, seed=3, n_train=50, n_val=20, n_pairs=30)
    assert set(paths) == {"train", "val", "prompts", "train_prompts", "pairs", "manifest"}
    mtimes = {k: p.stat().st_mtime_ns for k, p in paths.items()}
    dt.write_demo_dataset(out, seed=3, n_train=50, n_val=20, n_pairs=30)
    assert {k: p.stat().st_mtime_ns for k, p in paths.items()} == mtimes  # skipped
    assert json.loads(paths["manifest"].read_text())["n_train"] == 50

    dt.write_demo_dataset(out, seed=3, n_train=60, n_val=20, n_pairs=30)  # new parameters
    assert len(dt.load_jsonl(paths["train"])) == 60
    paths["pairs"].unlink()  # a missing file forces a rebuild too
    dt.write_demo_dataset(out, seed=3, n_train=60, n_val=20, n_pairs=30)
    assert len(dt.load_jsonl(paths["pairs"])) == 30
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]  # no temp files left


def test_file_schemas(records):
    assert len(records["train"]) == SMALL["n_train"] and len(records["val"]) == SMALL["n_val"]
    assert len(records["pairs"]) == SMALL["n_pairs"]
    for r in records["train"] + records["val"]:
        assert [m["role"] for m in r["messages"]] == ["user", "assistant"]
        assert r["messages"][1]["content"] == r["answer"] == r["meta"]["answer"]
        assert r["kind"] == examples.TASKS[r["task"]].kind
    # prompts.jsonl is val without the assistant turn, same order
    assert len(records["prompts"]) == len(records["val"])
    for p, v in zip(records["prompts"], records["val"]):
        assert p["messages"] == v["messages"][:1] and p["answer"] == v["answer"] and p["task"] == v["task"]
    for pair in records["pairs"]:
        assert [m["role"] for m in pair["prompt"]] == ["user"]
        assert isinstance(pair["chosen"], str) and isinstance(pair["rejected"], str)


def test_train_and_val_are_disjoint(records):
    def ids(recs):
        return {i for r in recs for i in r["meta"]["speech_ids"]}

    train_ids, val_ids, pair_ids = ids(records["train"]), ids(records["val"]), ids(records["pairs"])
    assert train_ids and val_ids
    assert not train_ids & val_ids
    assert not pair_ids & val_ids  # pairs come from the train pool only
    # the split itself partitions the corpus
    corpus = demo_corpus.load_corpus()
    train_pool = {s.idx for s in corpus.pool("train").speeches}
    val_pool = {s.idx for s in corpus.pool("val").speeches}
    assert not train_pool & val_pool
    assert train_pool | val_pool == {s.idx for s in corpus.speeches}
    assert 0.05 < len(val_pool) / len(corpus.speeches) < 0.15
    # multi-line passages (distinctive text) never reappear across the split
    train_text = {r["meta"].get("passage") for r in records["train"] + records["pairs"]}
    for r in records["val"]:
        if len(speech_lines(r["meta"].get("passage", ""))) >= 2:
            assert r["meta"]["passage"] not in train_text


# --- references and pairs -------------------------------------------------------------


def test_references_score_one_and_are_correct(records):
    corpus = demo_corpus.load_corpus()
    by_idx = {s.idx: s for s in corpus.speeches}
    for r in records["train"] + records["val"]:
        meta, answer, prompt = r["meta"], r["answer"], r["messages"][0]["content"]
        assert scoring.score_example(r, answer) == 1.0
        json.dumps(meta)  # serialisable
        if r["task"] == "first_speaker":
            assert meta["passage"].split("\n")[0] == answer + ":"
        elif r["task"] == "mentions_word":
            present = re.search(rf"\b{re.escape(meta['word'])}\b", meta["passage"].lower()) is not None
            assert answer == ("yes" if present else "no")
        elif r["task"] == "line_count":
            assert answer == str(len(speech_lines(meta["passage"])))
        elif r["task"] == "repeat":
            assert answer == meta["passage"] and prompt.endswith("\n\n" + answer)
        elif r["task"] == "continue_speech":
            (idx,) = meta["speech_ids"]
            speech, shown = by_idx[idx], meta["n_shown"]
            assert prompt == f"Continue this speech by {speech.speaker}:\n\n" + "\n".join(speech.lines[:shown])
            n = len(answer.split("\n"))
            assert 1 <= n <= 3 and answer == "\n".join(speech.lines[shown : shown + n])
        if "passage" in meta:
            assert prompt.endswith("\n\n" + meta["passage"])
            assert 1 <= len(speech_lines(meta["passage"])) <= 4


def test_pairs_rejected_scores_strictly_lower(records):
    seen = Counter()
    for pair in records["pairs"]:
        chosen, rejected = pair["chosen"], pair["rejected"]
        assert chosen != rejected and rejected.strip()
        assert scoring.score_example(pair, chosen) == 1.0
        assert scoring.score_example(pair, rejected) < scoring.score_example(pair, chosen)
        seen[pair["task"]] += 1
        if pair["task"] == "first_speaker":
            assert rejected in demo_corpus.load_corpus().short_names
        elif pair["task"] == "line_count":
            assert rejected in {"1", "2", "3", "4"}
        elif pair["task"] == "mentions_word":
            assert {chosen, rejected} == {"yes", "no"}
    assert set(seen) == set(examples.TASKS)


# --- checkers on hand-written responses -----------------------------------------------


def test_short_checkers():
    meta = {"answer": "ROMEO"}
    assert scoring.score("first_speaker", meta, " ROMEO \n") == 1.0
    assert scoring.score("first_speaker", meta, "JULIET") == 0.0
    assert scoring.score("first_speaker", meta, "romeo") == 0.0  # case-sensitive
    assert scoring.score("first_speaker", meta, "ROMEO speaks") == 0.0
    assert scoring.score("mentions_word", {"answer": "no"}, "no") == 1.0
    assert scoring.score("mentions_word", {"answer": "no"}, "yes") == 0.0
    assert scoring.score("line_count", {"answer": "3"}, "3\n") == 1.0
    assert scoring.score("line_count", {"answer": "3"}, "4") == 0.0


def test_repeat_checker():
    ref = "ROMEO:\nline one\nline two\n\nJULIET:\nline three"
    meta = {"answer": ref}
    assert scoring.score("repeat", meta, ref) == 1.0
    assert scoring.score("repeat", meta, "  " + ref.replace("\n\n", "\n") + "\n") == 1.0  # blank lines ignored
    assert scoring.score("repeat", meta, "ROMEO:\nline one") == pytest.approx(2 / 5)  # partial copy
    assert scoring.score("repeat", meta, "ROMEO:\nline two\nline one\n\nJULIET:\nline three") == pytest.approx(4 / 5)
    assert scoring.score("repeat", meta, "ROMEO:\nline one\nline TWO\n\nJULIET:\nline three") == pytest.approx(4 / 5)
    assert scoring.score("repeat", meta, (ref + "\n") * 3) == pytest.approx(5 / 15)  # padding is not free
    assert scoring.score("repeat", meta, "") == 0.0


def test_continue_checker_is_token_f1():
    meta = {"answer": "a b c d"}
    assert scoring.score("continue_speech", meta, "a b c d") == 1.0
    assert scoring.score("continue_speech", meta, "a b") == pytest.approx(2 * 1 * 0.5 / 1.5)
    assert scoring.score("continue_speech", meta, "x y z") == 0.0
    assert scoring.score("continue_speech", meta, "") == 0.0
    assert scoring.token_f1("a a b", "a b b") == pytest.approx(2 / 3)  # multiset overlap


def test_checkers_never_raise_on_arbitrary_text(records):
    rng = random.Random(0)
    weird = [
        "",
        " ",
        "\n\n\n",
        "\x00",
        "\u2028\u2029",
        "🙂" * 50,
        "\ud800",
        "ROMEO\r\n",
        "x" * 1_000_000,
        "line\n" * 100_000,
        "".join(chr(rng.randrange(1, 0x10FFFF)) for _ in range(2000)),
    ]
    examples = {}
    for r in records["train"]:
        examples.setdefault(r["task"], r)
    for r in examples.values():
        for text in weird + [r["answer"] * 1000, None, b"\xff\xfe", 12]:
            value = scoring.score_example(r, text)
            assert isinstance(value, float) and 0.0 <= value <= 1.0
    with pytest.raises(ValueError):
        scoring.score("no_such_task", {}, "x")


# --- token budget and mix -------------------------------------------------------------


def test_short_answers_are_one_or_two_tokens(tok, default_mix):
    short = [r for r in default_mix if r["kind"] == "short"]
    lengths = [len(tok.encode(r["answer"].strip())) for r in short]
    assert min(lengths) >= 1
    assert sum(n <= 2 for n in lengths) >= 0.95 * len(lengths)


def test_long_answers_dominate_supervised_tokens(tok, default_mix):
    share = dt.short_token_share(default_mix, tok)
    assert 0.0 < share < 0.15
    # the eot token counts: supervised tokens equal the encode_chat assistant mask
    r = default_mix[0]
    _, mask = tok.encode_chat(r["messages"])
    assert sum(mask) == dt.answer_tokens([r], tok)[0][2]


def test_everything_fits_seq_len_256(tok, default_mix, records):
    for r in default_mix + records["val"]:
        ids, _ = tok.encode_chat(r["messages"])
        assert len(ids) <= 256
        assert len(tok.encode_chat(r["messages"][:1])[0]) <= 128  # short prompts
    for pair in records["pairs"]:
        for answer in (pair["chosen"], pair["rejected"]):
            assert len(tok.encode_chat(pair["prompt"] + [{"role": "assistant", "content": answer}])[0]) <= 256


@pytest.mark.parametrize("short_share", [0.0, 0.3, 0.5, 1.0])
def test_task_balance_matches_short_share(short_share):
    n = 100
    recs = examples.build_examples(n, seed=7, short_share=short_share)
    kinds, tasks = Counter(r["kind"] for r in recs), Counter(r["task"] for r in recs)
    n_short = round(n * short_share)
    assert kinds["short"] == n_short and kinds["long"] == n - n_short
    for names, total in ((examples.SHORT_TASKS, n_short), (examples.LONG_TASKS, n - n_short)):
        per_task = [tasks[t] for t in names]
        assert sum(per_task) == total and max(per_task) - min(per_task) <= 1


def test_default_mix_balance(default_mix):
    tasks = Counter(r["task"] for r in default_mix)
    assert tasks == {
        "first_speaker": 200,
        "mentions_word": 200,
        "line_count": 200,
        "repeat": 700,
        "continue_speech": 700,
    }
    answers = Counter(r["answer"] for r in default_mix if r["task"] == "mentions_word")
    assert answers == {"yes": 100, "no": 100}
    digits = Counter(r["answer"] for r in default_mix if r["task"] == "line_count")
    assert set(digits) == {"1", "2", "3", "4"} and min(digits.values()) >= 30
    # records are shuffled, not grouped by task
    assert len({r["task"] for r in default_mix[:20]}) >= 3


def test_build_examples_is_deterministic():
    a = examples.build_examples(50, seed=11)
    assert a == examples.build_examples(50, seed=11)
    assert a != examples.build_examples(50, seed=12)
    with pytest.raises(ValueError):
        examples.build_examples(10, seed=0, short_share=1.5)
    with pytest.raises(ValueError):
        examples.build_examples(10, seed=0, split="test")


def test_train_prompts_and_the_demo_shape_for_rl(tmp_path):
    """train_prompts.jsonl is train without the assistant turn; short_share and line_count_max shape the tasks
    (the default demo RL learns on), and the defaults leave every file as it was."""
    paths = dt.write_demo_dataset(
        tmp_path / "rl", n_train=200, n_val=100, n_pairs=20, short_share=0.6, line_count_max=8
    )
    train, prompts = dt.load_jsonl(paths["train"]), dt.load_jsonl(paths["train_prompts"])
    assert [r["messages"][:-1] for r in train] == [r["messages"] for r in prompts]
    val = dt.load_jsonl(paths["val"])
    assert sum(r["kind"] == "short" for r in val) == 60
    counts = {int(r["answer"]) for r in train + val if r["task"] == "line_count"}
    assert max(counts) > 4 and counts <= set(range(1, 9))
    for pair in dt.load_jsonl(paths["pairs"]):
        if pair["task"] == "line_count":
            assert pair["rejected"] != pair["chosen"] and 1 <= int(pair["rejected"]) <= 8
    default = dt.write_demo_dataset(tmp_path / "default", n_train=50, n_val=20, n_pairs=30)
    assert all(int(r["answer"]) <= 4 for r in dt.load_jsonl(default["train"]) if r["task"] == "line_count")
    with pytest.raises(ValueError, match="line_count_max must be in"):
        dt.write_demo_dataset(tmp_path / "bad", n_train=5, n_val=5, n_pairs=5, line_count_max=10)


def test_line_count_miscount_changes_only_the_demonstrations(tmp_path):
    """line_count_miscount: that share of the line_count SFT demonstrations answers one line too many; the references,
    the held-out set, the pairs and the RL prompts stay as they were, and 0 leaves every file byte-identical."""
    shape = dict(n_train=300, n_val=60, n_pairs=40, short_share=0.6, line_count_max=8)
    clean = dt.write_demo_dataset(tmp_path / "clean", **shape)
    noisy = dt.write_demo_dataset(tmp_path / "noisy", line_count_miscount=0.6, **shape)
    # 0 changes nothing, and is not even recorded: folders written before the option stay current (no re-runs)
    assert examples.miscount_line_counts(dt.load_jsonl(clean["train"]), 0.0, seed=0) == dt.load_jsonl(clean["train"])
    assert "line_count_miscount" not in json.loads(clean["manifest"].read_text())
    assert json.loads(noisy["manifest"].read_text())["line_count_miscount"] == 0.6
    for key in ("val", "prompts", "pairs"):
        assert noisy[key].read_bytes() == clean[key].read_bytes()
    clean_train, noisy_train = dt.load_jsonl(clean["train"]), dt.load_jsonl(noisy["train"])
    assert dt.load_jsonl(noisy["train_prompts"]) == dt.load_jsonl(clean["train_prompts"])
    line_count = [(c, n) for c, n in zip(clean_train, noisy_train, strict=True) if c["task"] == "line_count"]
    wrong = [(c, n) for c, n in line_count if n.get("miscounted")]
    assert len(wrong) == round(0.6 * len(line_count)) > 0
    for c, n in wrong:
        said = n["messages"][-1]["content"]
        assert said == str(int(c["answer"]) + 1) and scoring.score_example(n, said) == 0.0
        assert n["answer"] == c["answer"] and n["meta"] == c["meta"] and n["messages"][:-1] == c["messages"][:-1]
    untouched = [(c, n) for c, n in zip(clean_train, noisy_train, strict=True) if not n.get("miscounted")]
    assert all(c == n for c, n in untouched)
    with pytest.raises(ValueError, match="line_count_miscount must be in"):
        dt.write_demo_dataset(tmp_path / "bad", n_train=5, n_val=5, n_pairs=5, line_count_miscount=1.5)
    with pytest.raises(ValueError, match="needs line_count_max <= 8"):  # a miscounted 9 is not a digit
        dt.write_demo_dataset(
            tmp_path / "bad", n_train=5, n_val=5, n_pairs=5, line_count_max=9, line_count_miscount=0.5
        )
    assert not (tmp_path / "bad").exists()
