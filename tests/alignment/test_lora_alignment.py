"""LoRA adapters (peft.kind=lora) in DPO, PPO and GRPO: the reference is the policy itself with its adapters off
(no second copy of the weights), equal to the policy at step 0 (LoRA's B starts at zero: DPO's first loss is log 2,
RL's first ratio is 1 and its first KL 0) and to the base model after, the precomputed and on-the-fly DPO references
agree, a short DPO run learns, RL resumes exactly, and checkpoints hold only what trains (the adapters, PPO's
critic head) with the bases' records. Tiny models (dim 64, 2 layers), a few steps each."""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors.torch import load_file

from alignment.shared.responses import response_logprobs
from alignment.stages.dpo import DPOModule, load_dpo_models, response_logprob_sums, run_dpo
from alignment.stages.grpo import GRPOModule, run_grpo
from alignment.stages.ppo import run_ppo
from models.adapters import base_fingerprint
from models.formats.checkpoint import load_checkpoint
from models.heads import load_scalar_model
from tests.alignment.test_dpo import dpo_config, eval_batch, run_metrics
from tests.alignment.test_dpo import setup as dpo_setup  # noqa: F401 (a module fixture, used by name)
from tests.alignment.test_grpo import TOY, first_log_ratios, grpo_config, series
from tests.alignment.test_ppo import ppo_config

LOG2 = math.log(2)
LORA = ("peft.kind=lora", "peft.rank=4", "peft.alpha=8")
# 2 prompts x a group of 4 a rollout, two micro-batches; two held-out prompts
SMALL_GRPO = ("grpo.prompts_per_rollout=2", "grpo.minibatch_size=8", "grpo.micro_batch_size=4", "eval.generations=2")
N_LAYERS, TARGETS = 2, 7  # the tiny model's blocks, and the default peft.target_modules


def lora_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p for name, p in model.named_parameters() if "lora_" in name}


