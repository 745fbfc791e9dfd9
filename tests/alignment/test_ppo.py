"""PPO: the math on fixed tensors against hand-computed values, then the details that make PPO silently
wrong, each checked on a tiny model, then short runs (toy reward, resume, FSDP)."""

import csv
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from alignment.schemas.rl import PPOConfig
from alignment.shared.losses import (
    KLController,
    explained_variance,
    gae,
    kl_penalty,
    logprobs_and_entropy,
    masked_whiten,
    ppo_policy_loss,
    ppo_value_loss,
    token_rewards,
)
from alignment.shared.responses import response_logprobs, response_values
from alignment.stages.ppo import PPOModule, run_ppo
from models.errors import ConfigError
from models.generation import generate, left_pad
from models.heads import ScalarModel, save_scalar_model
from models.model import ModelConfig, Transformer
from tests.alignment.compiled_decode import run_checked
from tests.alignment.conftest import TINY
from tests.helpers import run_cli
from trainer.config import load_config

ROOT = Path(__file__).resolve().parents[2]

# ---- the math, by hand ----


def test_gae_against_hand_computed_values():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.5, 2.0, 0.0]])
    values = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 9.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    gamma, lam = 0.9, 0.8
    advantages, returns = gae(rewards, values, mask, gamma, lam)
    # row 0: deltas d2 = 1 - 0.3, d1 = 0 + .9*.3 - .2, d0 = 0 + .9*.2 - .1
    d2, d1, d0 = 0.7, 0.07, 0.08
    a2 = d2
    a1 = d1 + gamma * lam * a2
    a0 = d0 + gamma * lam * a1
    # row 1 ends at t=1: the masked position neither bootstraps (its value 9.0 is ignored) nor gets advantage
    e1 = 2.0 - 0.5
    e0 = 0.5 + gamma * 0.5 - 0.4 + gamma * lam * e1
    expected = torch.tensor([[a0, a1, a2], [e0, e1, 0.0]])
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, (expected + values) * mask)


def test_gae_skips_an_episodes_observation_tokens_as_if_they_were_not_in_the_row():
    """A tool episode's mask has gaps (the environment's tokens): GAE over the row is GAE over the policy's tokens
    alone, side by side; the positions in a gap get no advantage or return, and their values are never read."""
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    rewards, values = torch.randn(2, 7) * mask, torch.randn(2, 7)
    advantages, returns = gae(rewards, values, mask, 0.9, 0.8)
    for row in range(2):
        on = mask[row]
        alone = gae(rewards[row, on][None], values[row, on][None], torch.ones(1, int(on.sum()), dtype=torch.bool), 0.9, 0.8)  # fmt: skip
        torch.testing.assert_close(advantages[row, on], alone[0][0])
        torch.testing.assert_close(returns[row, on], alone[1][0])
        assert not advantages[row, ~on].any() and not returns[row, ~on].any()
    elsewhere = torch.where(mask, values, torch.full_like(values, 1e6))
    assert torch.equal(gae(rewards, elsewhere, mask, 0.9, 0.8)[0], advantages)


def test_policy_loss_on_fixed_tensors():
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.0]]))  # ratios 1.5, 0.5, 1.0 (old logp 0)
    old = torch.zeros(1, 3)
    advantages = torch.tensor([[1.0, -2.0, 3.0]])
    mask = torch.tensor([[True, True, False]])
    loss, stats = ppo_policy_loss(logp, old, advantages, mask, clip_ratio=0.2, token_count=torch.tensor(2.0))
    # token 0: max(-1*1.5, -1*1.2) = -1.2; token 1: max(2*0.5, 2*0.8) = 1.6; token 2 masked
    assert loss.item() == pytest.approx((-1.2 + 1.6) / 2)
    assert stats["clip_fraction"].item() == 2
    assert stats["approx_kl"].item() == pytest.approx(0.5 * (math.log(1.5) ** 2 + math.log(0.5) ** 2))


