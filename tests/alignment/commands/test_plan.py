"""``lantern plan`` as a user types it (in-process through ``main``): every stage preset and a pipeline preset, as a
table and as JSON; bad input as one line; the verdict's knob on configs that do not fit, each suggestion planned
again and fitting; and the plan line a stage prints before it trains, which never fails the run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from alignment.commands.cli import main
from models.formats.checkpoint import save_checkpoint
from models.model import ModelConfig, Transformer

ROOT = Path(__file__).resolve().parents[3]
PRESETS = sorted(
    str(path.relative_to(ROOT)) for path in (ROOT / "configs").glob("*/*.yaml") if path.parent.name not in ("model", "pipeline")
)  # fmt: skip


def plan(capsys, *args: str) -> str:
    assert main(["plan", *args]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def plan_json(capsys, *args: str) -> dict:
    return json.loads(plan(capsys, *args, "--json"))


def error(capsys, *args: str) -> str:
    assert main(["plan", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err.strip()


def needs_model(path: str) -> list[str]:
    """The presets whose model folder comes from an earlier stage are planned with a named model (one whose context
    holds their rows)."""
    # a continued-pretraining preset starts from a checkpoint the user converts first (absent on a clean clone)
    continued = "init" in (config := OmegaConf.load(ROOT / path)) and bool(config.init.get("checkpoint"))
    if ("/pretrain/" in path and not continued) or path.endswith(("sft/tiny.yaml", "rm/tiny.yaml", "dpo/tiny.yaml")):
        return []
    return ["--model", "llama3.2-1b" if "llama" in path else "tiny"]


@pytest.mark.parametrize("preset", PRESETS)
def test_every_stage_preset_plans_as_a_table_and_as_json(capsys, preset):
    table = plan(capsys, preset, *needs_model(preset))
    assert table.startswith("lantern plan: ") and "memory per GPU" in table and "\nverdict: " in table
    assert "MFU" in table and "not measured by Lantern" in table
    result = plan_json(capsys, preset, *needs_model(preset))
    assert result["verdict"] in ("fits", "fits, tight", "does not fit")
    assert result["peak_bytes"] == max(phase["bytes"] for phase in result["phases"]) > 0
    assert result["time"]["step_s"] > 0 and result["time"]["tokens_per_s"] > 0


def test_a_pipeline_preset_plans_every_model_stage(capsys, tmp_path, monkeypatch):
    """Each stage from the pipeline's resolved config, each fine-tuning stage on the model pretraining trains."""
    monkeypatch.chdir(tmp_path)  # the pipeline's out_dir is relative: nothing is written, but read from here
    table = plan(capsys, "configs/pipeline/tiny.yaml", "--gpu", "a100-80g")
    stages = ("pretrain", "sft", "rm", "ppo", "grpo", "dpo", "rejection_sampling")
    assert "pipeline summary" in table and all(f"lantern plan: {stage}" in table for stage in stages)
    result = plan_json(capsys, "configs/pipeline/default.yaml", "--gpu", "cpu")
    assert [s["stage"] for s in result["stages"]] == ["pretrain", "sft", "rm", "ppo", "grpo"]
    tiny = "4 layers, dim 128"  # the pipeline's model=tiny reaches every stage through the wiring
    assert all(tiny in s["model"] and s["gpus"] == 0 and s["time"] is None for s in result["stages"])
    assert not list(tmp_path.iterdir())


def test_bad_input_is_one_line(capsys, tmp_path):
    unknown = error(capsys, "configs/pretrain/tiny.yaml", "--gpu", "h300")
    assert "h300" in unknown and "h100, h100-pcie, h200, a100-80g" in unknown and "\n" not in unknown
    assert "trainer.nope" in error(capsys, "configs/pretrain/tiny.yaml", "trainer.nope=1")
    assert "does not exist" in error(capsys, str(tmp_path / "missing.yaml"))
    missing = error(capsys, "configs/ppo/tiny.yaml")
    assert "init.policy" in missing and "--model" in missing and "\n" not in missing
    assert "--fabric" in error(capsys, "configs/pretrain/tiny.yaml", "--fabric", "carrier-pigeon")
    assert "--mfu" in error(capsys, "configs/pretrain/tiny.yaml", "--mfu", "1.5")
    assert "trainer.strategy 'single'" in error(capsys, "configs/pretrain/tiny.yaml", "trainer.devices=8")
    (tmp_path / "odd.yaml").write_text("run: {name: x}\ntrainer: {max_steps: 2}\n")
    assert "--stage" in error(capsys, str(tmp_path / "odd.yaml"))
    assert "pipeline" in error(capsys, "configs/pretrain/tiny.yaml", "--stage", "finetune")


