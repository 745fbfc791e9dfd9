"""Hugging Face tokenizer.json checkpoints: chats encode token for token as transformers' apply_chat_template gives
them, with the assistant tokens masked, under the chat templates real checkpoints ship."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from data.tokenizer.base import load_tokenizer, resolve_tokenizer_spec
from data.tokenizer.hf import HFTokenizer
from data.tokenizer.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>"]
SPECIALS += ["<|end_header_id|>", "<|eot_id|>"]

# SmolLM2-Instruct's template as its tokenizer ships it (a default system turn when there is none)
CHATML_SMOL = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Meta-Llama-3-8B-Instruct's template
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Qwen2.5-Instruct's template, without its tool-calling branches
QWEN25 = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    '<|im_end|>\n\' }}{%- endif %}{%- for message in messages %}{%- if (message.role == "user") or (message.role == '
    "\"system\" and not loop.first) or (message.role == \"assistant\") %}{{- '<|im_start|>' + message.role + '\n' + "
    "message.content + '<|im_end|>' + '\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
# ChatML with transformers' {% generation %} markers around what the assistant writes
CHATML_MARKED = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}{% else %}"
    "{{ message['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TEMPLATES = {
    "chatml-smollm2": (CHATML_SMOL, "<|im_start|>", "<|im_end|>"),
    "llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>"),
    "qwen2.5": (QWEN25, None, "<|im_end|>"),
    "chatml-generation-tags": (CHATML_MARKED, "<|im_start|>", "<|im_end|>"),
}

TURNS = [
    "What is the capital of France?",
    "Paris.",
    "",
    "  padded with spaces  ",
    "Ünïcödé: 你好, мир, مرحبا, 👋🏽 and e\u0301",
    "two\nlines\n\nand a blank one",
    "Numbers 12345 and 3.14159 and -7",
    "code: def f(x):\n    return x * 2",
    "a <|im_end|> inside text",
]


def conversations() -> list[list[dict[str, str]]]:
    """≥ 20 chats: with and without a system turn, one to four exchanges, empty and unicode turns."""
    chats = [
        [{"role": "user", "content": TURNS[0]}, {"role": "assistant", "content": TURNS[1]}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}],
        [{"role": "system", "content": ""}, {"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
    ]
    for k in range(20):
        chat = [{"role": "system", "content": TURNS[k % len(TURNS)]}] if k % 3 == 0 else []
        for turn in range(1 + k % 4):
            chat.append({"role": "user", "content": TURNS[(k + turn) % len(TURNS)]})
            chat.append({"role": "assistant", "content": TURNS[(k + 2 * turn + 1) % len(TURNS)]})
        chats.append(chat)
    return chats


@pytest.fixture(scope="module")
def bpe_json(tmp_path_factory) -> Path:
    """A small byte-level BPE (GPT-2 pre-tokenizer, as SmolLM2 and Qwen2.5 ship) with chat special tokens."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = Path(__file__).resolve().parents[3] / "data" / "corpus"
    text = next(corpus.glob("*.txt")).read_text()[:200_000].splitlines()
    tok.train_from_iterator(text + TURNS * 20, trainer)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tok.save(str(path))
    return path


def folder_with(root: Path, bpe_json: Path, name: str) -> Path:
    template, bos, eos = TEMPLATES[name]
    folder = root / name
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(bpe_json.read_bytes())
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "chat_template": template,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def masked_runs(ids: list[int], mask: list[bool]) -> list[list[int]]:
    """The ids of each unbroken run of masked positions: one per trained turn."""
    runs, current = [], []
    for token, masked in zip(ids, mask):
        if masked:
            current.append(token)
        elif current:
            runs, current = [*runs, current], []
    return runs + ([current] if current else [])