def test_policy_loss_weights_give_each_sequence_the_same_weight():
    """At ratio 1 the surrogate is -advantage per token: a token mean lets the 3-token response outvote the
    1-token one; weights of 1 / length with the sequence count as the divisor give the per-sequence mean."""
    logp = torch.zeros(2, 3)
    advantages = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[True, False, False], [True, True, True]])
    token_mean, _ = ppo_policy_loss(logp, logp, advantages, mask, clip_ratio=0.2, token_count=torch.tensor(4.0))
    assert token_mean.item() == pytest.approx((-1 + 3) / 4)
    weights = mask / mask.sum(1, keepdim=True)
    sequence_mean, _ = ppo_policy_loss(logp, logp, advantages, mask, 0.2, torch.tensor(2.0), weights)
    assert sequence_mean.item() == pytest.approx(0.0, abs=1e-6)


def test_value_loss_on_fixed_tensors():
    values = torch.tensor([[1.0, 0.0]])
    old = torch.tensor([[0.5, 0.5]])
    returns = torch.tensor([[0.0, 1.0]])
    mask = torch.tensor([[True, True]])
    loss = ppo_value_loss(values, old, returns, mask, clip_value=0.2, token_count=torch.tensor(2.0))
    # token 0: clipped value 0.7: max(1.0, 0.49) = 1.0; token 1: clipped 0.3: max(1.0, 0.49) = 1.0
    assert loss.item() == pytest.approx(0.5 * (1.0 + 1.0) / 2)
    values = torch.tensor([[0.45, 0.55]])  # inside the clip range: plain squared error
    loss = ppo_value_loss(values, old, returns, mask, clip_value=0.2, token_count=torch.tensor(2.0))
    assert loss.item() == pytest.approx(0.5 * (0.45**2 + 0.45**2) / 2)


def test_kl_estimators_and_token_rewards():
    logp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([[0.5, -1.0]]))
    k3 = kl_penalty(logp, ref, "k3")
    expected = [math.exp(r) - 1 - r for r in (-0.5, 1.0)]  # r = ref - logp
    torch.testing.assert_close(k3, torch.tensor([expected]))
    assert (k3 >= 0).all()
    mask = torch.tensor([[True, True, False]])
    rewards = token_rewards(torch.tensor([2.0]), torch.tensor([[0.5, 1.0, 7.0]]), mask, kl_coef=0.1)
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, -0.1 + 2.0, 0.0]]))


def test_whitening_uses_valid_tokens_only_and_does_not_add_the_mean_back():
    values = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[True, True, True, False]])
    white = masked_whiten(values, mask)
    valid = white[mask]
    assert valid.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert valid.var(unbiased=False).item() == pytest.approx(1.0, abs=1e-4)
    assert white[0, 3].item() == 0.0  # padding stays 0 and never shifted the statistics
    kept_mean = masked_whiten(values, mask, shift_mean=False)[mask]
    assert kept_mean.mean().item() == pytest.approx(2.0, abs=1e-5)


def test_adaptive_kl_controller():
    fixed = KLController(0.1)
    fixed.update(100.0, 64)
    assert fixed.value == 0.1
    adaptive = KLController(0.1, adaptive=True, target=6.0, horizon=1000)
    adaptive.update(12.0, 100)  # twice the target: error clipped to +0.2
    assert adaptive.value == pytest.approx(0.1 * (1 + 0.2 * 100 / 1000))
    restored = KLController(0.5, adaptive=True, target=6.0, horizon=1000)
    restored.load_state_dict(adaptive.state_dict())
    assert restored.value == adaptive.value


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    assert explained_variance(torch.full((1, 4), 2.5), returns, mask).item() == pytest.approx(0.0, abs=1e-6)


def test_logprobs_and_entropy_use_temperature():
    logits = torch.tensor([[[2.0, 0.0, -1.0]]])
    logp, entropy = logprobs_and_entropy(logits, torch.tensor([[0]]), temperature=0.5)
    probs = torch.softmax(logits / 0.5, -1)
    assert logp.item() == pytest.approx(math.log(probs[0, 0, 0].item()), rel=1e-5)
    assert entropy.item() == pytest.approx(-(probs * probs.log()).sum().item(), rel=1e-5)


# ---- the silent-bug details, on a tiny model ----


