"""GGUF files (models/formats/gguf_format.py): a Lantern model written as GGUF loads in transformers with the same logits and
tokenizer ids, reads back into Lantern, converts to native and Hugging Face folders; what cannot be read or written
is refused in one line."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never touch the network
gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers loads GGUF files through it

import models.formats.gguf_format as gguf_format  # noqa: E402
from data.tokenizer.convert import write_hf_tokenizer  # noqa: E402
from data.tokenizer.files import DEFAULT_TOKENIZER_PATH  # noqa: E402
from data.tokenizer.tokenizer import Tokenizer  # noqa: E402
from models.errors import LanternError, one_line  # noqa: E402
from models.formats.checkpoint import load_checkpoint  # noqa: E402
from models.formats.gguf_format import convert_gguf, load_gguf, read_gguf, write_gguf  # noqa: E402
from models.formats.hf_config import config_to_hf  # noqa: E402
from models.model import ModelConfig, RopeScaling, Transformer  # noqa: E402
from tests.helpers import family_block, write_gpt2_gguf  # noqa: E402

TEXT = "ROMEO:\nWhat, ho! 12345 héllo 日本語 😀  \n\n  x"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who art thou?"}]


def tiny_model(**overrides) -> Transformer:
    """A random 2-layer GQA model over the shipped tokenizer's 4096 ids, norms away from 1 (so a misplaced norm
    shows), in eval mode."""
    torch.manual_seed(0)
    values = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=4096, ffn_hidden_dim=96, max_seq_len=64)
    model = Transformer(ModelConfig(**{**values, "rope_theta": 10000.0, **overrides})).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(0.1 * torch.randn_like(parameter))
    return model


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    write_hf_tokenizer(Tokenizer.from_file(DEFAULT_TOKENIZER_PATH), folder)
    return folder


@pytest.fixture(scope="module")
def written(tmp_path_factory, tokenizer_folder) -> tuple[Transformer, Path]:
    """The tied tiny model written as an f32 GGUF."""
    model = tiny_model(tie_embeddings=True)
    out = tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf"
    assert write_gguf(model, out, tokenizer_folder, dtype="f32", name="tiny") == out
    return model, out


def ids_of(text: str) -> torch.Tensor:
    return torch.tensor([Tokenizer.from_file(DEFAULT_TOKENIZER_PATH).encode(text, bos=True)])


def test_transformers_reads_the_f32_file_with_the_same_logits_and_tokens(written) -> None:
    model, path = written
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    ids = ids_of(TEXT)
    with torch.no_grad():
        assert torch.allclose(hf_model(ids).logits, model(ids), atol=1e-4)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tok = Tokenizer.from_file(DEFAULT_TOKENIZER_PATH)
    assert hf_tokenizer(TEXT)["input_ids"] == tok.encode(TEXT, bos=True)
    assert hf_tokenizer(TEXT, add_special_tokens=False)["input_ids"] == tok.encode(TEXT)
    chat = hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert chat["input_ids"] == tok.encode_chat_prompt(MESSAGES)


def test_layout_is_llama_cpps(written) -> None:
    """llama.cpp's names and q/k rows in Meta's interleaved pairs, which is Lantern's own layout; tied: no output."""
    model, path = written
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    assert "output.weight" not in tensors and "token_embd.weight" in tensors
    attn_q = torch.from_numpy(tensors["blk.1.attn_q.weight"].data.copy())
    attn_k = torch.from_numpy(tensors["blk.1.attn_k.weight"].data.copy())
    assert torch.equal(attn_q, model.layers[1].attention.wq.weight)
    assert torch.equal(attn_k, model.layers[1].attention.wk.weight)
    assert reader.fields["tokenizer.ggml.pre"].contents() == "llama-bpe"
    assert reader.fields["llama.attention.head_count_kv"].contents() == 2


def test_load_gguf_gives_back_the_model(written) -> None:
    model, path = written
    loaded, info = load_gguf(path)  # read_gguf's config and state, built
    fields = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "hidden_dim", "tie_embeddings", "norm_eps")
    assert all(getattr(loaded.config, f) == getattr(model.config, f) for f in fields)
    assert (loaded.config.rope_theta, loaded.config.max_seq_len, loaded.config.rope_scaling) == (10000.0, 64, None)
    assert torch.equal(loaded.layers[0].attention.wq.weight, model.layers[0].attention.wq.weight)
    tok = Tokenizer.from_file(DEFAULT_TOKENIZER_PATH)
    assert info["name"] == "tiny" and info["tensor_types"] == {"F32": 20}
    assert (info["bos_token_id"], info["eos_token_id"], info["chat_template"]) == (tok.bos_id, tok.eos_id, True)
    ids = ids_of(TEXT)
    with torch.no_grad():
        assert torch.allclose(loaded(ids), model(ids), atol=1e-6)


