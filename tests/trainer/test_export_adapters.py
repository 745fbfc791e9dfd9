"""`lantern export` of a checkpoint trained with LoRA adapters: merged (native or Hugging Face), or as a Hugging Face
base plus peft's adapter folder, which transformers + peft load to Lantern's logits; a base that changed since
training, or is gone, refused in one line; --adapter on a fully trained checkpoint refused."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import transformers
from peft import AutoPeftModelForCausalLM, PeftModel

from alignment.commands.cli import main
from models.adapters import add_adapters, base_fingerprint, merge_adapters, trained_names
from models.formats.checkpoint import load_checkpoint, save_checkpoint
from models.model import ModelConfig, Transformer
from models.model_config import PeftConfig

TOL = 1e-4
# GQA (4 query heads, 2 key/value heads): q's and k's adapters are permuted with different head counts
CONFIG = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=4096, max_seq_len=64)
PEFT = PeftConfig(kind="lora", rank=4, alpha=8.0)


def lantern_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(ids).float()


def hf_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(ids).logits.float()


def token_ids() -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))


def with_random_adapters(base: Transformer, seed: int = 2) -> Transformer:
    """``base`` with adapters whose A and B are both random (peft starts B at zero: a no-op adapter)."""
    add_adapters(base, PEFT)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in base.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    return base


def training_checkpoint(path: Path, model: Transformer, record: dict | None) -> Path:
    """What a stage's training checkpoint holds for export: the config, the tensors that trained (every one without
    adapters), and with adapters the base's record (trainer/lm_module.py's ``on_save_checkpoint``)."""
    names = trained_names(model) if record else set(model.state_dict())
    checkpoint = {
        "hyper_parameters": {"config": {"model": CONFIG.to_dict(), "data": {"tokenizer": "default"}}},
        "state_dict": {f"model.{name}": tensor for name, tensor in model.state_dict().items() if name in names},
        "global_step": 3,
    }
    if record:
        checkpoint["adapters"] = {"model": {**record, "peft": asdict(PEFT)}}
    torch.save(checkpoint, path)
    return path


@pytest.fixture
def adapter_run(tmp_path):
    """A base folder, a training checkpoint of random adapters on it, and the model with those adapters."""
    torch.manual_seed(0)
    base = Transformer(CONFIG)
    save_checkpoint(base, tmp_path / "base")
    base = load_checkpoint(tmp_path / "base", dtype=torch.float32)  # as a stage reads it
    record = {
        "checkpoint": str((tmp_path / "base").resolve()),
        "seed": None,
        "model": base.config.to_dict(),
        "fingerprint": base_fingerprint(base),
    }
    model = with_random_adapters(base)
    return tmp_path / "base", training_checkpoint(tmp_path / "step.ckpt", model, record), model


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("lantern export: error: "), err
    return lines[0]


def test_adapter_export_loads_in_transformers_and_peft_with_lanterns_logits(adapter_run, tmp_path):
    _, checkpoint, model = adapter_run
    out = tmp_path / "export"
    assert main(["export", str(checkpoint), str(out), "--adapter"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["adapter", "base"]
    assert sorted(p.name for p in (out / "adapter").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    saved = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert saved["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj", "up_proj"]
    assert (saved["r"], saved["lora_alpha"], saved["lora_dropout"]) == (4, 8.0, 0.0)
    assert (saved["bias"], saved["task_type"], saved["peft_type"]) == ("none", "CAUSAL_LM", "LORA")
    assert saved["base_model_name_or_path"] == str((out / "base").absolute())

    ids = token_ids()
    expected = lantern_logits(model, ids)
    hf = transformers.LlamaForCausalLM.from_pretrained(out / "base", dtype=torch.float32)
    assert (hf_logits(hf, ids) - expected).abs().max() > 0.1  # the adapters change the output
    peft_model = PeftModel.from_pretrained(hf, out / "adapter")
    assert (hf_logits(peft_model, ids) - expected).abs().max().item() <= TOL
    # the adapter folder alone finds its base (base_model_name_or_path)
    auto = AutoPeftModelForCausalLM.from_pretrained(out / "adapter", dtype=torch.float32)
    assert (hf_logits(auto, ids) - expected).abs().max().item() <= TOL


def test_merged_exports_native_and_hf_give_the_adapters_logits(adapter_run, tmp_path):
    _, checkpoint, model = adapter_run
    assert main(["export", str(checkpoint), str(tmp_path / "native")]) == 0  # merged is the default
    assert main(["export", str(checkpoint), str(tmp_path / "hf"), "--merge", "--format", "hf"]) == 0
    ids = token_ids()
    expected = lantern_logits(model, ids)
    native = load_checkpoint(tmp_path / "native")
    assert not any("lora_" in name for name in native.state_dict())
    assert (lantern_logits(native, ids) - expected).abs().max().item() <= TOL
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert (hf_logits(hf, ids) - expected).abs().max().item() <= TOL
    metadata = json.loads((tmp_path / "native" / "lantern.json").read_text())["metadata"]
    assert metadata["merged_adapters"]["peft"] == asdict(PEFT) and metadata["step"] == 3


def change_config(base: Path) -> None:
    info = json.loads((base / "lantern.json").read_text())
    info["model"]["rope_theta"] = 1234.0
    (base / "lantern.json").write_text(json.dumps(info))


def replace_weights(base: Path) -> None:
    torch.manual_seed(7)  # another model of the same shapes where the base was
    save_checkpoint(Transformer(CONFIG), base, if_exists="replace")


@pytest.mark.parametrize(
    "change, says",
    [
        (replace_weights, "now holds another model"),
        (change_config, "model config has changed since (rope_theta 500000.0 -> 1234.0)"),
        (shutil.rmtree, "no longer exists"),
    ],
    ids=["other-weights", "other-config", "gone"],
)
@pytest.mark.parametrize("flag", ["--merge", "--adapter"])
def test_a_changed_or_missing_base_is_refused_in_one_line(adapter_run, tmp_path, capsys, change, says, flag):
    base, checkpoint, _ = adapter_run
    change(base)
    assert main(["export", str(checkpoint), str(tmp_path / "out"), flag]) == 2
    line = one_error_line(capsys)
    assert says in line and str(checkpoint) in line and str(base.resolve()) in line
    assert not (tmp_path / "out").exists()


def test_a_fully_trained_checkpoint_exports_as_before_and_refuses_adapter(tmp_path, capsys):
    torch.manual_seed(0)
    model = Transformer(CONFIG)
    checkpoint = training_checkpoint(tmp_path / "full.ckpt", model, None)
    assert main(["export", str(checkpoint), str(tmp_path / "out"), "--adapter"]) == 2
    assert "holds a fully trained model" in one_error_line(capsys)
    assert not (tmp_path / "out").exists()
    assert main(["export", str(checkpoint), str(tmp_path / "native")]) == 0
    assert main(["export", str(checkpoint), str(tmp_path / "hf"), "--format", "hf"]) == 0
    ids = token_ids()
    expected = lantern_logits(model, ids)
    assert torch.equal(lantern_logits(load_checkpoint(tmp_path / "native"), ids), expected)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert (hf_logits(hf, ids) - expected).abs().max().item() <= TOL
    capsys.readouterr()  # transformers' loading bar
    assert main(["export", str(checkpoint), str(tmp_path / "native")]) == 2  # the destination rules are today's
    assert "not empty" in one_error_line(capsys)


def test_adapter_with_format_native_is_refused(adapter_run, tmp_path, capsys):
    _, checkpoint, _ = adapter_run
    assert main(["export", str(checkpoint), str(tmp_path / "out"), "--adapter", "--format", "native"]) == 2
    assert "--adapter writes a Hugging Face base" in one_error_line(capsys)


def test_a_lora_sft_run_exports_its_adapters_for_peft_and_merged_as_its_final_model(tmp_path):
    """A real run (a seeded base, 2 steps): its checkpoint's --adapter export loads in transformers + peft to the
    logits of final/ (the run's own merged export), and so does its --merge export."""
    from alignment.stages.sft import run_sft
    from data.demo.tasks import write_demo_dataset
    from tests.alignment.test_sft import sft_config

    demo = write_demo_dataset(tmp_path / "demo", n_train=60, n_val=8, n_pairs=2, seed=0)
    run = run_sft(
        sft_config(
            demo, tmp_path / "runs", "trainer.max_steps=2", "trainer.val_every_n_steps=100", "eval.generations=0",
            "peft.kind=lora", "peft.rank=4", "optim.lr=5e-2", "optim.warmup_steps=0", "optim.min_lr=0",
            "checkpoint.every_n_steps=2",
        )
    )  # fmt: skip
    checkpoint = sorted((run / "checkpoints").glob("step-*.ckpt"))[-1]
    assert main(["export", str(checkpoint), str(tmp_path / "adapter"), "--adapter"]) == 0
    assert main(["export", str(checkpoint), str(tmp_path / "merged")]) == 0

    ids = torch.randint(0, 4096, (2, 32), generator=torch.Generator().manual_seed(3))
    final = lantern_logits(load_checkpoint(run / "final"), ids)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "adapter" / "base", dtype=torch.float32)
    base = hf_logits(hf, ids)
    assert (base - final).abs().max() > 1e-3  # two steps at this rate move the adapters off zero
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "adapter" / "adapter")
    assert (hf_logits(peft_model, ids) - final).abs().max().item() <= TOL
    assert (lantern_logits(load_checkpoint(tmp_path / "merged"), ids) - final).abs().max().item() <= TOL