@pytest.fixture
def tiny_policy() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**TINY))
    for p in model.parameters():  # a peakier distribution than the 0.02 init, so comparisons mean something
        if p.ndim == 2:
            nn.init.normal_(p, std=0.1)
    return model


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_training_pass_logprobs_equal_rollout_logprobs_with_left_padding(tiny_policy, temperature):
    """generate()'s KV-cache log-probs = the training pass's recomputation on prompt + response, fp32."""
    prompts = [[1, 17, 99, 4], [5, 6], [7, 8, 9, 10, 11, 12]]  # different lengths: left padding
    out = generate(
        tiny_policy,
        prompts,
        max_new_tokens=6,
        temperature=temperature,
        stop_ids=[3],
        pad_id=0,
        generator=torch.Generator().manual_seed(1),
    )
    prompt_ids, prompt_real = left_pad(prompts, 0)
    input_ids = torch.cat([prompt_ids, out.tokens], 1)
    real = torch.cat([prompt_real, out.mask], 1)
    with torch.no_grad():
        logp, _ = response_logprobs(tiny_policy, input_ids, real, prompt_ids.shape[1], temperature)
    torch.testing.assert_close(logp[out.mask], out.logprobs[out.mask], atol=1e-5, rtol=0)


def test_values_and_scores_are_read_at_the_right_tokens(tiny_policy):
    """A score is read at the last real token (end of turn), never at padding after it; padding content
    after it changes nothing."""
    from models.generation import ids_and_positions
    from models.heads import gather_last

    critic = ScalarModel.from_backbone(tiny_policy)
    sequence = torch.tensor([[0, 0, 5, 6, 7, 8, 2, 0, 0]])  # left pad, prompt, response ending in 2, right pad
    real = torch.tensor([[False, False, True, True, True, True, True, False, False]])
    other_padding = sequence.clone()
    other_padding[0, 7:] = 1234
    with torch.no_grad():
        scores = [
            gather_last(
                critic(s, document_ids=ids_and_positions(real)[0], position_ids=ids_and_positions(real)[1]), real
            )
            for s in (sequence, other_padding)
        ]
        values = response_values(critic, sequence, real, prompt_len=4)
        full = critic(sequence, document_ids=ids_and_positions(real)[0], position_ids=ids_and_positions(real)[1])
    assert scores[0].item() == scores[1].item() == full[0, 6].item()
    torch.testing.assert_close(values, full[:, 3:-1])  # response token j is valued at position P + j - 1


def test_no_dropout_anywhere(tiny_policy):
    critic = ScalarModel.from_backbone(tiny_policy)
    assert not any(isinstance(m, nn.Dropout) for model in (tiny_policy, critic) for m in model.modules())


# ---- runs ----


def ppo_config(setup, out_dir, *overrides) -> PPOConfig:
    return load_config(
        PPOConfig,
        ROOT / "configs/ppo/tiny.yaml",
        [
            f"init.policy={setup['policy']}",
            f"init.reward_model={setup['reward']}",
            f"data.train=[{setup['train_prompts']}]",
            f"data.val=[{setup['prompts']}]",
            f"run.out_dir={out_dir}",
            "logger.kind=none",
            *overrides,
        ],
    )


def metrics(run_dir: Path, name: str = "reward.csv") -> dict[str, list[float]]:
    series: dict[str, list[float]] = {}
    with open(run_dir / name, newline="") as handle:
        for row in csv.DictReader(handle):
            series.setdefault(row["metric"], []).append(float(row["value"]))
    return series


def token_count_reward(token: int, response_tokens: int):
    """Toy reward: how many times ``token`` appears in the response."""

    def reward(input_ids, real):
        response = input_ids[:, -response_tokens:]
        return ((response == token) & real[:, -response_tokens:]).sum(1).float()

    return reward


def likeliest_token(setup) -> int:
    """The token with the highest mean probability over the policy's next-token distributions on the prompts
    (a few percent): sampled often enough for PPO to see its reward."""
    from data.demo.tasks import load_jsonl
    from models.formats.checkpoint import load_checkpoint
    from models.generation import ids_and_positions

    policy = load_checkpoint(setup["policy"])
    prompts = [setup["tokenizer"].encode_chat_prompt(r["messages"]) for r in load_jsonl(setup["prompts"])[:16]]
    ids, real = left_pad(prompts, 0)
    document_ids, position_ids = ids_and_positions(real)
    with torch.no_grad():
        probs = policy(ids, document_ids=document_ids, position_ids=position_ids).softmax(-1)[real]
    return int(probs.mean(0).argmax())


