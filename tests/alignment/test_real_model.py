"""A real pretrained model through the whole stack: SmolLM2-135M-Instruct's GGUF file converted once per session
(the ``smollm2`` fixture, tests/real_model.py) generates, greedily, what transformers generates from the same file,
token for token, with its own tokenizer and ChatML template; 10 LoRA SFT steps lower its held-out loss; GRPO and
DPO run on it with its chat template and write their checkpoints. LoRA, rows of at most 64 tokens and 2 to 10 steps
throughout: on two cores a LoRA step of the 135M model on one 40-token row takes about half a second."""

from __future__ import annotations

import csv
import json
import math
import random
from pathlib import Path

import lightning as L
import pytest
import torch

import models.generation
from alignment.commands.cli import main
from data.tokenizer.base import load_tokenizer
from data.tokenizer.tokenizer import Tokenizer
from models.formats.checkpoint import load_checkpoint
from models.loss import IGNORE_INDEX
from tests.helpers import assert_transformers_loads
from trainer.config import load_config

# five questions; the greedy answers of the first four end with <|im_end|>, the fifth is cut at MAX_NEW_TOKENS
PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 2 + 2?",
    "Translate 'thank you' into French.",
    "What color is the sky on a clear day?",
]
MAX_NEW_TOKENS = 16
SMOLLM_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
LORA = ("peft.kind=lora", "peft.rank=8", "peft.alpha=16")


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def read_metric(run_dir: Path, csv_name: str, metric: str) -> dict[int, float]:
    with open(run_dir / csv_name, newline="") as handle:
        return {int(r["step"]): float(r["value"]) for r in csv.DictReader(handle) if r["metric"] == metric}


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# ---- greedy generation against transformers ----


