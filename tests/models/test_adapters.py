"""LoRA adapters (models/adapters.py): what trains, switching them off, merging them in, the base's fingerprint,
the ``peft`` section's checks, and adapters under activation checkpointing and torch.compile."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest
import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from alignment.schemas.sft import SFTConfig
from models.adapters import (
    adapters_disabled,
    add_adapters,
    base_fingerprint,
    check_peft_config,
    merge_adapters,
    merged_state,
)
from models.errors import ConfigError
from models.heads import ScalarModel
from models.model import ModelConfig, Transformer
from models.model_config import PeftConfig
from trainer.config import load_config
from trainer.parallel import apply_activation_checkpointing, apply_compile, plain_name

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=32, max_seq_len=128)
LORA = PeftConfig(kind="lora", rank=4, alpha=8.0)


def tiny_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(**TINY)).eval()


def adapted(config: PeftConfig = LORA, trainable: tuple[str, ...] = ()) -> tuple[Transformer, Transformer]:
    """A tiny model with adapters whose ``lora_B`` is nonzero (peft starts it at zero: the adapter would be a no-op),
    and a copy of its base taken before the adapters were added."""
    model = tiny_model()
    base = copy.deepcopy(model)
    add_adapters(model, config, trainable)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.05)
    return model, base


def tokens() -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(2))


def test_adding_adapters_freezes_the_base_and_trains_only_the_adapters():
    model, base = adapted()
    trained = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
    assert trained and all(".lora_A." in name or ".lora_B." in name for name in trained)
    # every target projection of every block has both matrices; nothing else (embeddings, norms, LM head) trains
    assert len(trained) == 2 * len(LORA.target_modules) * TINY["n_layers"]
    assert not any(name.startswith(("tok_embeddings", "output", "norm")) for name in trained)
    # the base's own tensors are all still there, under peft's ``base_layer`` name where adapted
    names = {name.replace(".base_layer.", ".") for name in model.state_dict() if "lora_" not in name}
    assert names == set(base.state_dict())


def test_trainable_prefixes_train_beside_the_adapters():
    torch.manual_seed(0)
    model = ScalarModel.from_backbone(Transformer(ModelConfig(**TINY)))
    add_adapters(model, LORA, trainable=("head.",))
    trained = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
    heads = {name for name in trained if name.startswith("head.")}
    assert heads and heads == {name for name, _ in model.named_parameters() if name.startswith("head.")}
    assert all("lora_" in name for name in trained - heads)


def test_adapters_disabled_gives_the_base_exactly_and_restores():
    model, base = adapted()
    x = tokens()
    with torch.no_grad():
        expected, adapted_logits = base(x), model(x)
        assert (adapted_logits - expected).abs().max() > 1e-3  # the adapters do something
        with adapters_disabled(model):
            assert torch.equal(model(x), expected)
        assert torch.equal(model(x), adapted_logits)
    # flags untouched: the adapters still train after the reference pass
    assert all(parameter.requires_grad for name, parameter in model.named_parameters() if "lora_" in name)


def test_adapters_disabled_restores_after_an_error():
    model, _ = adapted()
    with pytest.raises(RuntimeError), adapters_disabled(model):
        raise RuntimeError
    assert not any(layer.disable_adapters for layer in model.modules() if isinstance(layer, BaseTunerLayer))


def test_merging_gives_the_adapted_logits_with_plain_linear_layers():
    model, base = adapted()
    x = tokens()
    with torch.no_grad():
        expected = model(x)
        merged = merge_adapters(model)
        torch.testing.assert_close(merged(x), expected, rtol=1e-5, atol=1e-5)
    assert not any(isinstance(module, BaseTunerLayer) for module in merged.modules())
    for name in LORA.target_modules:
        parent = "attention" if name in ("wq", "wk", "wv", "wo") else "feed_forward"
        assert type(getattr(getattr(merged.layers[0], parent), name)) is nn.Linear
    assert set(merged.state_dict()) == set(base.state_dict())
    assert not hasattr(merged, "adapter_config")
    plain = Transformer(ModelConfig(**TINY))
    plain.load_state_dict(merged.state_dict(), strict=True)  # loads as a plain model
    with torch.no_grad():
        torch.testing.assert_close(plain.eval()(x), expected, rtol=1e-5, atol=1e-5)


def test_merged_state_of_gathered_weights_with_tied_embeddings():
    """What ExportFinal writes: the adapted model's weights (as gathered from every rank) merged on a meta-built
    model, here one whose LM head is its embedding (Llama 3.2 1B's)."""
    config = ModelConfig(**TINY, tie_embeddings=True)
    torch.manual_seed(0)
    model = add_adapters(Transformer(config), LORA)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.05)
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    merged = merged_state(state, LORA, lambda: Transformer(config))
    expected = merge_adapters(copy.deepcopy(model)).state_dict()
    assert merged.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(merged[name], tensor, rtol=0, atol=0, msg=name)
    assert torch.equal(merged["output.weight"], merged["tok_embeddings.weight"])