def test_toy_reward_rises_while_kl_stays_finite(setup, tmp_path):
    token = likeliest_token(setup)
    config = ppo_config(
        setup,
        tmp_path,
        "trainer.max_steps=14",
        "ppo.rollout_batch_size=16",
        "ppo.minibatch_size=8",
        "ppo.micro_batch_size=8",
        "optim.lr=1e-3",  # 2e-3 overshoots (KL ~60 after one update) and the score collapses at most seeds
        "optim.schedule=cosine",
        "optim.min_lr=1e-6",
        "ppo.epochs=2",
        "ppo.missing_eos_penalty=null",
        "ppo.kl_coef=0.01",
        # a critic copied from the reward model values its score, not this reward's token counts: its advantages
        # were noise the toy learned from only at some seeds; a fresh one learns these returns
        "init.critic=zeros",
        "checkpoint.every_n_steps=100",
        "eval.every_n_rollouts=100",
    )
    run_dir = run_ppo(config, reward_fn=token_count_reward(token, config.ppo.response_max_tokens))
    scores = metrics(run_dir)["ppo/score"]
    assert len(scores) == 14
    # a rollout's score is the mean count over 16 responses (~0.2 at the start, SE of a 3-rollout mean ~0.08): the
    # last three beat the first three by 6 SE; at this seed and seeds 0-3 they rise by 0.86 to 1.6
    assert sum(scores[-3:]) / 3 > sum(scores[:3]) / 3 + 0.5, scores
    kl = metrics(run_dir, "kl.csv")["ppo/kl"]
    assert all(math.isfinite(k) for k in kl) and kl[-1] > 0
    assert (run_dir / "final" / "model.safetensors").is_file()
    for png in ("reward.png", "kl.png", "loss.png"):
        assert (run_dir / png).stat().st_size > 1000


