import math
import warnings
from pathlib import Path

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from alignment.schemas.pretrain import PretrainConfig
from models import attention
from models.heads import ScalarHead, ScalarModel, gather_last, last_token_index
from models.loss import chunked_cross_entropy, cross_entropy
from models.model import (
    ModelConfig,
    RopeScaling,
    Transformer,
    positions_from_documents,
    rope_frequencies,
    use_flex_attention,
)
from tests.helpers import family_block
from trainer.config import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=32, max_seq_len=128)
# Gemma 3's block, its first layer local with a window (4) shorter than the documents here, its second global
GEMMA3 = dict(
    **family_block("Gemma3ForCausalLM"),
    attention_scale_dim=20.0,
    sliding_window=4,
    sliding_window_pattern=2,
    rope_local_theta=10000.0,
)


def tiny_model(**overrides) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(**{**TINY, **overrides})).eval()


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(dim=65), "dim"),
        (dict(n_kv_heads=3), "n_kv_heads"),
        (dict(n_heads=0), "n_heads"),
        (dict(vocab_size=-1), "vocab_size"),
        (dict(norm_eps=0.0), "norm_eps"),
        (dict(ffn_dim_multiplier=-1.0), "ffn_dim_multiplier"),
        (dict(dim=60, n_heads=4, n_kv_heads=4), "dim / n_heads"),  # odd head_dim breaks RoPE pairs
        (dict(rope_scaling=dict(factor=0.5)), "rope_scaling"),
        (dict(attention="flash"), "attention"),
    ],
)
def test_invalid_config_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field.replace("/", "/")):
        ModelConfig(**{**TINY, **overrides})


def test_unknown_config_key_is_rejected():
    with pytest.raises(ValueError, match="unknown ModelConfig keys \\['n_layer'\\]"):
        ModelConfig.from_dict({**TINY, "n_layer": 3})


@pytest.mark.parametrize(
    "preset, hidden, params_billions",
    [
        ("llama3.2-1b", 8192, 1.236),
        ("llama3.2-3b", 8192, 3.213),
        ("llama3.1-8b", 14336, 8.030),
        ("llama3.1-70b", 28672, 70.554),
    ],
)
def test_real_presets_match_meta_shapes(preset, hidden, params_billions):
    config = ModelConfig.from_preset(preset)
    assert config.hidden_dim == hidden
    assert config.num_params() / 1e9 == pytest.approx(params_billions, abs=1e-3)
    assert config.rope_scaling is not None and config.vocab_size == 128256


@pytest.mark.parametrize("preset, low, high", [("tiny", 1e6, 3e6), ("small", 20e6, 30e6)])
def test_cpu_presets_sizes(preset, low, high):
    config = ModelConfig.from_preset(preset)
    model = Transformer(config)
    assert model.num_params() == config.num_params()
    assert low <= model.num_params() <= high


def test_unknown_preset_lists_available():
    with pytest.raises(FileNotFoundError, match="tiny"):
        ModelConfig.from_preset("no-such-model")


def test_forward_shapes_and_no_biases():
    model = tiny_model()
    logits = model(torch.randint(0, 97, (3, 11)))
    assert logits.shape == (3, 11, 97)
    assert not any(name.endswith("bias") for name, _ in model.named_parameters())


def test_scaled_init():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**TINY, "dim": 256, "n_layers": 8, "n_heads": 8, "n_kv_heads": 8}))
    residual = 0.02 / math.sqrt(2 * 8)
    assert model.layers[0].attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.layers[0].attention.wo.weight.std().item() == pytest.approx(residual, rel=0.05)
    assert model.layers[3].feed_forward.w2.weight.std().item() == pytest.approx(residual, rel=0.05)
    assert model.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.all(model.norm.weight == 1)


def test_tied_embeddings_share_storage():
    model = tiny_model(tie_embeddings=True)
    assert model.output.weight is model.tok_embeddings.weight
    untied = tiny_model()
    assert untied.num_params() - model.num_params() == 97 * 64


def test_causality():
    """Changing a future token never changes earlier logits."""
    model = tiny_model()
    ids = torch.randint(0, 97, (1, 20))
    changed = ids.clone()
    changed[0, 12] = (changed[0, 12] + 1) % 97
    a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12], atol=1e-6, rtol=0)
    assert not torch.allclose(a[:, 12:], b[:, 12:])


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"n_kv_heads": 1},  # MQA
        {"qk_norm": True, "logit_softcap": 30.0},
        {"rope_scaling": {"factor": 8.0, "original_max_position_embeddings": 16}},
        GEMMA3,
    ],
)
def test_packed_row_equals_documents_alone(overrides):
    """A packed row of 3 documents gives the same logits as each document run alone (fp32, atol 1e-5)."""
    model = tiny_model(**overrides)
    lengths = [7, 12, 5]
    docs = [torch.randint(0, 97, (1, n)) for n in lengths]
    packed = torch.cat(docs, dim=1)
    document_ids = torch.cat([torch.full((1, n), i) for i, n in enumerate(lengths)], dim=1)
    packed_logits = model(packed, document_ids=document_ids)
    alone = torch.cat([model(doc) for doc in docs], dim=1)
    torch.testing.assert_close(packed_logits, alone, atol=1e-5, rtol=0)
    # Without document masking the later documents see the earlier ones: the test can fail.
    assert not torch.allclose(model(packed)[:, lengths[0] :], alone[:, lengths[0] :], atol=1e-3)