def test_a_model_folder_is_read_for_its_config(capsys, tmp_path, tok):
    folder = save_checkpoint(Transformer(ModelConfig.from_preset("tiny", n_layers=3)), tmp_path / "sft-final")
    result = plan_json(capsys, "configs/grpo/tiny.yaml", f"init.policy={folder}", "--stage", "grpo")
    assert "3 layers, dim 128" in result["model"]


def knob_settings(knob: str) -> list[list[str]]:
    """The knob's alternatives, each as overrides: 'set A, or B ≤ 2, or C (x=1 y=2)'."""
    options = knob.split(": set ", 1)[1].split(", or ") if ": set " in knob else [knob.split("together: ", 1)[1]]
    settings = []
    for option in options:
        found = [f"{key}={value}" for key, value in re.findall(r"([a-z_]+\.[a-z_.]+)\s*(?:=|≤)\s*([\w.-]+)", option)]
        settings.append(found)
    return settings


def test_a_config_that_does_not_fit_names_the_knob_that_makes_it_fit(capsys):
    """Llama 3.1 8B pretraining on one A100 40GB: the 8-GPU preset on one GPU fits with more GPUs or CPU offload;
    one process without checkpointing fits with nothing alone, but with the settings named together. Every
    suggestion is planned again here and fits."""
    args = ["configs/pretrain/llama3.2-1b.yaml", "model=llama3.1-8b", "trainer.devices=1", "--gpu", "a100-40g"]
    result = plan_json(capsys, *args)
    assert result["verdict"] == "does not fit" and result["peak_bytes"] > result["capacity_bytes"]
    assert result["line"].startswith("does not fit: peak ") and result["line"].endswith(result["knob"])
    assert result["knob"].startswith("model optimizer states ")
    for option in knob_settings(result["knob"]):
        assert plan_json(capsys, *args, *option)["verdict"] != "does not fit", option
    single = [*args, "trainer.strategy=single", "trainer.init_device=cpu", "trainer.activation_checkpointing=none"]
    result = plan_json(capsys, *single)
    assert result["verdict"] == "does not fit" and "together: " in result["knob"]
    (together,) = knob_settings(result["knob"])
    assert "trainer.strategy=fsdp" in together and plan_json(capsys, *single, *together)["verdict"] != "does not fit"


def test_each_suggested_setting_alone_makes_it_fit(capsys):
    """The one-GPU 1B preset at 24 sequences a micro-batch (16 fit, its blocks compiled): activations lead, and every
    option offered fits."""
    args = ["configs/pretrain/llama3.2-1b-1gpu.yaml", "loader.micro_batch_size=24"]
    result = plan_json(capsys, *args)
    assert result["verdict"] == "does not fit" and result["knob"].startswith("activations ")
    options = knob_settings(result["knob"])
    assert any("trainer.activation_checkpointing" in o[0] for o in options)
    assert any("loader.micro_batch_size" in o[0] for o in options)
    for option in options:
        assert plan_json(capsys, *args, *option)["verdict"] != "does not fit", option


def test_time_cost_and_interconnect(capsys):
    """70B on 8 nodes of 8 H100s: step = max(compute, the collectives over InfiniBand); cost from the price."""
    args = [
        "configs/pretrain/llama3.2-1b.yaml",
        "model=llama3.1-70b",
        "trainer.num_nodes=8",
        "--price-per-gpu-hour",
        "2",
    ]
    time = plan_json(capsys, *args)["time"]
    assert time["communication_s"] > 0 and "ib-ndr" in time["communication"]
    assert time["step_s"] == max(time["compute_s"], time["communication_s"])
    assert time["tokens_per_s"] == pytest.approx(time["tokens_per_step"] / time["step_s"])
    assert time["gpu_hours"] == pytest.approx(time["total_s"] / 3600 * 64)
    assert time["cost"] == pytest.approx(2 * time["gpu_hours"])
    slow = plan_json(capsys, *args, "--bandwidth", "1")["time"]
    assert slow["communication_s"] > time["communication_s"] and slow["step_s"] == slow["communication_s"]
    half = plan_json(capsys, *args, "--mfu", str(time["mfu"] / 2))["time"]  # --mfu: the planned run's own
    assert half["compute_s"] == pytest.approx(2 * time["compute_s"], rel=1e-3)