def perturb_adapters(model: torch.nn.Module, seed: int = 0) -> None:
    """Give every LoRA B a nonzero value, as training would: the policy then differs from its base."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lora_tensors(model).items():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5)


def fresh(run, *args, **kwargs):
    """``run(*args, **kwargs)`` from one global RNG state. The adapters' initial A is drawn from it, and nothing seeds
    it when the base is a checkpoint folder, so two runs in one process start alike only this way."""
    torch.manual_seed(1234)
    return run(*args, **kwargs)


class Crash(Exception):
    pass


class CrashAfterTwo(L.Callback):
    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == 2:
            raise Crash  # step 2 is complete: AtomicCheckpoint saves it on the way out


class Observe(L.Callback):
    """What the fitted module holds at train start: its frozen models and its parameter count."""

    def __init__(self) -> None:
        self.seen: dict = {}

    def on_train_start(self, trainer, module) -> None:
        self.seen = {
            "frozen": dict(module.frozen),
            "parameters": sum(p.numel() for p in module.parameters()),
            "model_parameters": sum(p.numel() for p in module.model.parameters()),
            "trainable": {name for name, p in module.named_parameters() if p.requires_grad},
        }


# ---- DPO ----


def test_dpo_reference_is_the_policy_with_adapters_off(dpo_setup, tmp_path):  # noqa: F811
    """No reference copy: load_dpo_models gives none, the module holds only the policy (its base + adapters). At
    step 0 the adapters-off log-probs equal the policy's bit for bit: loss log 2, margins 0, no pair won, exactly as
    with two copies. With trained adapters the reference is still the base model as loaded, not the policy."""
    config = dpo_config(dpo_setup, tmp_path, *LORA, "loss.reference_logprobs=on_the_fly", pairs="demo")
    policy, reference, bases = load_dpo_models(config, dpo_setup["tokenizer"])
    assert reference is None and set(bases) == {"model"}
    base = load_checkpoint(dpo_setup["policy"])
    assert bases["model"]["fingerprint"] == base_fingerprint(base)
    assert bases["model"]["checkpoint"] == str(Path(dpo_setup["policy"]).resolve())
    assert len(lora_tensors(policy)) == 2 * N_LAYERS * TARGETS
    module = DPOModule(config, policy, reference, dpo_setup["tokenizer"])
    assert module.frozen == {} and module.reference_is_base
    base_count = sum(p.numel() for p in base.parameters())
    lora_count = sum(p.numel() for p in lora_tensors(policy).values())
    assert sum(p.numel() for p in module.parameters()) == base_count + lora_count  # one copy of the weights

    batch = eval_batch(config)
    pairs = int(batch["pair_mask"].sum())
    with torch.no_grad():
        loss, sums = module.pair_terms(batch, "train")
        reference_sums = module._reference_forward(batch)
        policy_sums = response_logprob_sums(policy, batch, chunk_size=config.trainer.loss_chunk_size)[0]
    assert torch.equal(reference_sums, policy_sums)  # B = 0: the adapters add exactly nothing
    assert loss.item() == pytest.approx(pairs * LOG2, rel=1e-6)
    assert sums[1].item() == 0 and sums[2].item() == 0  # no pair won, margins 0

    perturb_adapters(policy)
    with torch.no_grad():
        reference_sums = module._reference_forward(batch)
        policy_sums = response_logprob_sums(policy, batch, chunk_size=config.trainer.loss_chunk_size)[0]
        base_sums = response_logprob_sums(base, batch, chunk_size=config.trainer.loss_chunk_size)[0]
        loss = module.pair_terms(batch, "train")[0]
    torch.testing.assert_close(reference_sums, base_sums, rtol=1e-5, atol=1e-4)
    assert (policy_sums - base_sums).abs().max() > 1e-2  # the adapters are on for the policy
    assert abs(loss.item() - pairs * LOG2) > 1e-3
    assert lora_tensors(policy)["layers.0.attention.wq.lora_B.default.weight"].abs().sum() > 0  # left switched on


def test_dpo_with_lora_learns_and_precompute_equals_on_the_fly(dpo_setup, tmp_path):  # noqa: F811
    """On the toy pairs, 6 steps of adapters only: the precomputed (adapters-off pass in on_fit_start) and the
    on-the-fly reference give the same losses step by step from log 2; the run learns the preference; its
    checkpoint holds the adapters only, with the base's record; final/ is the merged policy."""
    common = [
        *LORA, "trainer.max_steps=6", "trainer.val_every_n_steps=6", "checkpoint.every_n_steps=6", "run.name=run",
        "optim.lr=1e-2", "optim.min_lr=1e-2", "optim.warmup_steps=0",
    ]  # fmt: skip
    runs, observed = {}, {}
    for mode in ("precompute", "on_the_fly"):
        observe = Observe()
        config = dpo_config(dpo_setup, tmp_path / mode, *common, f"loss.reference_logprobs={mode}")
        run_dir = fresh(run_dpo, config, extra_callbacks=[observe])
        observed[mode] = observe.seen
        runs[mode] = run_metrics(run_dir, "train/reward_accuracy")
        assert len(list(run_dir.glob("reference-logprobs-*.pt"))) == (mode == "precompute")
        seen = observe.seen
        assert seen["frozen"] == {} and seen["parameters"] == seen["model_parameters"]  # no reference copy
        assert seen["trainable"] and all("lora_" in name for name in seen["trainable"])
    for mode, metrics in runs.items():
        loss, margin, accuracy = metrics["train/loss"], metrics["train/reward_margin"], metrics["train/reward_accuracy"]
        assert loss[1] == pytest.approx(LOG2, abs=1e-6) and abs(margin[1]) < 1e-6 and accuracy[1] == 0.0, mode
        assert loss[6] < loss[1] - 0.05 and margin[6] > 0 and accuracy[6] > 0.5, (mode, loss, accuracy)
    for metric, values in runs["precompute"].items():
        assert values.keys() == runs["on_the_fly"][metric].keys() and values, metric
        for step, value in values.items():
            assert runs["on_the_fly"][metric][step] == pytest.approx(value, abs=1e-5), (metric, step)

    run_dir = tmp_path / "precompute" / "run"
    checkpoint = torch.load(run_dir / "checkpoints" / "step-00000006.ckpt", weights_only=True)
    assert checkpoint["state_dict"] and all("lora_" in name for name in checkpoint["state_dict"])
    assert len(checkpoint["state_dict"]) == 2 * N_LAYERS * TARGETS
    base = load_checkpoint(dpo_setup["policy"])
    assert checkpoint["adapters"]["model"]["fingerprint"] == base_fingerprint(base)
    assert checkpoint["adapters"]["model"]["peft"]["rank"] == 4
    final = load_checkpoint(run_dir / "final")  # merged: a plain model, other weights than the base
    assert not lora_tensors(final)
    assert not torch.equal(final.layers[0].attention.wq.weight, base.layers[0].attention.wq.weight)
    assert torch.equal(final.output.weight, base.output.weight)  # not a target: untouched