def _packed_batch(lengths_per_row: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and document ids for rows packed with documents of the given lengths (equal row totals)."""
    ids = torch.randint(0, 97, (len(lengths_per_row), sum(lengths_per_row[0])))
    document_ids = torch.stack(
        [torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]) for lengths in lengths_per_row]
    )
    return ids, document_ids


@pytest.mark.parametrize("overrides", [{}, {"n_kv_heads": 1}, {"n_kv_heads": 4, "qk_norm": True}, GEMMA3])
def test_flex_attention_equals_sdpa_on_packed_and_left_padded_rows(overrides):
    """FlexAttention's document BlockMask computes what SDPA's dense boolean mask does (GQA, MQA, MHA).

    Row 0 is packed (3 documents); row 1 is left padded: 6 padding tokens are document 0, the prompt document 1.
    The sequence (37) is not a multiple of the 128-token block, so partial blocks are exercised. Forward only:
    torch's FlexAttention has no backward on CPU.
    """
    sdpa, flex = tiny_model(attention="sdpa", **overrides), tiny_model(attention="flex", **overrides)
    ids, document_ids = _packed_batch([[10, 20, 7], [6, 31]])
    assert use_flex_attention(flex.config, document_ids, None) and not use_flex_attention(
        sdpa.config, document_ids, None
    )
    with torch.no_grad():
        torch.testing.assert_close(
            flex(ids, document_ids=document_ids), sdpa(ids, document_ids=document_ids), atol=1e-5, rtol=1e-5
        )


def test_flex_packed_row_equals_documents_alone():
    model = tiny_model(attention="flex")
    ids, document_ids = _packed_batch([[7, 12, 5]])
    with torch.no_grad():
        packed = model(ids, document_ids=document_ids)
        alone = torch.cat([model(ids[:, s:e]) for s, e in [(0, 7), (7, 19), (19, 24)]], dim=1)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)


def test_attention_auto_picks_flex_only_for_document_masks_on_cuda():
    config = ModelConfig(**TINY)
    docs = torch.zeros(1, 4, dtype=torch.long)
    assert config.attention == "auto"
    assert not use_flex_attention(config, docs, None)  # CPU: SDPA is the faster kernel here
    assert not use_flex_attention(ModelConfig(**TINY, attention="flex"), None, None)  # plain causal: is_causal flash
    cache = tiny_model(attention="flex").new_kv_cache(1, 8)
    assert not use_flex_attention(ModelConfig(**TINY, attention="flex"), docs, cache)  # decoding stays on SDPA
    if torch.cuda.is_available():
        assert use_flex_attention(config, docs.cuda(), None)


def test_flex_on_cpu_with_gradients_is_a_clear_error():
    model = tiny_model(attention="flex").train()
    ids, document_ids = _packed_batch([[3, 5]])
    with pytest.raises(ValueError, match="attention='flex' has no backward on CPU"):
        model(ids, document_ids=document_ids)


def test_flex_generation_with_kv_cache_matches_sdpa():
    """attention='flex' keeps the KV-cache interface: prefill and decode steps give SDPA's logits."""
    sdpa, flex = tiny_model(attention="sdpa"), tiny_model(attention="flex")
    ids = torch.randint(0, 97, (2, 6))
    document_ids = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    outs = []
    with torch.no_grad():
        for model in (sdpa, flex):
            cache = model.new_kv_cache(2, 10)
            prefill = model(ids, document_ids=document_ids, kv_cache=cache)
            step = model(ids[:, -1:], document_ids=torch.ones(2, 1, dtype=torch.long), kv_cache=cache)
            outs.append((prefill, step))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b)