def hf_ids(output) -> list[int]:
    return list(output["input_ids"] if hasattr(output, "keys") else output)


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_chats_are_token_for_token_what_transformers_gives(tmp_path, bpe_json, name):
    folder = folder_with(tmp_path, bpe_json, name)
    ours = load_tokenizer(folder)
    assert isinstance(ours, HFTokenizer)
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    eot = ours.token_to_id(TEMPLATES[name][2])
    assert ours.eot_id == eot and eot in ours.stop_ids
    chats = conversations()
    assert len(chats) >= 20
    for chat in chats:
        ids, mask = ours.encode_chat(chat)
        assert ids == hf_ids(theirs.apply_chat_template(chat, tokenize=True)), chat
        prompt = ours.encode_chat_prompt(chat[:-1] if chat[-1]["role"] == "assistant" else chat)
        expected = theirs.apply_chat_template(
            chat[:-1] if chat[-1]["role"] == "assistant" else chat, tokenize=True, add_generation_prompt=True
        )
        assert prompt == hf_ids(expected)
        # the mask: every assistant turn's content and its end-of-turn token, nothing else
        runs = masked_runs(ids, mask)
        replies = [m["content"] for m in chat if m["role"] == "assistant"]
        strip = name == "llama3"  # its template trims each turn
        assert [ours.decode(run) for run in runs] == [
            (r.strip() if strip else r) + TEMPLATES[name][2] for r in replies
        ], chat
        if name == "chatml-generation-tags":
            marked = theirs.apply_chat_template(
                chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            assert [bool(m) for m in marked["assistant_masks"]] == mask


def test_plain_text_never_turns_into_special_tokens_and_matches_the_library(tmp_path, bpe_json):
    ours = load_tokenizer(folder_with(tmp_path, bpe_json, "chatml-smollm2"))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "chatml-smollm2")
    for text in TURNS[:-1]:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)
        assert ours.decode(ours.encode(text)) == text
    ids = ours.encode("a <|im_end|> b")
    assert ours.token_to_id("<|im_end|>") not in ids and ours.decode(ids) == "a <|im_end|> b"
    assert ours.encode_batch(TURNS, bos=True, eos=True) == [ours.encode(t, bos=True, eos=True) for t in TURNS]
    assert ours.encode("hi", bos=True)[0] == ours.bos_id == ours.token_to_id("<|im_start|>")


def test_token_healing_and_bytes_work_on_byte_level_bpe(tmp_path, bpe_json):
    ours = load_tokenizer(folder_with(tmp_path, bpe_json, "qwen2.5"))
    text = "Ünïcödé 你好"
    ids = ours.encode(text)
    assert ours.decode_bytes(ids).decode("utf-8") == text
    prompt, removed, allowed = ours.heal_prompt(ours.encode("the kin"))
    assert removed and all(ours.token_bytes(i).startswith(removed) for i in allowed)
    assert ours.decode_bytes(prompt) + removed == b"the kin"
    assert ours.bos_id is None and ours.encode("x", bos=True) == ours.encode("x")  # Qwen2.5 has no BOS


def test_folder_choice_and_auto(tmp_path, bpe_json):
    folder = folder_with(tmp_path, bpe_json, "llama3")
    assert resolve_tokenizer_spec("auto", folder) == str(folder / "tokenizer.json")
    assert resolve_tokenizer_spec("auto", None) == "default" == resolve_tokenizer_spec("default", folder)
    (folder / "original").mkdir()
    (folder / "original" / "tokenizer.model").write_bytes(
        Tokenizer.load("default").files["tokenizer.model"].read_bytes()
    )
    assert isinstance(load_tokenizer(folder), HFTokenizer)  # tokenizer.json wins over Meta's original/
    (folder / "tokenizer.model").write_bytes(b"\x0a\x0b sentencepiece bytes")
    assert isinstance(load_tokenizer(folder), HFTokenizer)  # as over a sentencepiece tokenizer.model
    assert set(load_tokenizer(folder).files) == {"tokenizer.json", "tokenizer_config.json"}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"eos_token": "<|nope|>"}, "special token '<|nope|>' is not in tokenizer.json"),
        ({"eos_token": "<|im_end|>", "chat_template": "{{ bos_token }}{{ messages[0]['content'] }}"}, "uses bos_token"),
        ({"eos_token": "<|im_end|>", "chat_template": "{% for %}"}, "not a valid jinja2 template"),
        ({}, "no eos_token"),
    ],
)
def test_bad_tokenizer_folders_are_one_line(tmp_path, bpe_json, config, message):
    (tmp_path / "tokenizer.json").write_bytes(bpe_json.read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message) as error:
        load_tokenizer(tmp_path)
    assert "\n" not in str(error.value)