def test_lora_stages_keep_no_reference_copy(capsys):
    """DPO, PPO and GRPO with peft.kind=lora: the reference is the policy with its adapters off, not a copy."""

    def items(*args: str) -> set[str]:
        result = plan_json(capsys, *args)
        return {item["name"] for phase in result["phases"] for item in phase["items"]}

    dpo = ["configs/dpo/tiny.yaml", "loss.reference_logprobs=on_the_fly"]
    assert "reference (frozen)" in items(*dpo) and "reference (frozen)" not in items(*dpo, "peft.kind=lora")
    for preset in ("configs/ppo/tiny.yaml", "configs/grpo/tiny.yaml"):
        assert "reference (frozen)" in items(preset, "--model", "tiny")
        assert "reference (frozen)" not in items(preset, "--model", "tiny", "peft.kind=lora")


def test_cpu_offload_costs_its_copies_and_the_host_optimizer_step(capsys):
    """``trainer.cpu_offload=true`` (8B on 8 H100s): each micro-batch copies every GPU's parameter shard in twice and
    its gradient shard out over PCIe (with the collectives, overlapped with compute), and AdamW then runs on the host
    for the whole node, bound by its memory: 8 GPUs x 1.0B trained parameters x 28 bytes at 300 GB/s, 0.75 s a step.
    It used to plan the same step as without offload."""
    args = ["configs/pretrain/llama3.2-1b.yaml", "model=llama3.1-8b", "trainer.devices=8"]
    on_gpu = plan_json(capsys, *args)["time"]
    offload = plan_json(capsys, *args, "trainer.cpu_offload=true")["time"]
    parameters = 8_030_261_248
    assert offload["host_s"] == pytest.approx(parameters * 28 / 300e9, rel=1e-3)
    copies = 4 * (2 * 4 * parameters / 8 + 4 * parameters / 8) / (64 * 0.8 * 1e9)  # 4 micro-batches, PCIe 5
    assert offload["communication_s"] - on_gpu["communication_s"] == pytest.approx(copies, rel=1e-3)
    assert offload["step_s"] == pytest.approx(max(offload["compute_s"], offload["communication_s"]) + offload["host_s"])
    assert on_gpu["host_s"] == 0 and offload["step_s"] > on_gpu["step_s"]


@pytest.mark.parametrize(
    ("model", "params"),
    [
        ("qwen3-0.6b", "596M parameters (28 layers, dim 1024, vocab 151,936)"),
        ("qwen3-1.7b", "1.72B parameters (28 layers, dim 2048, vocab 151,936)"),
        ("gemma3-270m", "268M parameters (18 layers, dim 640, vocab 262,144)"),
        ("gemma3-1b", "1B parameters (26 layers, dim 1152, vocab 262,144)"),
    ],
)
def test_each_family_preset_plans_with_its_published_size(capsys, model, params):
    """Qwen3's and Gemma 3's presets (QK norm, wide heads, tied embeddings; Gemma's block and local layers) as the
    model of an SFT run."""
    table = plan(capsys, "configs/sft/tiny.yaml", "--model", model)
    assert f"model   {params}" in table
    assert plan_json(capsys, "configs/sft/tiny.yaml", "--model", model)["verdict"] in ("fits", "fits, tight")