def test_dpo_with_lora_and_an_explicit_reference_keeps_that_reference(dpo_setup, tmp_path):  # noqa: F811
    config = dpo_config(dpo_setup, tmp_path, *LORA, f"init.reference={dpo_setup['other']}")
    policy, reference, bases = load_dpo_models(config, dpo_setup["tokenizer"])
    assert reference is not None and not lora_tensors(reference) and lora_tensors(policy) and set(bases) == {"model"}
    module = DPOModule(config, policy, reference, dpo_setup["tokenizer"])
    assert not module.reference_is_base and module.frozen["reference"] is reference


# ---- GRPO ----


def grpo_first_rollouts(setup, out_dir: Path, *overrides: str) -> tuple[Path, list[float], dict]:
    """A short GRPO run with LoRA; the first minibatch's max |log ratio| of every rollout, and what the module held."""
    observe = Observe()
    with first_log_ratios() as captured:
        run_dir = fresh(run_grpo, grpo_config(setup, out_dir, *LORA, *overrides), extra_callbacks=[observe])
    return run_dir, captured, observe.seen


def test_grpo_with_lora_first_ratio_is_one_first_kl_zero_and_no_reference_copy(setup, tmp_path):
    """Every rollout's first minibatch reproduces its old log-probs bit for bit; the first rollout's KL to the
    reference (the base) is exactly 0, and once the adapters have trained it is not (the reference is the base, not
    the policy). The module holds one copy of the weights and trains the adapters only."""
    run_dir, ratios, seen = grpo_first_rollouts(
        setup, tmp_path, TOY, "trainer.max_steps=3", "optim.lr=2e-2", "optim.min_lr=2e-2", "eval.every_n_rollouts=100",
        "eval.pass_k=0", "checkpoint.every_n_steps=3", *SMALL_GRPO,
    )  # fmt: skip
    assert ratios == [0.0, 0.0, 0.0]
    kl = series(run_dir, "kl.csv")["grpo/kl"]
    assert len(kl) == 3 and kl[0] == 0.0 and kl[-1] != 0.0 and all(math.isfinite(k) for k in kl), kl
    assert seen["frozen"] == {} and seen["parameters"] == seen["model_parameters"]
    assert seen["trainable"] and all("lora_" in name for name in seen["trainable"])
    checkpoint = torch.load(run_dir / "checkpoints" / "step-00000003.ckpt", weights_only=True)
    assert len(checkpoint["state_dict"]) == 2 * N_LAYERS * TARGETS
    assert all(name.startswith("model.") and "lora_" in name for name in checkpoint["state_dict"])
    assert checkpoint["adapters"]["model"]["fingerprint"] == base_fingerprint(load_checkpoint(setup["policy"]))