# each family as its GGUF architecture: Qwen2 with its q/k/v biases, Qwen3 with QK norm and heads 128 wide (as every
# Qwen3 has, not dim / n_heads; transformers' GGUF reader assumes 128 for "qwen3", Lantern reads the file's width)
OTHER_FAMILIES = {
    "qwen2": ("qwen2", dict(hf_architecture="Qwen2ForCausalLM", qkv_bias=True, tie_embeddings=True)),
    "qwen3": ("qwen3", dict(**family_block("Qwen3ForCausalLM"), head_dim_override=128)),
    "qwen3-narrow-heads": ("qwen3", dict(**family_block("Qwen3ForCausalLM"), head_dim_override=24)),
    "mistral": ("llama", dict(hf_architecture="MistralForCausalLM")),  # read back as Llama: the same computation
    # Gemma 3: norms stored as 1 + w, a window shorter than the text, 256-wide heads and scores scaled by 1/sqrt(256)
    "gemma3": (
        "gemma3",
        dict(
            **family_block("Gemma3ForCausalLM"),
            head_dim_override=256,
            attention_scale_dim=256.0,
            sliding_window=6,
            sliding_window_pattern=6,
            rope_local_theta=10000.0,
            tie_embeddings=True,
        ),
    ),
}


@pytest.mark.parametrize("family", list(OTHER_FAMILIES))
def test_every_family_writes_its_gguf_architecture_and_reads_back(tmp_path: Path, tokenizer_folder, family) -> None:
    """Written as llama.cpp's converter writes the family, read by transformers with the same logits, and read back
    into the same family with the same weights."""
    architecture, overrides = OTHER_FAMILIES[family]
    model = tiny_model(**overrides)
    with torch.no_grad():  # biases away from 0 (a dropped or unpermuted bias shows)
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.add_(0.1 * torch.randn_like(parameter))
    path = write_gguf(model, tmp_path / f"{family}.gguf", tokenizer_folder, dtype="f32")
    reader = gguf.GGUFReader(path)
    assert reader.fields["general.architecture"].contents() == architecture
    names = {t.name for t in reader.tensors}
    assert ("blk.0.attn_q.bias" in names) == model.config.qkv_bias
    assert ("blk.0.attn_q_norm.weight" in names) == model.config.qk_norm
    ids = ids_of(TEXT)
    loaded, _ = load_gguf(path)
    read_as = "LlamaForCausalLM" if architecture == "llama" else model.config.hf_architecture
    assert loaded.config == dataclasses.replace(model.config, hf_architecture=read_as)
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
    if family != "qwen3-narrow-heads":
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
        with torch.no_grad():
            assert (hf(ids).logits - model(ids)).abs().max().item() <= 1e-4


@pytest.mark.parametrize(("dtype", "tolerance"), [("f16", 2e-3), ("bf16", 2e-2)])
def test_half_precision_files_load_in_transformers(tmp_path: Path, tokenizer_folder, dtype, tolerance) -> None:
    model = tiny_model()  # untied: the file has an output tensor
    path = write_gguf(model, tmp_path / f"tiny-{dtype}.gguf", tokenizer_folder, dtype=dtype)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["output.weight"] == dtype.upper() and types["blk.0.attn_norm.weight"] == "F32"
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    ids = ids_of(TEXT)
    with torch.no_grad():
        assert torch.allclose(hf_model(ids).logits, model(ids), atol=tolerance)


def test_rope_scaling_round_trips(tmp_path: Path, tokenizer_folder, monkeypatch) -> None:
    """Llama 3.1 scaling is written as llama.cpp's rope_freqs divisors (and Lantern's own key) and read back exactly;
    a rope_freqs without that key (llama.cpp's own files) is read as Llama 3.1's scaling when it is one with
    low/high frequency factors 1 / 4 and an 8192 original context, else refused."""
    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16)
    model = tiny_model(rope_scaling=scaling, rope_theta=500000.0)
    path = write_gguf(model, tmp_path / "scaled.gguf", tokenizer_folder, dtype="f32")
    assert "rope_freqs.weight" in {t.name for t in gguf.GGUFReader(path).tensors}
    assert read_gguf(path)[0].rope_scaling == scaling

    monkeypatch.setattr(gguf_format, "LANTERN_ROPE_KEY", "other.rope_scaling")  # write as llama.cpp does
    llama32 = tiny_model(rope_scaling=RopeScaling(factor=32.0), rope_theta=500000.0)
    foreign = write_gguf(llama32, tmp_path / "llama32.gguf", tokenizer_folder, dtype="f32")
    odd = write_gguf(model, tmp_path / "odd.gguf", tokenizer_folder, dtype="f32")
    monkeypatch.undo()
    loaded, _ = load_gguf(foreign)
    assert loaded.config.rope_scaling == RopeScaling(factor=32.0)
    ids = ids_of(TEXT)
    with torch.no_grad():
        assert torch.allclose(loaded(ids), llama32(ids), atol=1e-6)
    fields, _, rope_freqs = gguf_format._read_metadata(odd)  # what read_gguf checks, without loading the weights
    hf = config_to_hf(dataclasses.replace(model.config, rope_scaling=None), torch.float32, None, None)
    with pytest.raises(LanternError, match="not Llama 3.1's RoPE scaling"):
        gguf_format._rope_scaling(odd, fields, rope_freqs, hf)


