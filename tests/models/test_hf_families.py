"""The families of models/families.py as transformers writes them: Llama (tied, head_dim != dim / heads, linear and
llama3 RoPE), Qwen2 (q/k/v biases), Mistral and Qwen3 (QK norm, 128-wide heads) import with transformers' logits and export back as the same family; what the native
model cannot represent is refused in one line naming it; the shipped presets have the published shapes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never touch the network
transformers = pytest.importorskip("transformers")

from models.errors import CheckpointError  # noqa: E402
from models.formats.checkpoint import export_hf, load_checkpoint, load_model_config, save_checkpoint  # noqa: E402
from models.formats.hf_config import HF_FAMILIES  # noqa: E402
from models.model import HF_ARCHITECTURES, ModelConfig, RopeScaling, Transformer  # noqa: E402

VOCAB = 128
CONTEXT = 64
TOL = 1e-4
SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=VOCAB,
    max_position_embeddings=CONTEXT,
    rms_norm_eps=1e-5,
)
ROPE_LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # small: the scaling changes most frequencies of these heads
}
# (id, config class, its settings beyond SHAPE): each family as it is fine-tuned in practice
CASES = {
    "llama-tied-head_dim-linear": (
        "LlamaConfig",
        dict(tie_word_embeddings=True, head_dim=24, rope_parameters={"rope_type": "linear", "factor": 4.0}),
    ),
    "llama-llama3": ("LlamaConfig", dict(rope_parameters=ROPE_LLAMA3)),
    "qwen2-bias-tied": (
        "Qwen2Config",
        dict(tie_word_embeddings=True, use_sliding_window=False, sliding_window=16, max_window_layers=1),
    ),
    "mistral": ("MistralConfig", dict(sliding_window=CONTEXT)),  # a window as long as the context: full attention
    "qwen3-tied-head_dim": ("Qwen3Config", dict(tie_word_embeddings=True, head_dim=24, use_sliding_window=False)),
}


def hf_config(kind: str, rope_theta: float = 10000.0, **settings) -> transformers.PretrainedConfig:
    rope = {"rope_type": "default", **settings.pop("rope_parameters", {}), "rope_theta": rope_theta}
    return getattr(transformers, kind)(**SHAPE, rope_parameters=rope, **settings)


@torch.no_grad()
def hf_model(kind: str, seed: int = 0, **settings) -> transformers.PreTrainedModel:
    """A tiny random model, weights (and biases, norms) large enough that any wrong name, permutation or split shows."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(kind, **settings), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen)
        param.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.15 * noise)
    model.set_attn_implementation("eager")
    return model.eval()


@torch.no_grad()
def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    return out.logits if hasattr(out, "logits") else out


def token_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("case", list(CASES))
def test_family_imports_and_exports_with_transformers_logits(tmp_path, case):
    kind, settings = CASES[case]
    hf = hf_model(kind, **settings)
    architecture = hf.config.architectures[0] if hf.config.architectures else type(hf).__name__
    hf.save_pretrained(tmp_path / "hf")
    ids = token_ids()

    model = load_checkpoint(tmp_path / "hf")
    config = model.config
    assert config.hf_architecture == architecture == type(hf).__name__
    assert config.qkv_bias == (kind == "Qwen2Config") and config.qk_norm == (kind == "Qwen3Config")
    assert config.head_dim == settings.get("head_dim", 16) and config.tie_embeddings == hf.config.tie_word_embeddings
    assert model.layers[0].attention.wq.weight.shape == (4 * config.head_dim, 64)
    assert model.layers[0].attention.wo.weight.shape == (64, 4 * config.head_dim)
    assert (logits(model, ids) - logits(hf, ids)).abs().max().item() <= TOL

    # the family survives a native checkpoint (lantern.json), then goes back out as itself
    save_checkpoint(model, tmp_path / "native")
    assert load_model_config(tmp_path / "native") == config
    out = export_hf(tmp_path / "native", tmp_path / "out")
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == [architecture] and written["model_type"] == hf.config.model_type
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    assert type(back) is type(hf) and type(back.config) is type(hf.config)
    assert (logits(back.eval(), ids) - logits(hf, ids)).abs().max().item() <= TOL
    original = hf.state_dict()
    assert back.state_dict().keys() == original.keys()
    for name, tensor in back.state_dict().items():
        assert torch.equal(tensor, original[name]), name  # the permutation round-trips exactly (biases too)


def test_linear_rope_divides_positions_by_the_factor():
    plain = Transformer(ModelConfig(dim=64, n_layers=1, n_heads=4, vocab_size=VOCAB, max_seq_len=CONTEXT)).eval()
    config = ModelConfig(**{**plain.config.to_dict(), "rope_scaling": {"factor": 4.0, "rope_type": "linear"}})
    scaled = Transformer(config).eval()
    scaled.load_state_dict(plain.state_dict())
    ids = token_ids()[:, :8]
    positions = torch.arange(8).expand(2, 8)
    with torch.no_grad():
        assert torch.allclose(scaled(ids, position_ids=positions * 4), plain(ids, position_ids=positions), atol=1e-5)