def test_a_base_tokenizer_without_template_refuses_chats_in_one_line(tmp_path, bpe_json):
    (tmp_path / "tokenizer.json").write_bytes(bpe_json.read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    tok = load_tokenizer(tmp_path)
    assert tok.eot_id == tok.eos_id == tok.token_to_id("<|endoftext|>")
    with pytest.raises(ValueError, match="has no chat template"):
        tok.encode_chat([{"role": "user", "content": "hi"}])


def test_a_template_whose_assistant_turns_cannot_be_found_is_refused(tmp_path, bpe_json):
    # repeats the last message after the chat: no rendering is a prefix of a longer one, and a turn's content is
    # written twice
    template = "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}{{ messages[-1]['content'] }}"
    (tmp_path / "tokenizer.json").write_bytes(bpe_json.read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": template}))
    with pytest.raises(ValueError, match="assistant turns cannot be found") as refused:
        load_tokenizer(tmp_path)
    assert "\n" not in str(refused.value)


def test_a_template_that_rewrites_earlier_text_still_masks_each_turn(tmp_path, bpe_json):
    # renders the conversation's length first: no rendering is a prefix of a longer one, yet each turn is one place
    template = "{{ messages|length }}{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}"
    (tmp_path / "tokenizer.json").write_bytes(bpe_json.read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": template}))
    tok = load_tokenizer(tmp_path)
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    ids, mask = tok.encode_chat([*chat, *chat])
    assert tok.decode(ids) == "4Hi<|im_end|>Yo<|im_end|>Hi<|im_end|>Yo<|im_end|>"
    assert [tok.decode([i for i, m in zip(ids, mask) if m])] == ["Yo<|im_end|>Yo<|im_end|>"]


def test_loading_and_encoding_with_a_tokenizer_json_imports_no_torch(tmp_path, bpe_json):
    """lantern prepare never imports torch: reading tokenizer_config.json once did (3 s of a prepare)."""
    import subprocess
    import sys

    from tests.helpers import subprocess_env

    folder = folder_with(tmp_path, bpe_json, "chatml-smollm2")
    code = (
        "import sys\nfrom data.tokenizer.base import load_tokenizer\n"
        f"load_tokenizer({str(folder)!r}).encode_batch(['a b'])\nprint('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[3],
                          env=subprocess_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.stdout.strip() == "False", done.stderr[-2000:]


def test_plain_encoding_takes_calls_from_several_threads_at_once(tmp_path, bpe_json):
    """Encoding is thread-safe (lantern prepare encodes on a thread of its own): each concurrent call of plain
    encoding gets what a lone call gets (a flag toggled around each call reached other threads' calls:
    "<|im_end|>" in a text became the special token), while encode_as_hf still reads them as the tokens."""
    from concurrent.futures import ThreadPoolExecutor

    tok = load_tokenizer(folder_with(tmp_path, bpe_json, "chatml-smollm2"))
    batches = [[f"{turn} {i}" for turn in TURNS] * 40 for i in range(8)]
    with ThreadPoolExecutor(4) as pool:
        encoded = list(pool.map(tok.encode_batch, batches))
        as_hf = list(pool.map(tok.encode_as_hf, ["a <|im_end|>"] * 8))
    assert encoded == [[tok.encode(text) for text in batch] for batch in batches]
    assert all(ids[-1] == tok.token_to_id("<|im_end|>") for ids in as_hf)


def test_prepare_packing_upsampling_and_worker_processes_work_with_a_tokenizer_json(tmp_path, bpe_json):
    """The data pipeline takes either backend: prepare's shards (num_proc 2; the tokenizer pickles, for datasets'
    worker processes elsewhere), and SFT's packed rows with short answers upsampled, whose targets are the assistant turns and nothing else."""
    import pickle

    import numpy as np

    from data.pretrain.config import PrepareConfig
    from data.pretrain.prepare import prepare
    from data.sft.datamodule import build_sft_data
    from data.sft.rows import SFTDataConfig
    from tests.data.pretrain.test_prepare import split_documents
    from tests.helpers import write_jsonl

    folder = folder_with(tmp_path, bpe_json, "chatml-smollm2")
    tok = load_tokenizer(folder)
    clone = pickle.loads(pickle.dumps(tok))
    chat = conversations()[5]
    assert clone.encode_chat(chat) == tok.encode_chat(chat) and clone.fingerprint == tok.fingerprint

    docs = [f"Document {i}: {TURNS[i % len(TURNS)]} and <|im_end|> as text.".replace("\n", " ") for i in range(24)]
    (tmp_path / "corpus.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    config = PrepareConfig(source=[str(tmp_path / "corpus.txt")], out_dir=str(tmp_path / "out"), tokenizer=str(folder))
    config.num_proc, config.val_fraction = 2, 0.0
    manifest = prepare(config)
    assert manifest["tokenizer"]["fingerprint"] == tok.fingerprint
    assert split_documents(tmp_path / "out", "train") == [tok.encode(d, bos=True, eos=True) for d in docs]

    short = [[{"role": "user", "content": f"short {i}"}, {"role": "assistant", "content": "Yes"}] for i in range(4)]
    answered = [c for c in conversations() if c[-1]["role"] == "assistant" and all(m["content"].strip() for m in c)]
    records = [{"messages": chat} for chat in short + answered[:12]]
    path = write_jsonl(tmp_path / "chats.jsonl", records)
    sft = SFTDataConfig(train=[str(path)], val_fraction=0.0, seq_len=1024, tokenizer=str(folder), short_answer_factor=3)
    sft.short_answer_max_tokens = len(tok.encode("Yes")) + 1  # the answer and <|im_end|>
    data = build_sft_data(sft, tok)
    assert data.stats["train"]["upsampling"]["short_after"] == 12
    supervised = []
    for r in range(len(data.train)):
        row = data.train.row(r)
        for d in range(len(data.train.examples_in(r))):
            targets = row["targets"][row["document_ids"] == d]
            supervised.append(tok.decode(targets[targets != -100].tolist()))
    expected = [
        "".join(m["content"] + "<|im_end|>" for m in e.conversation.messages if m["role"] == "assistant")
        for r in range(len(data.train))
        for e in (data.train_examples[i] for i in data.train.examples_in(r))
    ]
    assert sorted(supervised) == sorted(expected) and np.mean([s == "Yes<|im_end|>" for s in supervised]) > 0


def test_rl_prompts_and_dpo_pairs_are_what_transformers_gives(tmp_path, bpe_json):
    """RL prompts are apply_chat_template(prompt, add_generation_prompt=True); each DPO side is
    apply_chat_template(prompt + reply) up to the reply's <|im_end|>, with exactly the reply's assistant turns as
    its response tokens."""
    from data.preference.config import PreferenceDataConfig
    from data.preference.dpo import attach_answered_masks
    from data.preference.pairs import build_preference_data
    from data.records.prompts import PromptDataConfig, load_prompts
    from tests.helpers import write_jsonl

    folder = folder_with(tmp_path, bpe_json, "qwen2.5")
    tok = load_tokenizer(folder)
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    chats = [c for c in conversations() if c[-1]["role"] == "assistant" and all(m["content"].strip() for m in c)]
    rows = [{"messages": chat[:-1], "answer": chat[-1]["content"]} for chat in chats]
    prompts, _ = load_prompts(
        PromptDataConfig(max_prompt_tokens=4096), [str(write_jsonl(tmp_path / "p.jsonl", rows))], tok
    )
    assert len(prompts) == len(chats) >= 10
    for prompt, chat in zip(prompts, chats):
        assert prompt["prompt_ids"] == hf_ids(theirs.apply_chat_template(chat[:-1], add_generation_prompt=True))

    pairs = [{"prompt": chat[:-1], "chosen": chat[-1]["content"], "rejected": "No."} for chat in chats]
    config = PreferenceDataConfig(train=[str(write_jsonl(tmp_path / "pairs.jsonl", pairs))], val_fraction=0.0)
    config.seq_len = 4096
    data = build_preference_data(config, tok, stage="DPO")
    attach_answered_masks(data.train)
    end = tok.token_to_id("<|im_end|>")
    for index, chat in enumerate(chats):
        for side, reply, response in zip(
            (data.train.chosen[index], data.train.rejected[index]),
            (chat[-1]["content"], "No."),
            data.train.response_masks,
        ):
            full = hf_ids(theirs.apply_chat_template([*chat[:-1], {"role": "assistant", "content": reply}]))
            assert side.tolist() == full[: len(side)] and side[-1] == end and full[len(side) :] == theirs.encode("\n")
            assert tok.decode(side[response[index]].tolist()) == reply + "<|im_end|>"


def qwen3_chats() -> list[list[dict]]:
    """Qwen3's cases: thinking written in the content or as reasoning_content, kept after the last user message and
    dropped before it; a final reply without thinking (the template writes an empty think block); tool calls and
    their responses (several in a row are one user turn)."""
    think = "<think>\nThe user greets.\n</think>\n\nHello!"
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 2, "b": 3}}}
    return [
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": think}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": think},
            {"role": "user", "content": "What is 2 * 3?"},
            {"role": "assistant", "content": "6", "reasoning_content": "Two threes."},
        ],
        [
            {"role": "user", "content": "What is 2 * 3, and 4 * 5?"},
            {"role": "assistant", "content": "", "tool_calls": [call, call]},
            {"role": "tool", "name": "multiply", "content": "6"},
            {"role": "tool", "name": "multiply", "content": "20"},
            {"role": "assistant", "content": "Let me check.", "reasoning_content": "Both done.", "tool_calls": [call]},
            {"role": "tool", "name": "multiply", "content": "6"},
            {"role": "assistant", "content": "6 and 20."},
            {"role": "user", "content": TURNS[4]},
            {"role": "assistant", "content": TURNS[7]},
        ],
    ]