def first_update(setup, tmp_path, monkeypatch, micro_batch: int) -> tuple[dict, dict]:
    """Gradients of the first PPO update and the first rollout's logged statistics."""
    captured: dict = {}
    original = PPOModule.apply_update

    def capture(self, *updates):
        for _, _, module, _, name in updates:
            if name == "policy" and not captured:
                captured.update(
                    {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
                )
        return original(self, *updates)

    monkeypatch.setattr(PPOModule, "apply_update", capture)
    config = ppo_config(
        setup,
        tmp_path,
        "trainer.max_steps=1",
        "ppo.rollout_batch_size=8",
        "ppo.minibatch_size=8",
        f"ppo.micro_batch_size={micro_batch}",
        "ppo.epochs=1",
        "optim.grad_clip=null",
        "eval.every_n_rollouts=100",
        "logger.kind=csv",
    )
    run_dir = run_ppo(config)
    with open(run_dir / "csv" / "metrics.csv", newline="") as handle:
        logged = {
            k: float(v)
            for row in csv.DictReader(handle)
            for k, v in row.items()
            if v not in ("", None) and k.startswith("ppo/")
        }
    return captured, logged


def test_micro_batching_does_not_change_the_update_and_first_ratio_is_one(setup, tmp_path, monkeypatch):
    """micro-batch 1 x 8 = micro-batch 8 x 1 (loss normalised by the minibatch's valid tokens); and the
    first minibatch of a rollout has ratio exactly 1, approx-KL 0 and clip fraction 0."""
    grads_one, logged_one = first_update(setup, tmp_path / "one", monkeypatch, 1)
    grads_eight, logged_eight = first_update(setup, tmp_path / "eight", monkeypatch, 8)
    assert grads_one and grads_one.keys() == grads_eight.keys()
    for name in grads_one:
        torch.testing.assert_close(grads_one[name], grads_eight[name], rtol=1e-4, atol=1e-7, msg=name)
    for logged in (logged_one, logged_eight):
        assert logged["ppo/first_minibatch_max_log_ratio"] == 0.0
        assert logged["ppo/first_minibatch_approx_kl"] == 0.0
        assert logged["ppo/first_minibatch_clip_fraction"] == 0.0


def test_resume_restores_both_optimizers_and_the_kl_controller(setup, tmp_path):
    """4 rollouts straight vs 2 + resume 2 (adaptive KL, so its state matters): same policy and critic."""
    from safetensors.torch import load_file

    common = [
        "trainer.max_steps=4",
        "checkpoint.every_n_steps=2",
        "ppo.kl_adaptive=true",
        "ppo.kl_target=0.01",
        "ppo.kl_horizon=50",
        "eval.every_n_rollouts=100",
    ]
    straight = run_ppo(ppo_config(setup, tmp_path / "straight", *common))

    import lightning as L

    class Crash(Exception):
        pass

    class CrashAfterTwo(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 2:
                raise Crash  # step 2 is complete: AtomicCheckpoint saves it on the way out (on_exception)

    with pytest.raises(Crash):
        run_ppo(ppo_config(setup, tmp_path / "resumed", *common), extra_callbacks=[CrashAfterTwo()])
    checkpoint = torch.load(tmp_path / "resumed/ppo-tiny/checkpoints/step-00000002.ckpt", weights_only=True)
    assert checkpoint["ppo"]["kl_controller"]["value"] != 0.05  # the adaptive controller moved
    # the sampling state (rollouts at temperature 1 and minibatch order) is saved from the device that samples
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert checkpoint["rl"]["sampler_device"] == device and checkpoint["rl"]["sampler"].dtype == torch.uint8
    assert len(checkpoint["optimizer_states"]) == 2 and len(checkpoint["lr_schedulers"]) == 2
    resumed = run_ppo(ppo_config(setup, tmp_path / "resumed", *common))
    a, b = load_file(straight / "final/model.safetensors"), load_file(resumed / "final/model.safetensors")
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0, msg=name)
    kl_a, kl_b = metrics(straight, "kl.csv")["ppo/kl"], metrics(resumed, "kl.csv")["ppo/kl"]
    assert kl_a[-1] == pytest.approx(kl_b[-1], abs=1e-6)


def test_reward_model_with_another_vocab_is_refused_before_compute(setup, tmp_path):
    other = ScalarModel(ModelConfig(**{**TINY, "vocab_size": 5000}))
    other_dir = save_scalar_model(other, tmp_path / "rm-other")
    config = ppo_config(setup, tmp_path, f"init.reward_model={other_dir}")
    with pytest.raises(ConfigError, match="vocab_size 5000"):
        run_ppo(config)
    assert not (tmp_path / "ppo-tiny" / "checkpoints").exists()


def test_bad_batch_sizes_are_config_errors(setup, tmp_path):
    with pytest.raises(ConfigError, match="ppo.rollout_batch_size"):
        run_ppo(ppo_config(setup, tmp_path, "ppo.minibatch_size=3"))


def test_an_adaptive_kl_without_a_target_is_refused_where_the_config_loads(setup, tmp_path):
    with pytest.raises(ConfigError, match="ppo.kl_adaptive needs a ppo.kl_target"):
        ppo_config(setup, tmp_path, "ppo.kl_adaptive=true", "ppo.kl_target=null")


def test_too_long_prompts_are_truncated_or_dropped_and_counted(setup, tmp_path):
    from data.records.prompts import PromptDataModule

    config = ppo_config(setup, tmp_path, "data.max_prompt_tokens=40").data
    truncate = PromptDataModule(config, batch_size=2)
    truncate.setup()
    assert truncate.stats["train"]["truncated"] > 0
    assert all(len(p["prompt_ids"]) <= 40 for p in truncate.train_prompts + truncate.val_prompts)
    assert all(p["prompt_ids"][-3:] == setup["tokenizer"].encode_chat_prompt([])[-3:] for p in truncate.train_prompts)
    config.too_long = "drop"
    drop = PromptDataModule(config, batch_size=2)
    drop.setup()
    assert drop.stats["train"]["dropped_too_long"] == truncate.stats["train"]["truncated"]
    assert all(len(p["prompt_ids"]) <= 40 for p in drop.train_prompts + drop.val_prompts)
    config.max_prompt_tokens = 5
    with pytest.raises(ValueError, match="no usable prompts"):
        PromptDataModule(config, batch_size=2).setup()


@pytest.mark.slow
# ---- devices: the sampler and the frozen models ----


class DeviceChecked(nn.Module):
    """Wraps a frozen model: every tensor it receives must be on its own device (issue 10: a CPU reference fed
    CUDA ids). Counts calls so the test knows the check ran."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, *args, **kwargs):
        device = next(self.inner.parameters()).device
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor):
                assert value.device == device, f"input on {value.device}, frozen model on {device}"
        self.calls += 1
        return self.inner(*args, **kwargs)


def run_with_device_checks(setup, tmp_path, monkeypatch, *overrides) -> dict:
    """One PPO rollout + update with the frozen models wrapped in DeviceChecked; returns what was observed."""
    import lightning as L

    seen: dict = {"reference_logp": [], "scores": []}
    original_reference, original_scores = PPOModule.reference_logprobs, PPOModule.score

    def reference_logp(self, *args):
        out = original_reference(self, *args)
        seen["reference_logp"].append((out.device, out.dtype, self.device))
        return out

    def scores(self, *args):
        out = original_scores(self, *args)
        seen["scores"].append((out[0].device, self.device))
        return out

    monkeypatch.setattr(PPOModule, "reference_logprobs", reference_logp)
    monkeypatch.setattr(PPOModule, "score", scores)

    class Wrap(L.Callback):
        def on_train_start(self, trainer, module):  # after the module's on_fit_start placed the frozen models
            scorer = module.reward.models[0]  # the frozen reward model lives in the stage's reward
            frozen = {**module.frozen, "reward": scorer.model}
            seen["frozen_devices"] = {name: next(m.parameters()).device for name, m in frozen.items()}
            seen["sampler_device"] = module.sampler.device
            module.frozen = {name: DeviceChecked(m) for name, m in module.frozen.items()}
            scorer.model = DeviceChecked(scorer.model)
            seen["wrapped"] = {**module.frozen, "reward": scorer.model}

    config = ppo_config(
        setup,
        tmp_path,
        "trainer.max_steps=1",
        "ppo.epochs=2",
        "eval.every_n_rollouts=100",
        "eval.generations=2",
        *overrides,
    )
    run_ppo(config, extra_callbacks=[Wrap()])
    return seen


def test_frozen_models_on_cpu_get_inputs_on_their_device(setup, tmp_path, monkeypatch):
    """ppo.frozen_device=cpu (bf16): the reference and reward model receive inputs on their own device, and
    their results come back on the policy's device in fp32. On a CUDA machine (accelerator auto) this is the
    real CPU/GPU split of issue 10."""
    seen = run_with_device_checks(setup, tmp_path, monkeypatch, "ppo.frozen_device=cpu", "ppo.frozen_dtype=bfloat16")
    assert all(device.type == "cpu" for device in seen["frozen_devices"].values())
    assert all(m.calls > 0 for m in seen["wrapped"].values())
    assert seen["reference_logp"] and all(
        out == policy and dtype == torch.float32 for out, dtype, policy in seen["reference_logp"]
    )
    assert seen["scores"] and all(out == policy for out, policy in seen["scores"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("frozen_device", ["same", "cpu"])
def test_ppo_rollout_and_update_run_on_cuda(setup, tmp_path, monkeypatch, frozen_device):
    """Issue 10 on the GPU: sampling (temperature 1) with a CUDA generator, randperm minibatches on it, and the
    frozen models on the GPU or the CPU."""
    seen = run_with_device_checks(
        setup, tmp_path, monkeypatch, "trainer.accelerator=gpu", f"ppo.frozen_device={frozen_device}"
    )
    assert seen["sampler_device"].type == "cuda"
    expected = "cpu" if frozen_device == "cpu" else "cuda"
    assert all(device.type == expected for device in seen["frozen_devices"].values())
    assert all(out.type == "cuda" for out, _, _ in seen["reference_logp"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_ppo_rollout_with_compiled_generation_on_cuda(setup, tmp_path, monkeypatch):
    """trainer.compile=true: rollouts decode with the static cache and a CUDA-graph decode step."""
    seen = run_with_device_checks(setup, tmp_path, monkeypatch, "trainer.accelerator=gpu", "trainer.compile=true")
    assert seen["sampler_device"].type == "cuda" and seen["reference_logp"]


@pytest.mark.slow
def test_fsdp_compiled_blocks_rollouts_decode_compiled_as_eager(setup, tmp_path):
    """Issue 22: FSDP2 + torch.compile + activation checkpointing on 2 gloo processes, rollouts and held-out answers
    decoded by the compiled static decode step (made the CPU's ``auto`` by tests/alignment/compiled_decode.py). The
    fullgraph trace used to stop at the FSDP2-wrapped compiled blocks (``Unsupported: Attempted to inline function
    marked as skipped ... OptimizedModule.__call__``) at the first generation; now every rank's every generate call
    gives the eager decode's greedy tokens. Generation gathers the weights once and the losses are reduced over ranks:
    the first rollout's score equals a single process's over the same prompts (the same global batch)."""
    common = [
        str(ROOT / "configs/ppo/tiny.yaml"), "run.name=run", f"init.policy={setup['policy']}",
        f"init.reward_model={setup['reward']}", f"data.train=[{setup['train_prompts']}]",
        f"data.val=[{setup['prompts']}]", "logger.kind=csv", "trainer.accelerator=cpu", "trainer.max_steps=2",
        "eval.every_n_rollouts=2", "eval.generations=4", "ppo.epochs=1",
        "ppo.temperature=0",  # greedy rollouts: the same responses whatever the rank layout
    ]  # fmt: skip
    records = run_checked(
        "ppo", *common, f"run.out_dir={tmp_path / 'fsdp'}", "trainer.strategy=fsdp", "trainer.devices=2",
        "trainer.compile=true", "trainer.activation_checkpointing=full", "ppo.rollout_batch_size=4",
        "ppo.minibatch_size=2", "ppo.micro_batch_size=2", log=tmp_path / "decode.jsonl",
    )  # fmt: skip
    run_cli("ppo", *common, f"run.out_dir={tmp_path / 'single'}", "ppo.rollout_batch_size=8", "ppo.minibatch_size=4")
    for name in ("fsdp", "single"):
        assert (tmp_path / name / "run" / "final" / "model.safetensors").is_file()
        assert (tmp_path / name / "run" / "eval.png").is_file()
    first_score = {name: metrics(tmp_path / name / "run")["ppo/score"][0] for name in ("fsdp", "single")}
    assert first_score["fsdp"] == pytest.approx(first_score["single"], abs=1e-4)
    assert {r["rank"] for r in records} == {0, 1}
    rollouts = [r for r in records if r["rows"] == 4]  # (the held-out answers: 2 per rank)
    assert len(rollouts) == 4 and all(r["compiled_steps"] > 0 for r in records)
    assert all(r["tokens_equal"] and r["mask_equal"] for r in records), records
    assert max(r["max_logprob_difference"] for r in records) < 1e-4


def test_ppo_over_tool_episodes_trains_on_the_policys_turns_and_bootstraps_across_observations(
    setup, tmp_path, monkeypatch, turns_that_end
):
    """``episodes.environment`` with LoRA: each rollout row is a two-turn episode with the environment's turn
    inside; the mask, the rewards' KL and the advantages are on the policy's tokens alone, the turns are logged, the
    W&B samples table shows each episode's transcript after its prompt, and the run ends with a final model."""
    from trainer.loggers import HistoryCSVLogger

    rollouts, tables = [], []
    real_update = PPOModule.update

    def update(self, rollout):
        rollouts.append(rollout)
        return real_update(self, rollout)

    monkeypatch.setattr(PPOModule, "update", update)
    monkeypatch.setattr(HistoryCSVLogger, "log_table", lambda self, **table: tables.append(table), raising=False)
    episodes = [
        "episodes.environment=tests.alignment.conftest:AskAgain", "episodes.max_turns=2", "episodes.max_tokens=256",
    ]  # fmt: skip
    config = ppo_config(
        setup, tmp_path, *episodes, "trainer.max_steps=2", "ppo.rollout_batch_size=4", "ppo.minibatch_size=4",
        "ppo.micro_batch_size=2", "logger.kind=csv", "checkpoint.every_n_steps=100", "eval.every_n_rollouts=100",
        "eval.pass_k=0", "eval.generations=2", "peft.kind=lora", "peft.rank=4",
    )  # fmt: skip
    run_dir = run_ppo(config)
    for rollout in rollouts:
        for row in rollout.mask:  # policy tokens, then the user's turn (context), then policy tokens again
            on = row.nonzero().flatten()
            assert (on.diff() > 1).sum() == 1, row
        assert not (rollout.advantages * ~rollout.mask).any() and not (rollout.returns * ~rollout.mask).any()
    with open(run_dir / "csv" / "metrics.csv", newline="") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("ppo/turns")]
    assert len(rows) == 2 and all(float(row["ppo/turns"]) == 2 for row in rows)
    assert [table["key"] for table in tables] == ["ppo/samples", "ppo/samples"]
    assert tables[0]["columns"] == ["rollout", "prompt", "response", "score"]
    for _, _, response, _ in tables[0]["data"]:  # the environment's user turn inside the response, as context
        assert "Once more, briefly." in response or "Again, in other words." in response
    assert (run_dir / "final" / "model.safetensors").is_file()