def test_block_mask_builder_compiles_create_block_mask_on_cuda_without_the_deprecated_flag(monkeypatch):
    """CUDA builds masks with ``torch.compile(create_block_mask)``, compiled once; never ``_compile=True``.

    torch 2.13 deprecates the flag. The path CUDA takes runs here on CPU, its compile recorded (not done).
    """
    compiled, calls = [], []

    def fake_compile(fn, **options):
        compiled.append(fn)
        return lambda *args, **kwargs: calls.append(kwargs) or fn(*args, **kwargs)

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(attention, "_compiled", {})
    assert attention.block_mask_builder("cpu") is create_block_mask and compiled == []
    cuda_builder = attention.block_mask_builder("cuda")
    assert attention.block_mask_builder("cuda") is cuda_builder and compiled == [create_block_mask]
    document_ids = torch.tensor([[0] * 100 + [1] * 156, [2] * 256])
    eager = attention.document_block_mask(document_ids)
    monkeypatch.setattr(attention, "block_mask_builder", lambda device_type: cuda_builder)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mask = attention.document_block_mask(document_ids)
    assert len(calls) == 1 and "_compile" not in calls[0]
    assert torch.equal(mask.kv_num_blocks, eager.kv_num_blocks) and torch.equal(mask.kv_indices, eager.kv_indices)


def test_compiled_block_mask_builder_gives_the_eager_mask_and_compiles_once(monkeypatch):
    """The builder CUDA uses, really compiled (inductor's CPU backend): eager's masks, no warning about the
    deprecated flag, and one graph for every forward's new mask closure (no recompile per batch)."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(attention, "_compiled", {})
    cuda_builder = attention.block_mask_builder("cuda")
    graphs = counters["stats"]["unique_graphs"]
    for document_ids in (torch.tensor([[0] * 100 + [1] * 156, [2] * 256]), torch.tensor([[0] * 30 + [1] * 226] * 2)):
        eager = attention.document_block_mask(document_ids)
        with monkeypatch.context() as patch, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            patch.setattr(attention, "block_mask_builder", lambda device_type: cuda_builder)
            mask = attention.document_block_mask(document_ids)
        assert not [w for w in caught if "create_block_mask" in str(w.message)]
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
            assert torch.equal(getattr(mask, name), getattr(eager, name)), name
    assert counters["stats"]["unique_graphs"] - graphs <= 1


def test_cuda_kernels_inside_a_compiled_checkpointed_region_are_traced_not_compiled_again(monkeypatch):
    """A compiled, activation-checkpointed block (FSDP2 + AC + compile) takes the CUDA kernel path while dynamo
    traces it: that path must hand dynamo the plain functions, never call ``torch.compile`` or fill a module
    cache there. On the H100 both pretraining benchmarks died of it (``torch._dynamo.exc.Unsupported``)."""
    monkeypatch.setattr(attention, "_compiled", {})
    mask = attention.document_block_mask(torch.tensor([[0] * 100 + [1] * 156]))
    q, k, v = (torch.randn(1, 2, 256, 16) for _ in range(3))

    def block(q, k, v):  # what a block does on CUDA, run here on CPU tensors
        assert attention.block_mask_builder("cuda") is attention.create_block_mask
        return attention._compiled_on_cuda("cuda", "flex_attention", attention.flex_attention)(q, k, v, block_mask=mask)

    def checkpointed(q, k, v):
        return torch.utils.checkpoint.checkpoint(block, q, k, v, use_reentrant=False)

    traced = torch.compile(checkpointed, backend="eager", fullgraph=True)(q, k, v)
    assert attention._compiled == {}
    torch.testing.assert_close(traced, attention.flex_attention(q, k, v, block_mask=mask))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's compiled kernels and backward need CUDA")
def test_flex_equals_sdpa_forward_and_backward_on_cuda():
    torch.manual_seed(0)
    sdpa = Transformer(ModelConfig(**TINY, attention="sdpa")).cuda()
    flex = Transformer(ModelConfig(**TINY, attention="flex")).cuda()
    flex.load_state_dict(sdpa.state_dict())
    ids, document_ids = (t.cuda() for t in _packed_batch([[40, 60, 28], [8, 120]]))
    targets = torch.roll(ids, -1, dims=1)
    losses = [m.token_losses(ids, targets, document_ids=document_ids).mean() for m in (sdpa, flex)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], atol=1e-4, rtol=1e-4)
    for (name, a), b in zip(sdpa.named_parameters(), flex.parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-4, rtol=1e-3, msg=name)


def test_positions_restart_per_document():
    document_ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5, 5, 5]])
    expected = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7, 8]])
    assert torch.equal(positions_from_documents(document_ids), expected)


def test_llama31_rope_scaling_matches_reference_formula():
    """Check the three frequency bands of Meta's apply_scaling against a direct per-frequency computation."""
    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    config = ModelConfig(dim=4096, n_layers=1, n_heads=32, vocab_size=8, rope_scaling=scaling)
    scaled = rope_frequencies(config)
    plain = rope_frequencies(ModelConfig(dim=4096, n_layers=1, n_heads=32, vocab_size=8))
    for freq, new in zip(plain.double().tolist(), scaled.double().tolist()):
        wavelen = 2 * math.pi / freq
        if wavelen < 8192 / 4:
            expected = freq
        elif wavelen > 8192:
            expected = freq / 8
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            expected = (1 - smooth) * freq / 8 + smooth * freq
        assert new == pytest.approx(expected, rel=1e-6)
    assert scaled[0].item() == plain[0].item()
    assert scaled[-1].item() == pytest.approx(plain[-1].item() / 8, rel=1e-6)