def test_qwen3s_template_thinking_and_tool_calls_are_what_transformers_gives(tmp_path, bpe_json):
    """Qwen3's own template (as TRL ships it for identity checks): ids as apply_chat_template gives them, and the
    mask on exactly what each assistant turn renders after its header, through <|im_end|>, in the whole chat
    (turns whose thinking the template drops once a later user message follows included)."""
    import importlib.resources
    import re

    template = (importlib.resources.files("trl") / "chat_templates" / "qwen3.jinja").read_text(encoding="utf-8")
    folder = tmp_path / "qwen3"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(bpe_json.read_bytes())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    ours = load_tokenizer(folder)
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    dropped = 0
    for chat in qwen3_chats():
        ids, mask = ours.encode_chat(chat)
        assert ids == hf_ids(theirs.apply_chat_template(chat, tokenize=True)), chat
        text = theirs.apply_chat_template(chat, tokenize=False)
        turns = re.findall(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)", text, flags=re.DOTALL)
        runs = masked_runs(ids, mask)
        assert [ours.decode(run) for run in runs] == turns, chat
        dropped += text.count("The user greets.") < sum(m["content"].count("The user greets.") for m in chat)
        prompt = chat[: max(i for i, m in enumerate(chat) if m["role"] != "assistant") + 1]
        expected = theirs.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True)
        assert ours.encode_chat_prompt(prompt) == hf_ids(expected)
    assert dropped == 1  # the multi-turn chat: its first turn's thinking is gone from the text, and from the mask