def test_configs_written_before_the_new_fields_load_as_before():
    old = {"dim": 64, "n_layers": 1, "n_heads": 4, "vocab_size": VOCAB, "rope_scaling": {"factor": 8.0}}
    config = ModelConfig.from_dict(old)
    assert config.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192) and config.rope_scaling.rope_type == "llama3"
    assert (config.head_dim, config.qkv_bias, config.hf_architecture) == (16, False, "LlamaForCausalLM")
    assert ModelConfig.from_dict({**old, "head_dim_override": 16}) == config  # the derived value is kept unset
    assert ModelConfig.from_dict(config.to_dict()) == config
    assert tuple(HF_FAMILIES) == HF_ARCHITECTURES
    with pytest.raises(ValueError, match="hf_architecture"):
        ModelConfig(hf_architecture="GPT2LMHeadModel")
    with pytest.raises(ValueError, match="rope_type"):
        ModelConfig(rope_scaling={"rope_type": "yarn"})
    with pytest.raises(ValueError, match="head_dim_override"):
        ModelConfig(head_dim_override=15)
    with pytest.raises(ValueError, match="qk_norm must be True for hf_architecture Qwen3ForCausalLM"):
        ModelConfig(hf_architecture="Qwen3ForCausalLM")  # a family's own block options are on in each of its models


def test_export_refuses_qkv_bias_outside_qwen2(tmp_path):
    model = Transformer(ModelConfig(dim=64, n_layers=1, n_heads=4, vocab_size=VOCAB, qkv_bias=True))
    with pytest.raises(ValueError, match="qkv_bias"):
        export_hf(model, tmp_path / "hf")


# ---------------------------------------------------------------------------------------------------------
# refusals: one line, naming the thing


def refused(folder: Path, *names: str) -> str:
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(folder)  # the config is refused before any weights are read (there are none here)
    message = str(caught.value)
    assert "\n" not in message and str(folder / "config.json") in message
    for name in names:
        assert name in message
    return message


def write_config(folder: Path, kind: str, **changes) -> Path:
    """config.json only, as transformers saves it for ``kind``, then ``changes`` applied to the JSON."""
    hf_config(kind).save_pretrained(folder)
    values = {**json.loads((folder / "config.json").read_text()), **changes}
    (folder / "config.json").write_text(json.dumps(values))
    return folder


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}},
        {"rope_parameters": None, "rope_theta": 10000.0, "rope_scaling": {"type": "yarn", "factor": 4.0}},  # 4.x
    ],
    ids=["transformers-5", "transformers-4"],
)
def test_other_rope_type_is_refused(tmp_path, rope):
    refused(write_config(tmp_path, "LlamaConfig", **rope), "rope type 'yarn' is not supported", "linear, llama3")


def test_sliding_window_shorter_than_the_context_is_refused(tmp_path):
    mistral = write_config(tmp_path / "mistral", "MistralConfig", sliding_window=16)
    refused(mistral, "sliding_window=16 < max_position_embeddings=64: sliding-window attention is not implemented")
    # Qwen2: only when on (use_sliding_window) for some layer (from max_window_layers on)
    on = dict(use_sliding_window=True, sliding_window=16, max_window_layers=1, layer_types=None)
    refused(write_config(tmp_path / "qwen2", "Qwen2Config", **on), "sliding_window=16 < max_position_embeddings=64")
    off = write_config(tmp_path / "qwen2-off", "Qwen2Config", **{**on, "use_sliding_window": False})
    assert load_model_config(off).hf_architecture == "Qwen2ForCausalLM"
    no_layer = write_config(tmp_path / "qwen2-late", "Qwen2Config", **{**on, "max_window_layers": 2})
    assert load_model_config(no_layer).qkv_bias
    refused(write_config(tmp_path / "qwen3", "Qwen3Config", **on), "Qwen3ForCausalLM", "sliding_window=16 <")
    assert load_model_config(write_config(tmp_path / "qwen3-off", "Qwen3Config", use_sliding_window=False)).qk_norm


@pytest.mark.parametrize(
    "architecture, model_type, reason",
    [
        ("GPT2LMHeadModel", "gpt2", "is not supported (supported:"),
        ("GemmaForCausalLM", "gemma", "is not supported (supported:"),
        (
            "Qwen3MoeForCausalLM",
            "qwen3_moe",
            "mixture-of-experts layers are not implemented (dense Qwen3 is supported)",
        ),
    ],
    ids=["gpt2", "gemma", "qwen3-moe"],
)
def test_other_architecture_is_refused_naming_it_and_the_supported_ones(tmp_path, architecture, model_type, reason):
    tmp_path.joinpath("config.json").write_text(
        json.dumps({"architectures": [architecture], "model_type": model_type, "n_embd": 64, "hidden_size": 64})
    )
    refused(tmp_path, repr(architecture), reason, *HF_ARCHITECTURES)


# ---------------------------------------------------------------------------------------------------------
# presets