def test_convert_gguf_to_native_and_hf(tmp_path: Path, written) -> None:
    model, path = written
    tok = Tokenizer.from_file(DEFAULT_TOKENIZER_PATH)
    ids = ids_of(TEXT)
    native = convert_gguf(path, tmp_path / "native", "native")
    assert {"lantern.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(
        p.name for p in native.iterdir()
    )
    metadata = json.loads((native / "lantern.json").read_text())["metadata"]
    assert (metadata["bos_token_id"], metadata["eos_token_id"]) == (tok.bos_id, tok.eos_id)
    with torch.no_grad():
        assert torch.allclose(load_checkpoint(native)(ids), model(ids), atol=1e-6)

    exported = convert_gguf(path, tmp_path / "hf", "hf")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    with torch.no_grad():
        assert torch.allclose(hf_model(ids).logits, model(ids), atol=1e-4)
    assert hf_tokenizer(TEXT)["input_ids"] == tok.encode(TEXT, bos=True)
    assert "chat_template" in json.loads((exported / "tokenizer_config.json").read_text())
    assert json.loads((exported / "config.json").read_text())["bos_token_id"] == tok.bos_id

    with pytest.raises(FileExistsError, match="pass --overwrite"):
        convert_gguf(path, exported, "hf")


def test_what_cannot_be_read_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(LanternError, match="GGUF file not found") as missing:
        read_gguf(tmp_path / "absent.gguf")
    (tmp_path / "text.gguf").write_text("not a gguf file")
    with pytest.raises(LanternError, match="not a GGUF file"):
        read_gguf(tmp_path / "text.gguf")
    write_gpt2_gguf(tmp_path / "gpt2.gguf")
    with pytest.raises(LanternError, match="architecture 'gpt2' is not supported") as foreign:
        read_gguf(tmp_path / "gpt2.gguf")
    for error in (missing.value, foreign.value):
        assert "\n" not in one_line(error) and str(tmp_path) in str(error)


def test_what_cannot_be_written_is_refused(tmp_path: Path, tokenizer_folder, written) -> None:
    model, existing = written
    with pytest.raises(FileExistsError, match="pass --overwrite"):
        write_gguf(model, existing, tokenizer_folder)
    (tmp_path / "rank-file-only").mkdir()
    (tmp_path / "rank-file-only" / "tokenizer.model").write_bytes(DEFAULT_TOKENIZER_PATH.read_bytes())
    with pytest.raises(LanternError, match="tiktoken tokenizer.model, not tokenizer.json"):
        write_gguf(model, tmp_path / "a.gguf", tmp_path / "rank-file-only")
    with pytest.raises(LanternError, match="do not fit the model's vocab_size 1000"):
        write_gguf(tiny_model(vocab_size=1000), tmp_path / "b.gguf", tokenizer_folder)
    with pytest.raises(LanternError, match="qkv_bias"):
        write_gguf(tiny_model(qkv_bias=True), tmp_path / "c.gguf", tokenizer_folder)
    with pytest.raises(LanternError, match="logit_softcap"):
        write_gguf(tiny_model(logit_softcap=30.0), tmp_path / "d.gguf", tokenizer_folder)
    gemma = {**OTHER_FAMILIES["gemma3"][1], "sliding_window_pattern": 2, "attention_scale_dim": 20.0}
    with pytest.raises(LanternError, match=r"llama.cpp's 'gemma3', which fixes: sliding_window_pattern=2 .*; "
                                           r"attention_scale_dim=20.0"):  # fmt: skip
        write_gguf(tiny_model(**gemma), tmp_path / "e.gguf", tokenizer_folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-file-only"]  # nothing half-written left


def test_a_failed_write_keeps_the_old_file(tmp_path: Path, tokenizer_folder, monkeypatch) -> None:
    model = tiny_model()
    out = write_gguf(model, tmp_path / "m.gguf", tokenizer_folder, dtype="f16")
    before = out.read_bytes()

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", full_disk)
    with pytest.raises(OSError, match="no space left on device; the previous file is unchanged"):
        write_gguf(model, out, tokenizer_folder, dtype="f32", overwrite=True)
    assert out.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["m.gguf"]