def test_merge_adapters_of_the_rebuilt_model_equals_merging_in_place(adapter_run):
    """The export's rebuilt model (trainer/export.py: base from its folder, adapters loaded) is the trained one."""
    from trainer.export import model_with_adapters, read_training_checkpoint

    _, checkpoint, model = adapter_run
    saved = read_training_checkpoint(checkpoint)
    state = {name.removeprefix("model."): tensor for name, tensor in saved["state_dict"].items()}
    rebuilt = model_with_adapters(checkpoint, saved["adapters"]["model"], state)
    merged, expected = merge_adapters(rebuilt).state_dict(), merge_adapters(model).state_dict()
    assert merged.keys() == expected.keys()
    assert all(torch.equal(merged[name], expected[name]) for name in expected)


def test_a_lora_checkpoint_exports_merged_to_gguf_and_to_hf_with_its_tokenizer(adapter_run, tmp_path):
    """--format gguf writes the merged model with the run's tokenizer (the tiktoken default, converted), which
    transformers' GGUF loader reads back to Lantern's logits; --format hf carries tokenizer.json for AutoTokenizer."""
    pytest.importorskip("gguf")
    from data.tokenizer.tokenizer import Tokenizer

    _, checkpoint, model = adapter_run
    out = tmp_path / "model.gguf"
    assert main(["export", str(checkpoint), str(out), "--format", "gguf", "--dtype", "float32"]) == 0
    ids = token_ids()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name, dtype=torch.float32)
    assert (hf_logits(loaded, ids) - lantern_logits(model, ids)).abs().max().item() <= TOL
    assert main(["export", str(checkpoint), str(out), "--format", "gguf"]) == 2  # exists: --overwrite
    assert main(["export", str(checkpoint), str(tmp_path / "hf"), "--format", "hf"]) == 0
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ours = Tokenizer.load("default")
    text = "ROMEO: But soft, what light through yonder window breaks?\n\nJULIET: 1234 ünïcode"
    assert theirs.encode(text, add_special_tokens=False) == ours.encode(text)
    chat = [{"role": "user", "content": "Who art thou?"}, {"role": "assistant", "content": "A friend."}]
    assert (
        list(theirs.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"])
        == ours.encode_chat(chat)[0]
    )
    assert (tmp_path / "hf" / "original" / "tokenizer.model").is_file()  # Meta's layout, as before