@pytest.mark.parametrize(
    "preset, params, architecture",
    [
        ("smollm2-135m", 134_515_008, "LlamaForCausalLM"),
        ("smollm2-360m", 361_821_120, "LlamaForCausalLM"),
        ("qwen2.5-0.5b", 494_032_768, "Qwen2ForCausalLM"),
        ("tinyllama-1.1b", 1_100_048_384, "LlamaForCausalLM"),
        ("qwen3-0.6b", 596_049_920, "Qwen3ForCausalLM"),
        ("qwen3-1.7b", 1_720_574_976, "Qwen3ForCausalLM"),
    ],
)
def test_hugging_face_presets_have_the_published_sizes(preset, params, architecture):
    config = ModelConfig.from_preset(preset)
    assert config.num_params() == params and config.hf_architecture == architecture
    with torch.device("meta"):
        assert Transformer(config).num_params() == params


def test_published_qwen2_5_config_is_the_preset(tmp_path):
    """Qwen/Qwen2.5-0.5B's config.json as published (transformers 4.x keys): the same model as the preset, so a
    stage configured with ``model: qwen2.5-0.5b`` and started from that checkpoint sees no other model."""
    published = {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
        "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24, "model_type": "qwen2",
        "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(published))
    assert load_model_config(tmp_path) == ModelConfig.from_preset("qwen2.5-0.5b")


def test_published_qwen3_config_is_the_preset(tmp_path):
    """Qwen/Qwen3-0.6B's config.json as published (transformers 4.51 keys): the qwen3-0.6b preset."""
    published = {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
        "initializer_range": 0.02, "intermediate_size": 3072, "max_position_embeddings": 40960,
        "max_window_layers": 28, "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
        "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(published))
    assert load_model_config(tmp_path) == ModelConfig.from_preset("qwen3-0.6b")


@torch.no_grad()
def gemma3_model(seed: int = 0, **settings) -> transformers.PreTrainedModel:
    """A tiny random Gemma 3 text model: two layers, the first local (window 8, shorter than the test's 20 tokens)
    with its own RoPE base, the second global; scores scaled by query_pre_attn_scalar 20, not by head_dim 24."""
    torch.manual_seed(seed)
    config = transformers.Gemma3TextConfig(**{
        **SHAPE, "head_dim": 24, "query_pre_attn_scalar": 20, "sliding_window": 8, "layer_types":
        ["sliding_attention", "full_attention"], "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
        "final_logit_softcapping": None, "attn_logit_softcapping": None, **settings,
    })  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():  # Gemma's norms scale by 1 + weight: weights away from 0
        param.copy_(
            0.1 * torch.randn(param.shape, generator=gen)
            if "norm" in name
            else 0.15 * torch.randn(param.shape, generator=gen)
        )
    model.set_attn_implementation("eager")
    return model.eval()


def test_gemma3_imports_and_exports_with_transformers_logits(tmp_path):
    """Gemma 3's block (√dim embeddings, (1 + w) norms, four a block, QK norm, tanh-GELU, query_pre_attn_scalar) and
    its local layers (a window shorter than the sequence, their own RoPE base) give transformers' logits, and go back
    out as Gemma3ForCausalLM with every tensor unchanged."""
    hf = gemma3_model()
    hf.save_pretrained(tmp_path / "hf")
    ids = token_ids()
    model = load_checkpoint(tmp_path / "hf")
    config = model.config
    assert config.hf_architecture == "Gemma3ForCausalLM" and config.qk_norm and config.sandwich_norms
    assert (config.sliding_window, config.sliding_window_pattern, config.rope_local_theta) == (8, 2, 10000.0)
    assert [layer.is_local for layer in model.layers] == [True, False] and config.attention_scale_dim == 20
    assert (logits(model, ids) - logits(hf, ids)).abs().max().item() <= TOL
    # the window matters here: the same weights with no local layers differ
    unwindowed = Transformer(ModelConfig(**{**config.to_dict(), "sliding_window": None, "sliding_window_pattern": None,
                                            "rope_local_theta": None})).eval()  # fmt: skip
    unwindowed.load_state_dict(model.state_dict())
    assert (logits(unwindowed, ids) - logits(hf, ids)).abs().max().item() > 1e-2

    save_checkpoint(model, tmp_path / "native")
    assert load_model_config(tmp_path / "native") == config
    out = export_hf(tmp_path / "native", tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    assert type(back) is type(hf) and json.loads((out / "config.json").read_text())["model_type"] == "gemma3_text"
    assert (logits(back.eval(), ids) - logits(hf, ids)).abs().max().item() <= TOL
    original = hf.state_dict()
    assert back.state_dict().keys() == original.keys()
    for name, tensor in back.state_dict().items():
        assert torch.equal(tensor, original[name]), name


def test_gemma3s_multimodal_checkpoint_is_refused_naming_why(tmp_path):
    config = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": {}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    refused(tmp_path, "'Gemma3ForConditionalGeneration'", "vision tower is not implemented", "Gemma3ForCausalLM")