def test_tools_reach_the_template_as_transformers_passes_them(tmp_path, bpe_json):
    """``tools=`` (OpenAI's function format, ``Tool.schema()``) is rendered by the template that writes tools (Qwen3's:
    the same ids as ``apply_chat_template(chat, tools=...)``, the mask still on the assistant turns alone, tool turns
    context), and reported as not written by one that ignores them (SmolLM2-135M's)."""
    import importlib.resources

    from alignment.shared.tools import TOOLS
    from data.tokenizer.base import with_tool_instructions

    schemas = [tool.schema() for tool in TOOLS.values()]
    template = (importlib.resources.files("trl") / "chat_templates" / "qwen3.jinja").read_text(encoding="utf-8")
    folder = tmp_path / "qwen3"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(bpe_json.read_bytes())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    ours, theirs = load_tokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder)
    assert ours.renders_tools
    chat = qwen3_chats()[3]
    ids, mask = ours.encode_chat(chat, tools=schemas)
    assert ids == hf_ids(theirs.apply_chat_template(chat, tools=schemas, tokenize=True))
    assert ids != ours.encode_chat(chat)[0] and '"name": "calculator"' in ours.decode(ids)
    assert [i for i, m in zip(ids, mask) if m] == [i for i, m in zip(*ours.encode_chat(chat)) if m]  # same turns
    prompt = chat[:3]
    expected = theirs.apply_chat_template(prompt, tools=schemas, tokenize=True, add_generation_prompt=True)
    assert ours.encode_chat_prompt(prompt, tools=schemas) == hf_ids(expected)
    smol = load_tokenizer(folder_with(tmp_path, bpe_json, "chatml-smollm2"))
    assert not smol.renders_tools  # then the tools are described in the system turn, added where there is none
    assert smol.encode_chat(chat, tools=schemas) == smol.encode_chat(with_tool_instructions(chat, schemas))
    assert '"name": "python"' in smol.decode(smol.encode_chat_prompt(chat[:1], tools=schemas))


def test_the_builtin_llama3_format_offers_tools_in_its_system_turn():
    """A tiktoken file's Llama 3 format has no place for tool schemas: they are described in the system turn, the
    mask still on the assistant turns alone."""
    from alignment.shared.tools import CALCULATOR
    from data.tokenizer.base import with_tool_instructions

    tokenizer = load_tokenizer("default")
    chat = [{"role": "user", "content": "2 * 3?"}, {"role": "assistant", "content": "6"}]
    tools = [CALCULATOR.schema()]
    assert tokenizer.encode_chat(chat, tools) == tokenizer.encode_chat(with_tool_instructions(chat, tools))
    ids, mask = tokenizer.encode_chat(chat, tools)
    assert (
        '"name": "calculator"' in tokenizer.decode(ids)
        and tokenizer.decode([i for i, m in zip(ids, mask) if m]) == "6<|eot_id|>"
    )