def test_grpo_reference_logprobs_are_the_base_models(setup, tmp_path):
    """With trained (here: perturbed) adapters, reference_logprobs gives the base model's log-probs, not the
    policy's, and leaves the adapters on."""
    from alignment.shared.initial_model import add_stage_adapters
    from alignment.shared.rewards import build_reward
    from alignment.stages.registry import GRPO
    from alignment.stages.rl import load_policy

    config = grpo_config(setup, tmp_path, *LORA)
    reward = build_reward(config.reward.terms)
    policy = load_policy(config, GRPO)
    add_stage_adapters(config, policy, key="policy")
    module = GRPOModule(config, policy, None, reward, setup["tokenizer"])
    assert module.frozen == {}
    perturb_adapters(policy)
    ids = torch.randint(5, 4000, (3, 12), generator=torch.Generator().manual_seed(0))
    real = torch.ones_like(ids, dtype=torch.bool)
    real[0, :3] = False  # left padding
    with torch.no_grad():
        reference = module.reference_logprobs(ids, real, 5, 0)
        base = response_logprobs(load_checkpoint(setup["policy"]), ids, real, 5, config.grpo.temperature)[0]
        on = response_logprobs(policy, ids, real, 5, config.grpo.temperature)[0]
    assert reference.dtype == torch.float32
    torch.testing.assert_close(reference, base, rtol=1e-5, atol=1e-5)
    assert (on - base).abs().max() > 1e-2


def test_grpo_with_lora_resume_is_exact(setup, tmp_path):
    """4 rollouts straight vs 2, a crash, and a resume for the last 2 from a checkpoint of adapters only: the same
    adapters bit for bit, and the same merged policy."""
    common = [
        *LORA, TOY, "trainer.max_steps=4", "checkpoint.every_n_steps=2", "eval.every_n_rollouts=100", "eval.pass_k=0",
        "optim.lr=5e-3", "optim.min_lr=5e-3", *SMALL_GRPO,
    ]  # fmt: skip
    straight = fresh(run_grpo, grpo_config(setup, tmp_path / "straight", *common))
    with pytest.raises(Crash):
        fresh(run_grpo, grpo_config(setup, tmp_path / "resumed", *common), extra_callbacks=[CrashAfterTwo()])
    checkpoint = torch.load(tmp_path / "resumed/grpo-tiny/checkpoints/step-00000002.ckpt", weights_only=True)
    assert checkpoint["state_dict"] and all("lora_" in name for name in checkpoint["state_dict"])
    assert set(checkpoint["adapters"]) == {"model"}
    resumed = fresh(run_grpo, grpo_config(setup, tmp_path / "resumed", *common))
    last = [torch.load(run / "checkpoints/step-00000004.ckpt", weights_only=True) for run in (straight, resumed)]
    assert last[0]["state_dict"].keys() == last[1]["state_dict"].keys()
    moved = 0
    for name, tensor in last[0]["state_dict"].items():
        torch.testing.assert_close(tensor, last[1]["state_dict"][name], atol=1e-7, rtol=0, msg=name)
        moved += "lora_B" in name and tensor.abs().max().item() > 1e-4
    assert moved == N_LAYERS * TARGETS  # every adapter trained: the comparison means something
    a, b = load_file(straight / "final/model.safetensors"), load_file(resumed / "final/model.safetensors")
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0, msg=name)


# ---- PPO ----