def test_too_long_sequence_is_a_clear_error():
    model = tiny_model(max_seq_len=16)
    with pytest.raises(ValueError, match="exceeds the model's max_seq_len 16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_cross_entropy_matches_torch_with_ignore_index():
    logits = torch.randn(2, 6, 11)
    targets = torch.randint(0, 11, (2, 6))
    targets[0, :2] = -100
    expected = torch.nn.functional.cross_entropy(logits.view(-1, 11), targets.view(-1), ignore_index=-100)
    torch.testing.assert_close(cross_entropy(logits, targets), expected)
    per_token = cross_entropy(logits, targets, reduction="none")
    assert torch.all(per_token[0, :2] == 0)


def test_z_loss_adds_squared_log_partition():
    logits = torch.randn(4, 9)
    targets = torch.randint(0, 9, (4,))
    z = torch.logsumexp(logits, dim=-1).square().mean()
    torch.testing.assert_close(cross_entropy(logits, targets, z_loss=1e-3), cross_entropy(logits, targets) + 1e-3 * z)


def test_all_ignored_batch_gives_zero_not_nan():
    loss = cross_entropy(torch.randn(3, 5, requires_grad=True), torch.full((3,), -100))
    assert loss.item() == 0.0


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_chunked_cross_entropy_matches_full_values_and_gradients(softcap):
    torch.manual_seed(0)
    hidden = torch.randn(2, 13, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (2, 13))
    targets[1, 5:] = -100
    logits = hidden @ weight.t()
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    full = cross_entropy(logits, targets, z_loss=1e-4)
    full_grads = torch.autograd.grad(full, (hidden, weight))
    chunked = chunked_cross_entropy(hidden, weight, targets, chunk_size=5, softcap=softcap, z_loss=1e-4)
    chunked_grads = torch.autograd.grad(chunked, (hidden, weight))
    torch.testing.assert_close(chunked, full)
    for a, b in zip(chunked_grads, full_grads):
        torch.testing.assert_close(a, b)


def test_model_token_losses_chunked_equals_full_logits():
    model = tiny_model(logit_softcap=20.0)
    ids = torch.randint(0, 97, (2, 16))
    targets = torch.roll(ids, -1, dims=1)
    targets[:, -1] = -100
    full = model.token_losses(ids, targets, chunk_size=None)
    chunked = model.token_losses(ids, targets, chunk_size=7)
    torch.testing.assert_close(chunked, full, atol=1e-5, rtol=1e-5)
    reference = cross_entropy(model(ids), targets, reduction="none")
    torch.testing.assert_close(full, reference)


def test_scalar_head_init_and_last_token_read():
    torch.manual_seed(0)
    head = ScalarHead(4095)
    assert head.proj.weight.std().item() == pytest.approx(1 / math.sqrt(4096), rel=0.05)
    assert torch.all(ScalarHead(8, init="zeros").proj.weight == 0)
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    assert last_token_index(mask).tolist() == [2, 4, 0]
    values = torch.arange(15.0).view(3, 5)
    assert gather_last(values, mask).tolist() == [2.0, 9.0, 10.0]
    with pytest.raises(ValueError, match="at least one real token"):
        last_token_index(torch.zeros(1, 3, dtype=torch.bool))


def test_scalar_model_scores_each_position():
    torch.manual_seed(0)
    model = ScalarModel(ModelConfig(**TINY))
    scores = model(torch.randint(0, 97, (2, 9)))
    assert scores.shape == (2, 9) and scores.dtype == torch.float32
    wrapped = ScalarModel.from_backbone(model.backbone, init="zeros")
    assert torch.all(wrapped(torch.randint(0, 97, (2, 9))) == 0)


@pytest.mark.parametrize(
    "name, strategy, seq_len", [("llama3.2-1b", "fsdp", 8192), ("llama3.2-1b-1gpu", "single", 2048)]
)
def test_gpu_pretrain_presets_compile_bf16_and_auto_attention(name, strategy, seq_len):
    config = load_config(PretrainConfig, CONFIGS / "pretrain" / f"{name}.yaml")
    assert (config.trainer.strategy, config.loader.seq_len, config.loader.micro_batch_size) == (strategy, seq_len, 4)
    assert config.trainer.compile and config.trainer.precision.startswith("bf16")
    assert config.model.attention == "auto" and config.model == ModelConfig.from_preset("llama3.2-1b")
