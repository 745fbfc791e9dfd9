"""The second real model: Gemma 3 270M (base), its Q4_K_M GGUF file converted once per session (the ``gemma3`` fixture,
tests/real_model.py). Lantern's conversion gives transformers' own reading of the same file: the same tokens, logits
within 1e-4 and the same greedy continuations of five prompts (18 layers, three of them global, and 262,144 tokens);
a LoRA SFT run under Gemma 3's chat template lowers its held-out loss."""

from __future__ import annotations

import importlib.resources
import json
import math
import os
import random
import shutil

import pytest
import torch

from tests.alignment.test_real_model import FIRST, LAST, HeldOutLossAtStart, greeting_chats, read_metric, write_jsonl
from trainer.config import load_config

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "The three primary colors are",
    "Water boils at",
]
MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def models(gemma3):
    """(Lantern's conversion, transformers' own reading of the GGUF file, its tokenizer)."""
    transformers = pytest.importorskip("transformers")
    from models.formats.checkpoint import load_checkpoint
    from models.formats.gguf_reader import parsed_once

    folder, name = str(gemma3.gguf.parent), gemma3.gguf.name

    @parsed_once  # transformers' two readings share one parse of the file's metadata (its 262k-token vocabulary)
    def read_theirs():
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        return model.eval(), transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)

    theirs, tokenizer = read_theirs()
    return load_checkpoint(gemma3.folder).eval(), theirs, tokenizer


def test_the_conversion_is_transformers_reading_of_the_file(gemma3, models):
    from data.tokenizer.base import load_tokenizer
    from models.generation import generate
    from models.model import ModelConfig

    ours, theirs, hf_tokenizer = models
    assert ours.config == ModelConfig.from_preset("gemma3-270m")  # the preset is the published model
    tokenizer = load_tokenizer(gemma3.folder)
    for prompt in PROMPTS:
        ids = hf_tokenizer(prompt, return_tensors="pt")["input_ids"]
        assert tokenizer.encode(prompt, bos=True) == ids[0].tolist(), prompt
        with torch.no_grad():
            assert (ours(ids) - theirs(ids).logits).abs().max().item() <= 1e-4, prompt
            expected = theirs.generate(ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)[0, ids.shape[1] :]
        greedy = generate(ours, [ids[0].tolist()], max_new_tokens=MAX_NEW_TOKENS, temperature=0.0)
        assert greedy.tokens[0].tolist() == expected.tolist(), (prompt, hf_tokenizer.decode(expected))


def test_lora_sft_under_gemmas_chat_template_lowers_held_out_loss(gemma3, tmp_path):
    """The base model's folder with Gemma 3's chat template added (the one TRL ships for identity checks, as a user
    copies the instruction-tuned model's): 10 LoRA steps of one greeting chat each, held-out chats with other names."""
    from alignment.schemas.sft import SFTConfig
    from alignment.stages.sft import run_sft

    folder = tmp_path / "gemma3-270m-chat"
    folder.mkdir()
    for path in gemma3.folder.iterdir():  # the weights linked, the small files copied
        os.link(path, folder / path.name) if path.name == "model.safetensors" else shutil.copy(path, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    template = importlib.resources.files("trl") / "chat_templates" / "gemma3.jinja"
    config["chat_template"] = template.read_text(encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))

    names = [(first, last) for first in FIRST for last in LAST]
    random.Random(0).shuffle(names)
    train = write_jsonl(tmp_path / "train.jsonl", greeting_chats(names[:40]))
    val = write_jsonl(tmp_path / "val.jsonl", greeting_chats(names[40:56]))
    config = load_config(
        SFTConfig,
        None,
        [
            f"init.checkpoint={folder}", f"data.train=[{train}]", f"data.val=[{val}]", "data.seq_len=48",
            "data.packing=false", f"run.out_dir={tmp_path}", "run.name=run", "peft.kind=lora", "peft.rank=8",
            "peft.alpha=16", "loader.micro_batch_size=1", "optim.lr=3e-3", "optim.min_lr=3e-3", "optim.warmup_steps=0",
            "trainer.max_steps=10", "trainer.val_every_n_steps=10", "trainer.log_every_n_steps=1",
            "checkpoint.every_n_steps=10", "logger.kind=csv", "eval.generations=0",
        ],
    )  # fmt: skip
    before = HeldOutLossAtStart()
    run_dir = run_sft(config, extra_callbacks=[before])
    after = read_metric(run_dir, "metrics.csv", "val/loss")
    assert before.loss is not None and math.isfinite(before.loss) and list(after) == [10]
    assert after[10] < 0.5 * before.loss, (before.loss, after)