def test_ppo_with_lora_first_ratio_is_one_and_the_critic_has_its_own_adapters(setup, tmp_path, monkeypatch):
    """A zeros critic on the policy's backbone (copied before the policy got its adapters): one set of adapters
    each, the critic's head trains whole; the first minibatch has ratio 1, approx-KL 0, clip fraction 0, and the
    first rollout's KL is exactly 0. The checkpoint holds the policy's and the critic's adapters and the critic's
    head, and both bases' records (both the policy as loaded)."""
    import csv

    observe = Observe()
    config = ppo_config(
        setup, tmp_path, *LORA, "init.critic=zeros", "trainer.max_steps=2", "ppo.rollout_batch_size=8",
        "ppo.minibatch_size=8", "ppo.micro_batch_size=4", "ppo.epochs=1", "eval.every_n_rollouts=100",
        "logger.kind=csv", "checkpoint.every_n_steps=2", "optim.lr=1e-2", "eval.generations=2", "eval.pass_k=0",
    )  # fmt: skip
    run_dir = fresh(run_ppo, config, extra_callbacks=[observe])
    with open(run_dir / "csv" / "metrics.csv", newline="") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("ppo/kl") not in ("", None)]
    assert len(rows) == 2
    for row in rows:
        assert float(row["ppo/first_minibatch_max_log_ratio"]) == 0.0
        assert float(row["ppo/first_minibatch_approx_kl"]) == 0.0
        assert float(row["ppo/first_minibatch_clip_fraction"]) == 0.0
    assert float(rows[0]["ppo/kl"]) == 0.0 and float(rows[1]["ppo/kl"]) != 0.0

    seen = observe.seen
    assert seen["frozen"] == {}
    trainable = seen["trainable"]
    assert all("lora_" in name or name.startswith("critic.head.") for name in trainable)
    critic_lora = [n for n in trainable if n.startswith("critic.") and "lora_" in n]
    policy_lora = [n for n in trainable if n.startswith("model.") and "lora_" in n]
    assert len(critic_lora) == len(policy_lora) == 2 * N_LAYERS * TARGETS  # the critic never got the policy's
    assert not any("base_layer.base_layer" in n for n in trainable)

    checkpoint = torch.load(run_dir / "checkpoints" / "step-00000002.ckpt", weights_only=True)
    saved = set(checkpoint["state_dict"])
    heads = {name for name in saved if name.startswith("critic.head.")}
    assert heads == {"critic.head.proj.weight", "critic.head.proj.bias"}
    assert saved - heads == {name for name in trainable if "lora_" in name}
    fingerprint = base_fingerprint(load_checkpoint(setup["policy"]))
    assert set(checkpoint["adapters"]) == {"model", "critic"}
    assert (
        checkpoint["adapters"]["model"]["fingerprint"] == checkpoint["adapters"]["critic"]["fingerprint"] == fingerprint
    )


def test_ppo_with_lora_resume_is_exact(setup, tmp_path):
    """A critic copied from the reward model (its base: the reward model's backbone): 4 rollouts straight vs 2 + a
    resume, adaptive KL; the same adapters and critic head bit for bit, and the same merged policy."""
    common = [
        *LORA, "trainer.max_steps=4", "checkpoint.every_n_steps=2", "ppo.kl_adaptive=true", "ppo.kl_target=0.01",
        "ppo.kl_horizon=50", "eval.every_n_rollouts=100", "optim.lr=5e-3", "critic_optim.lr=5e-3",
        "ppo.rollout_batch_size=4", "ppo.minibatch_size=4", "ppo.micro_batch_size=4", "eval.generations=2", "eval.pass_k=0",
    ]  # fmt: skip
    straight = fresh(run_ppo, ppo_config(setup, tmp_path / "straight", *common))
    with pytest.raises(Crash):
        fresh(run_ppo, ppo_config(setup, tmp_path / "resumed", *common), extra_callbacks=[CrashAfterTwo()])
    checkpoint = torch.load(tmp_path / "resumed/ppo-tiny/checkpoints/step-00000002.ckpt", weights_only=True)
    saved = checkpoint["state_dict"]
    assert all("lora_" in name or name.startswith("critic.head.") for name in saved)
    assert any(name.startswith("model.") for name in saved) and "critic.head.proj.weight" in saved
    critic_base = load_scalar_model(setup["reward"])[0].backbone
    assert checkpoint["adapters"]["critic"]["fingerprint"] == base_fingerprint(critic_base)
    assert checkpoint["adapters"]["critic"]["checkpoint"] == str(Path(setup["reward"]).resolve())
    resumed = fresh(run_ppo, ppo_config(setup, tmp_path / "resumed", *common))
    last = [torch.load(run / "checkpoints/step-00000004.ckpt", weights_only=True) for run in (straight, resumed)]
    assert last[0]["state_dict"].keys() == last[1]["state_dict"].keys()
    for name, tensor in last[0]["state_dict"].items():
        torch.testing.assert_close(tensor, last[1]["state_dict"][name], atol=1e-7, rtol=0, msg=name)
    assert last[0]["ppo"]["kl_controller"] == last[1]["ppo"]["kl_controller"]
    a, b = (load_checkpoint(run / "final").state_dict() for run in (straight, resumed))
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0, msg=name)
    initial = load_checkpoint(setup["policy"])
    assert not torch.equal(a["layers.0.attention.wq.weight"], initial.layers[0].attention.wq.weight)