def smollm2_style_tokenizer(folder: Path) -> Path:
    """A small byte-level BPE folder with SmolLM2-Instruct's chat template (a default system turn before any user
    turn)."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = RustTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tokenizer.train_from_iterator(["You are a helpful AI assistant named SmolLM, trained by Hugging Face"], trainer)
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    template = (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
        "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
        "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_rl_time_counts_the_shared_preamble_and_rows_leaving_the_batch(capsys, tmp_path):
    """The chat template's system preamble is prefilled and scored once a pass, not once a row; with
    --mean-response-tokens a row pays decoding until it stops; without it, every row runs to the limit."""
    from alignment.shared.plan_rl import template_prefix
    from alignment.stages.registry import stage_named
    from data.tokenizer.base import load_tokenizer

    folder = smollm2_style_tokenizer(tmp_path / "tokenizer")
    chat = load_tokenizer(str(folder))
    # <|im_start|>system\n...<|im_end|>\n<|im_start|>user\n: three special tokens and the text between them
    texts = ("system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face", "\n", "user\n")
    preamble = [0] * 3 + [token for text in texts for token in chat.encode(text)]
    grpo = stage_named("grpo")
    config = OmegaConf.create({"data": {"tokenizer": str(folder)}, "init": {"policy": None}, "reward": {"terms": []}})
    assert template_prefix(grpo, config) == len(preamble) >= 8
    config.data.tokenizer = "default"  # BOS alone: shorter than a prefix worth running once
    assert template_prefix(grpo, config) == 0

    args = ["configs/grpo/tiny.yaml", "--model", "llama3.2-1b", "data.max_prompt_tokens=64", "grpo.response_max_tokens=64"]  # fmt: skip
    plain = plan_json(capsys, *args, "data.tokenizer=default")["time"]
    shared = plan_json(capsys, *args, f"data.tokenizer={folder}")["time"]
    assert shared["compute_s"] < plain["compute_s"]
    assert any(f"{len(preamble)}-token preamble" in note for note in shared["notes"])
    assert not any("preamble" in note for note in plain["notes"])

    def generation(time: dict) -> float:
        return float(next(n for n in time["notes"] if n.startswith("generation ~")).split("~")[1].split(" s")[0])

    assert any("every row decodes 64 tokens" in note for note in plain["notes"])
    limit = plan_json(capsys, *args, "data.tokenizer=default", "--mean-response-tokens", "64")["time"]
    assert limit["compute_s"] == pytest.approx(plain["compute_s"])  # the default is the upper bound
    half = plan_json(capsys, *args, "data.tokenizer=default", "--mean-response-tokens", "16")["time"]
    assert generation(half) < generation(plain) and any("16 tokens on average" in n for n in half["notes"])
    assert "--mean-response-tokens must be > 0" in error(capsys, *args, "--mean-response-tokens", "0")


def test_an_episode_is_one_row_of_the_stages_episodes_max_tokens(capsys):
    """PPO and GRPO over tool episodes (the episodes section their records declare): a rollout's rows are
    ``episodes.max_tokens`` wide, not a prompt plus one turn (the KV cache follows), an episode longer than the
    model's context is refused as the run refuses it, and a rollout decodes every turn."""
    tool = "episodes.environment=alignment.shared.episodes:Environment"

    def kv_cache(*args: str) -> int:
        result = plan_json(capsys, *args)
        return next(i["bytes"] for phase in result["phases"] for i in phase["items"] if i["name"] == "KV cache")

    for preset in ("configs/ppo/tiny.yaml", "configs/grpo/tiny.yaml"):
        single = kv_cache(preset, "--model", "tiny")  # data.max_prompt_tokens 192 + response_max_tokens 16: 208
        assert kv_cache(preset, "--model", "tiny", tool, "episodes.max_tokens=104") * 2 == single
        assert kv_cache(preset, "--model", "tiny", "episodes.max_tokens=104") == single  # no environment: unused
        message = error(capsys, preset, "--model", "tiny", tool, "episodes.max_tokens=1000")
        assert message.endswith("episodes.max_tokens (1000) exceeds the model's max_seq_len (256)")
        # three turns: three turns' decoding, and each turn's prompts kept for the next one's prefill
        wide = [tool, "episodes.max_tokens=200"]
        three = plan_json(capsys, preset, "--model", "tiny", "--gpu", "h100", *wide, "episodes.max_turns=3")
        notes = three["time"]["notes"]
        assert "every row decodes 3 turns of 16 tokens (an upper bound: give --mean-response-tokens)" in notes
        kept = [i for phase in three["phases"] for i in phase["items"] if i["name"] == "last turn's prompts (kept)"]
        assert len(kept) == 1 and kept[0]["bytes"] == kv_cache(preset, "--model", "tiny", "--gpu", "h100", *wide)