@pytest.fixture(scope="module")
def reference(smollm2) -> dict[str, dict]:
    """transformers' own reading of the GGUF file (model and tokenizer): per prompt, the chat-template prompt ids,
    the greedy continuation's ids (with its <|im_end|> if it stopped) and its text up to that <|im_end|>."""
    transformers = pytest.importorskip("transformers")
    folder, name = str(smollm2.gguf.parent), smollm2.gguf.name
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    assert tokenizer.eos_token == "<|im_end|>"
    found = {}
    for prompt in PROMPTS:
        ids = tokenizer.apply_chat_template(user(prompt), add_generation_prompt=True, return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_NEW_TOKENS)
        new = out[0, len(ids) :].tolist()
        text_ids = new[: new.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in new else new
        found[prompt] = {"prompt_ids": list(ids), "ids": new, "text": tokenizer.decode(text_ids)}
    return found


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_chat_generation_equals_transformers(smollm2, reference, prompt, capsys, monkeypatch):
    """``lantern generate --chat --temperature 0`` on the converted folder: the same prompt ids (SmolLM2's ChatML
    template with its default system turn), the same new ids and the same text as transformers' greedy decoding."""
    calls = []
    generate = models.generation.generate

    def spy(model, prompts, **kwargs):
        out = generate(model, prompts, **kwargs)
        calls.append((prompts, out))
        return out

    monkeypatch.setattr(models.generation, "generate", spy)
    code = main(
        [
            "generate", "--checkpoint", str(smollm2.folder), "--chat", "--prompt", prompt,
            "--max-new-tokens", str(MAX_NEW_TOKENS), "--temperature", "0", "--device", "cpu",
        ]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0
    expected = reference[prompt]
    [(prompts, out)] = calls
    assert prompts == [expected["prompt_ids"]]
    assert out.tokens[0][out.mask[0]].tolist() == expected["ids"]
    assert printed == expected["text"] + "\n"  # with --chat the reply alone
    if prompt == PROMPTS[0]:
        assert "Paris" in printed, printed


# ---- LoRA SFT lowers the held-out loss ----


FIRST = ["Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry", "Irene", "James", "Karen", "Louis"]
LAST = ["Smith", "Jones", "Brown", "Taylor", "Wilson", "Clark", "Lewis", "Walker", "Young", "King"]


def greeting_chats(names: list[tuple[str, str]]) -> list[dict]:
    """One answer format, the name copied in: "Greet Alice Smith." -> "Hello, Alice Smith! Nice to meet you." (a
    short system turn keeps the rows short: the template's default one is 17 tokens)."""
    return [
        {
            "messages": [
                {"role": "system", "content": "Greet."},
                {"role": "user", "content": f"Greet {first} {last}."},
                {"role": "assistant", "content": f"Hello, {first} {last}! Nice to meet you."},
            ]
        }
        for first, last in names
    ]


class HeldOutLossAtStart(L.Callback):
    """The validation loss (every supervised val token's loss over their count, what SFTModule logs as val/loss)
    of the model as it starts, adapters included (LoRA's B is zero: the converted model itself)."""

    loss: float | None = None

    def on_train_start(self, trainer, module) -> None:
        total, tokens = 0.0, 0
        module.eval()
        with torch.no_grad():
            for batch in trainer.datamodule.val_dataloader():
                batch = {k: v.to(module.device) if torch.is_tensor(v) else v for k, v in batch.items()}
                total += module._token_losses(batch).sum().item()
                tokens += int((batch["targets"] != IGNORE_INDEX).sum())
        module.train()
        self.loss = total / tokens


def test_lora_sft_from_the_converted_folder_lowers_held_out_loss(smollm2, tmp_path):
    """10 LoRA steps of one chat each (unpacked rows of 40 tokens: the longest chat has 36) from the converted folder,
    its own tokenizer found by data.tokenizer=auto: the held-out loss of 32 chats with other names falls from about
    1.7 to a fraction of it (the run's val/loss at step 10 against the same loss computed as training starts)."""
    from alignment.schemas.sft import SFTConfig
    from alignment.stages.sft import run_sft

    names = [(first, last) for first in FIRST for last in LAST]
    random.Random(0).shuffle(names)
    train = write_jsonl(tmp_path / "train.jsonl", greeting_chats(names[:40]))
    val = write_jsonl(tmp_path / "val.jsonl", greeting_chats(names[40:72]))  # held out: other names
    config = load_config(
        SFTConfig,
        None,
        [
            f"init.checkpoint={smollm2.folder}", f"data.train=[{train}]", f"data.val=[{val}]", "data.seq_len=40",
            "data.packing=false", f"run.out_dir={tmp_path}", "run.name=run", *LORA, "loader.micro_batch_size=1",
            "optim.lr=3e-3", "optim.min_lr=3e-3", "optim.warmup_steps=0", "trainer.max_steps=10",
            "trainer.val_every_n_steps=10", "trainer.log_every_n_steps=1", "checkpoint.every_n_steps=10",
            "logger.kind=csv", "eval.generations=0",
        ],
    )  # fmt: skip
    assert config.data.tokenizer == "auto"
    before = HeldOutLossAtStart()
    run_dir = run_sft(config, extra_callbacks=[before])

    assert Path(config.data.tokenizer) == smollm2.folder / "tokenizer.json"  # auto: the folder's own tokenizer
    after = read_metric(run_dir, "metrics.csv", "val/loss")
    assert list(after) == [10]
    assert before.loss is not None and math.isfinite(before.loss)
    assert before.loss > 1.0 and after[10] < 0.25 * before.loss, (before.loss, after)  # 1.70 -> 0.14 measured
    assert (run_dir / "checkpoints" / "step-00000010.ckpt").is_file()
    # final/ (the adapters merged) is a folder transformers loads as it is, with SmolLM2's own tokenizer
    assert_transformers_loads(run_dir / "final", load_checkpoint(run_dir / "final"), load_tokenizer(run_dir / "final"))


# ---- GRPO and DPO with the chat template ----


def names_the_answer(record: dict, answer: str) -> float:
    """A verifiable reward: 1 when the answer names the record's ``answer``."""
    return float(record["answer"].lower() in answer.lower())


def lora_tensors_only(checkpoint: Path) -> bool:
    state = torch.load(checkpoint, weights_only=True)["state_dict"]
    return bool(state) and all("lora_" in name for name in state)


def test_grpo_runs_on_the_converted_folder_with_its_chat_template(smollm2, tmp_path, monkeypatch):
    """2 GRPO rollouts (one prompt, a group of 2, 8 new tokens, a checker reward) with LoRA from the converted folder:
    every rollout prompt is SmolLM2's ChatML encoding (default system turn included), the losses are finite, the first
    KL is 0 (LoRA's B starts at zero), the held-out before/after, the adapters' checkpoint and final/ are written."""
    from alignment.schemas.rl import GRPOConfig
    from alignment.stages import rl_module
    from alignment.stages.grpo import run_grpo

    questions = {"What is the capital of France?": "Paris", "What is the capital of Italy?": "Rome"}
    train = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": q, "answer": a} for q, a in questions.items()])
    val = write_jsonl(tmp_path / "val.jsonl", [{"prompt": "What is the capital of Spain?", "answer": "Madrid"}])
    rollouts = []
    generate = rl_module.generate

    def spy(model, prompts, **kwargs):
        rollouts.append([list(p) for p in prompts])
        return generate(model, prompts, **kwargs)

    monkeypatch.setattr(rl_module, "generate", spy)
    checker = f"{__name__}:names_the_answer"
    config = load_config(
        GRPOConfig,
        None,
        [
            f"init.policy={smollm2.folder}", f"data.train=[{train}]", f"data.val=[{val}]", f"run.out_dir={tmp_path}",
            "run.name=run", *LORA, f"reward.terms=[{{kind: checker, path: '{checker}'}}]", f"eval.checker={checker}",
            "grpo.prompts_per_rollout=1", "grpo.group_size=2", "grpo.minibatch_size=2", "grpo.micro_batch_size=2",
            "grpo.response_max_tokens=8", "trainer.max_steps=2", "trainer.log_every_n_steps=1", "optim.lr=1e-3",
            "checkpoint.every_n_steps=2", "eval.every_n_rollouts=100", "eval.pass_k=0", "logger.kind=csv",
        ],
    )  # fmt: skip
    run_dir = run_grpo(config)

    tokenizer = Tokenizer.load(smollm2.folder)
    encoded = {tuple(tokenizer.encode_chat_prompt(user(q))) for q in questions}
    assert len(rollouts) == 2 and all(len(rows) == 2 for rows in rollouts)  # 2 rollouts of a group of 2
    for rows in rollouts:
        assert len({tuple(row) for row in rows}) == 1 and tuple(rows[0]) in encoded  # one prompt, sampled twice
        assert tokenizer.decode(rows[0]).startswith(SMOLLM_SYSTEM + "<|im_start|>user\nWhat is the capital of")
    losses = read_metric(run_dir, "metrics.csv", "grpo/policy_loss")
    kl = read_metric(run_dir, "kl.csv", "grpo/kl")
    assert list(losses) == list(kl) == [1, 2]
    assert all(math.isfinite(v) for v in [*losses.values(), *kl.values()]) and kl[1] == 0.0
    assert set(json.loads((run_dir / "heldout.json").read_text())) == {"before", "after"}
    assert lora_tensors_only(run_dir / "checkpoints" / "step-00000002.ckpt")
    assert (run_dir / "final" / "model.safetensors").is_file()


def test_rl_scoring_runs_the_system_turn_once_and_gives_the_full_rows_log_probs_and_gradients(smollm2):
    """RL's scoring of SmolLM2 chat rows (the system turn and user header every prompt starts with, run once, as
    GRPO's and PPO's reference and training passes run it) against the same rows scored whole: the log-probs of every
    answer token, and the gradient reaching the first block's key projection (through the prefix's keys too)."""
    from alignment.shared.responses import response_logprobs
    from models.generation import left_pad
    from models.prefill import shared_prefix_length

    tokenizer = Tokenizer.load(smollm2.folder)
    questions = {"What is 56 + 30?": "56 + 30 = 86", "What is 17 * 3?": "51", "Name three primary colors.": "Red."}
    prompts = [tokenizer.encode_chat_prompt(user(q)) for q in questions]
    answers = [tokenizer.encode(a) + [tokenizer.eos_id] for a in questions.values()]
    shared = shared_prefix_length(prompts)
    assert tokenizer.decode(prompts[0][:shared]).startswith(SMOLLM_SYSTEM)  # the system turn and more
    prompt_ids, prompt_real = left_pad(prompts, tokenizer.pad_id)
    width = max(len(a) for a in answers)
    response = torch.tensor([a + [tokenizer.pad_id] * (width - len(a)) for a in answers])
    response_real = torch.tensor([[i < len(a) for i in range(width)] for a in answers])
    input_ids, real, P = (
        torch.cat([prompt_ids, response], 1),
        torch.cat([prompt_real, response_real], 1),
        prompt_ids.shape[1],
    )
    model = load_checkpoint(smollm2.folder)
    embedded: list[tuple[int, ...]] = []
    model.tok_embeddings.register_forward_hook(lambda module, args, out: embedded.append(tuple(args[0].shape)))
    scored = {}
    for once in (shared, 0):
        model.zero_grad()
        logp = response_logprobs(model, input_ids, real, P, 1.0, once)[0]
        (logp * response_real).sum().backward()
        scored[once] = logp.detach()[response_real], model.layers[0].attention.wk.weight.grad.clone()
    assert embedded == [(4, input_ids.shape[1] - shared), tuple(input_ids.shape)]  # the prefix a row of its own
    torch.testing.assert_close(scored[shared][0], scored[0][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(scored[shared][1], scored[0][1], atol=1e-4, rtol=1e-3)


class Batches(L.Callback):
    def __init__(self) -> None:
        self.input_ids: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.input_ids.append(batch["input_ids"].cpu())


def test_dpo_runs_on_the_converted_folder_with_its_chat_template(smollm2, tmp_path):
    """2 DPO steps of 2 pairs with LoRA from the converted folder: every side trained on is the ChatML encoding of its
    prompt and reply, up to the reply's <|im_end|>; the first loss is log 2 (the policy is its reference), every loss
    is finite, the adapters' checkpoint and final/ are written."""
    from alignment.schemas.dpo import DPOConfig
    from alignment.stages.dpo import run_dpo

    pairs = [
        {"prompt": "What is the capital of France?", "chosen": "Paris.", "rejected": "London."},
        {"prompt": "What is 2 + 2?", "chosen": "4.", "rejected": "5."},
        {"prompt": "What colour is grass?", "chosen": "Green.", "rejected": "Purple."},
        {"prompt": "How many legs does a cat have?", "chosen": "Four.", "rejected": "Six."},
    ]
    held_out = [{"prompt": "What is the capital of Spain?", "chosen": "Madrid.", "rejected": "Paris."}]
    train = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    val = write_jsonl(tmp_path / "val.jsonl", held_out)
    config = load_config(
        DPOConfig,
        None,
        [
            f"init.policy={smollm2.folder}", f"data.train=[{train}]", f"data.val=[{val}]", f"run.out_dir={tmp_path}",
            "run.name=run", *LORA, "loader.micro_batch_size=2", "data.seq_len=64", "trainer.max_steps=2",
            "trainer.val_every_n_steps=2", "trainer.log_every_n_steps=1", "checkpoint.every_n_steps=2",
            "optim.lr=1e-3", "optim.warmup_steps=0", "logger.kind=csv",
        ],
    )  # fmt: skip
    batches = Batches()
    run_dir = run_dpo(config, extra_callbacks=[batches])

    tokenizer = Tokenizer.load(smollm2.folder)
    sides = set()
    for pair in pairs:
        prompt = tokenizer.encode_chat_prompt(user(pair["prompt"]))
        for reply in (pair["chosen"], pair["rejected"]):
            ids, mask = tokenizer.encode_chat([*user(pair["prompt"]), {"role": "assistant", "content": reply}])
            end = max(i for i, trained in enumerate(mask) if trained) + 1  # the reply's <|im_end|>, not the "\n"
            assert ids[: len(prompt)] == prompt and ids[end - 1] == tokenizer.eot_id
            sides.add(tuple(ids[:end]))
    rows = [row.tolist() for batch in batches.input_ids for row in batch]
    assert len(rows) == 8  # 2 steps of 2 pairs, both sides
    for row in rows:  # each side: the chat prompt, the reply and its <|im_end|> as the template encodes them, then pads
        assert any(tuple(row[: len(side)]) == side for side in sides), tokenizer.decode(row)
        assert tokenizer.decode(row).startswith(SMOLLM_SYSTEM + "<|im_start|>user\n")
    losses = read_metric(run_dir, "metrics.csv", "train/loss")
    val_loss = read_metric(run_dir, "metrics.csv", "val/loss")
    assert list(losses) == [1, 2] and list(val_loss) == [2]
    assert losses[1] == pytest.approx(math.log(2), abs=1e-6)  # LoRA's B starts at zero: the policy is the reference
    assert all(math.isfinite(v) for v in [*losses.values(), *val_loss.values()])
    assert lora_tensors_only(run_dir / "checkpoints" / "step-00000002.ckpt")
    assert (run_dir / "final" / "model.safetensors").is_file()