def test_the_fingerprint_is_the_bases_and_changes_with_its_weights():
    model = tiny_model()
    before = base_fingerprint(model)
    add_adapters(model, LORA)
    assert base_fingerprint(model) == before
    for layer, row, column in ((0, 0, 0), (1, 5, 7)):  # any weight: also one no strided sample would read
        other = tiny_model()
        with torch.no_grad():
            other.layers[layer].attention.wq.weight[row, column] += 1e-6
        assert base_fingerprint(other) != before
    torch.manual_seed(1)  # another seed: another base
    assert base_fingerprint(Transformer(ModelConfig(**TINY))) != before


@pytest.mark.parametrize("targets", [["wx"], ["output"], ["wq", "lm_head"], []])
def test_a_target_that_is_no_projection_is_a_one_line_config_error(targets):
    with pytest.raises(ConfigError, match=r"peft\.target_modules") as caught:
        check_peft_config(PeftConfig(kind="lora", target_modules=targets), tiny_model())
    assert "\n" not in str(caught.value)


def test_hugging_face_names_are_accepted():
    model = tiny_model()
    add_adapters(model, PeftConfig(kind="lora", rank=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    adapted_layers = {
        plain_name(name).rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, BaseTunerLayer)
    }
    assert adapted_layers == {"wq", "wv", "w2"}


def test_peft_kind_none_checks_nothing():
    check_peft_config(PeftConfig(kind="none", target_modules=["wx"]), tiny_model())


@pytest.mark.parametrize(("override", "key"), [("peft.rank=0", "peft.rank"), ("peft.rank=-4", "peft.rank"),
                                               ("peft.alpha=0", "peft.alpha"), ("peft.dropout=1.0", "peft.dropout")])  # fmt: skip
def test_out_of_range_peft_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as caught:
        load_config(SFTConfig, ROOT / "configs/sft/tiny.yaml", ["peft.kind=lora", override])
    assert "\n" not in str(caught.value)


def grads(model: nn.Module, x: torch.Tensor, seed: int = 5) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model(x).float().square().mean().backward()
    return {plain_name(name): p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_dropout_under_activation_checkpointing_recomputes_the_same_forward():
    """LoRA's dropout draws random numbers: the recomputation in backward must draw the same ones, or the
    gradients are those of another forward."""
    model, _ = adapted(PeftConfig(kind="lora", rank=4, dropout=0.5))
    model.train()
    checkpointed = copy.deepcopy(model)
    apply_activation_checkpointing(checkpointed, "full")
    x = tokens()
    expected, got = grads(model, x), grads(checkpointed, x)
    assert expected.keys() == got.keys() and expected
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)


def test_adapters_under_compile_and_activation_checkpointing(monkeypatch):
    """fullgraph compile (per block, as trainer.compile does) of peft's LoRA layers under activation checkpointing:
    the logits and gradients of eager, with adapters on and off; each variant (adapters on with grad, off without, as
    a reference pass runs) compiles once, and switching back and forth compiles nothing more. ``aot_eager``: dynamo's
    and AOT autograd's tracing of a real compile without inductor's minutes of codegen on CPU (the FSDP test in
    tests/alignment/test_lora_training.py compiles with inductor)."""
    from torch._dynamo.utils import counters

    model, _ = adapted()
    eager = copy.deepcopy(model)
    x = tokens()
    with torch.no_grad():
        eager_on = eager(x)
        with adapters_disabled(eager):
            eager_off = eager(x)
    eager_grads = grads(eager, x)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    apply_activation_checkpointing(model, "full")
    apply_compile(model)
    torch._dynamo.reset()
    counters.clear()

    compiled_grads = grads(model, x)
    assert compiled_grads.keys() == eager_grads.keys()
    for name in eager_grads:
        torch.testing.assert_close(compiled_grads[name], eager_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    after_on = counters["stats"]["unique_graphs"]
    with adapters_disabled(model), torch.no_grad():
        torch.testing.assert_close(model(x), eager_off, rtol=1e-5, atol=1e-5)
    after_off = counters["stats"]["unique_graphs"]
    # the second variant: one graph, shared by the blocks (never more graphs than the first took)
    assert after_on >= 1 and after_off - after_on == 1
    for _ in range(2):  # back and forth: nothing recompiles
        grads(model, x)
        with adapters_disabled(model), torch.no_grad():
            torch.testing.assert_close(model(x), eager_off, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == after_off
    with torch.no_grad():
        torch.testing.assert_close(model(x), eager_on, rtol=1e-5, atol=1e-5)
