"""``optim.name: muon`` (trainer/muon.py, trainer/optim.py): which parameters Muon takes, the combined optimizer equal
to torch's Muon and AdamW built apart, its state dict round trip, one LambdaLR over both, and the DDP argument. No
training runs here: each test builds a one- or two-layer model (a short training run: tests/trainer/test_wsd_branch.py)."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from lightning.fabric.utilities.optimizer import _optimizer_to_device
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from models.adapters import add_adapters
from models.errors import CheckpointError, ConfigError
from models.heads import ScalarModel
from models.model import ModelConfig, Transformer
from models.model_config import PeftConfig
from trainer.config import MuonConfig, OptimConfig
from trainer.muon import MuonWithAdamW, muon_parameters
from trainer.optim import optimizer_from_config, parameter_groups
from trainer.optim_config import scheduled_lr

MATRICES = (
    "attention.wq",
    "attention.wk",
    "attention.wv",
    "attention.wo",
    "feed_forward.w1",
    "feed_forward.w2",
    "feed_forward.w3",
)


def tiny(**changes) -> Transformer:
    torch.manual_seed(0)
    settings = dict(dim=32, n_layers=2, n_heads=4, vocab_size=50, multiple_of=16) | changes
    return Transformer(ModelConfig(**settings))


def names(model: torch.nn.Module, params: list[torch.Tensor]) -> set[str]:
    chosen = {id(p) for p in params}
    return {name for name, p in model.named_parameters() if id(p) in chosen}


def muon_optim(**changes) -> OptimConfig:
    return OptimConfig(name="muon", lr=1e-2, min_lr=1e-3, warmup_steps=2, **changes)


def fake_gradients(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for parameter in model.parameters():
        if parameter.requires_grad:
            parameter.grad = torch.randn(parameter.shape, generator=generator)


@pytest.mark.parametrize("tied", [True, False])
def test_muon_takes_the_block_matrices_and_adamw_the_rest(tied):
    model = tiny(tie_embeddings=tied, qkv_bias=True)
    chosen = names(model, muon_parameters(model))
    assert chosen == {f"layers.{i}.{m}.weight" for i in range(2) for m in MATRICES}  # biases are not matrices
    optimizer, _ = optimizer_from_config(model, muon_optim(), max_steps=10)
    assert isinstance(optimizer, MuonWithAdamW)
    adamw = {name for group in optimizer.adamw.param_groups for name in names(model, group["params"])}
    assert chosen.isdisjoint(adamw)
    assert {"tok_embeddings.weight", "norm.weight", "layers.0.attention.wq.bias"} <= adamw
    assert ("output.weight" in adamw) is not tied  # tied: the embeddings' tensor, listed once
    assert len(chosen | adamw) == len({id(p) for p in model.parameters()})
    # the untied head keeps AdamW's weight decay; the embeddings and norms none
    decay, no_decay = optimizer.adamw.param_groups
    assert names(model, decay["params"]) == (set() if tied else {"output.weight"})
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0


def test_the_split_sees_through_wrappers_and_scalar_heads():
    model = tiny()
    before = names(model, muon_parameters(model))
    model.layers[0] = checkpoint_wrapper(model.layers[0])
    model.layers[1] = torch.compile(model.layers[1], backend="eager")  # not called: no compile happens
    plain = {
        n.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
        for n in names(model, muon_parameters(model))
    }
    assert plain == before
    scalar = ScalarModel.from_backbone(tiny()).freeze_lm_head()
    chosen = names(scalar, muon_parameters(scalar))
    assert len(chosen) == 14 and all(n.startswith("backbone.layers.") for n in chosen)  # not head.proj.weight (1 x dim)


def test_lora_factors_are_never_given_to_muon():
    """Config load refuses muon with LoRA; built anyway, the adapters' factors stay out of Muon and the one line says why."""
    model = add_adapters(tiny(), PeftConfig(kind="lora", rank=4))
    assert muon_parameters(model) == []
    with pytest.raises(ConfigError, match="no trainable transformer-block matrices for Muon.*use optim.name adamw"):
        optimizer_from_config(model, muon_optim(), max_steps=10)


def test_the_combined_step_equals_torch_muon_and_adamw_built_apart():
    optim = muon_optim(muon=MuonConfig(lr=0.02, weight_decay=0.0, adjust_lr_fn="original", nesterov=False, ns_steps=4))
    model, reference = tiny(tie_embeddings=False), tiny(tie_embeddings=False)
    optimizer, schedule = optimizer_from_config(model, optim, max_steps=6)
    matrices = muon_parameters(reference)
    muon = torch.optim.Muon(matrices, lr=0.02, weight_decay=0.0, momentum=0.95, nesterov=False, ns_steps=4,
                            adjust_lr_fn="original")  # fmt: skip
    adamw = torch.optim.AdamW(parameter_groups(reference, 0.1, exclude=matrices), lr=1e-2, betas=(0.9, 0.95),
                              eps=1e-8, fused=True)  # fmt: skip
    for step in range(6):
        factor = scheduled_lr(step, optim, 6) / optim.lr
        for group in adamw.param_groups:
            group["lr"] = 1e-2 * factor
        for group in muon.param_groups:
            group["lr"] = 0.02 * factor
        assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([1e-2 * factor] * 2 + [0.02 * factor]), step
        fake_gradients(model, step)
        fake_gradients(reference, step)
        optimizer.step()
        muon.step()
        adamw.step()
        optimizer.zero_grad()
        schedule.step()
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert optimizer.param_groups[-1]["lr"] == pytest.approx(0.02 * scheduled_lr(6, optim, 6) / optim.lr)


def test_muon_defaults_take_adamws_lr_and_weight_decay():
    optimizer, _ = optimizer_from_config(tiny(), muon_optim(weight_decay=0.05), max_steps=10)
    group = optimizer.muon.param_groups[0]
    assert group["initial_lr"] == 1e-2 and group["weight_decay"] == 0.05
    assert group["adjust_lr_fn"] == "match_rms_adamw" and group["nesterov"] and group["ns_steps"] == 5


def save_and_load(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)  # what a resumed run reads


def test_state_dict_round_trip_gives_an_identical_next_step():
    optim = muon_optim(schedule="wsd", decay_steps=3)
    model = tiny()
    optimizer, schedule = optimizer_from_config(model, optim, max_steps=8)
    for step in range(3):
        fake_gradients(model, step)
        optimizer.step()
        schedule.step()
    saved_model = copy.deepcopy(model.state_dict())
    saved = save_and_load({"optimizer": optimizer.state_dict(), "schedule": schedule.state_dict()})
    assert set(saved["optimizer"]) == {"adamw", "muon"}
    assert {"momentum_buffer"} == {k for s in saved["optimizer"]["muon"]["state"].values() for k in s}

    resumed = tiny()
    resumed.load_state_dict(saved_model)
    again, again_schedule = optimizer_from_config(resumed, optim, max_steps=8)
    again.load_state_dict(saved["optimizer"])
    again_schedule.load_state_dict(saved["schedule"])
    # the loaded groups are the ones this optimizer (and so the scheduler) sees
    assert [id(g) for g in again.param_groups] == [id(g) for o in (again.adamw, again.muon) for g in o.param_groups]
    for step in range(3, 8):
        for m, o, s in ((model, optimizer, schedule), (resumed, again, again_schedule)):
            fake_gradients(m, step)
            o.step()
            s.step()
        assert [g["lr"] for g in again.param_groups] == [g["lr"] for g in optimizer.param_groups]
    for (name, a), b in zip(model.named_parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_state_reads_both_optimizers_and_refuses_an_adamw_state():
    model = tiny()
    optimizer, _ = optimizer_from_config(model, muon_optim(), max_steps=4)
    fake_gradients(model, 0)
    optimizer.step()
    assert len(optimizer.state) == len(list(model.parameters()))  # AdamW's and Muon's, every parameter once
    _optimizer_to_device(optimizer, torch.device("cpu"))  # what Lightning does to it on resume
    assert all(torch.is_tensor(v) for state in optimizer.state.values() for v in state.values())
    adamw, _ = optimizer_from_config(model, OptimConfig(), max_steps=4)
    with pytest.raises(CheckpointError, match="not Muon \\+ AdamW's .*resume with the optim.name it was saved with"):
        optimizer.load_state_dict(adamw.state_dict())
    optimizer.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_a_step_on_the_all_reduced_gradient_equals_the_single_process_step():
    """DDP all-reduces (averages) the gradients before the step, and every rank then steps the whole matrices: a
    rank's Muon step on the average of two halves' gradients equals one process's on the whole batch's."""
    model = tiny()
    ids = torch.randint(0, 50, (4, 12), generator=torch.Generator().manual_seed(1))
    ranks = [copy.deepcopy(model) for _ in range(2)]
    single_optimizer, _ = optimizer_from_config(model, muon_optim(), max_steps=4)
    model(ids).float().logsumexp(-1).mean().backward()
    single_optimizer.step()
    for rank, rows in zip(ranks, (ids[:2], ids[2:])):
        rank(rows).float().logsumexp(-1).mean().backward()
    for a, b in zip(ranks[0].parameters(), ranks[1].parameters()):  # the all-reduce: the mean over ranks
        a.grad = b.grad = (a.grad + b.grad) / 2
    for rank in ranks:
        optimizer, _ = optimizer_from_config(rank, muon_optim(), max_steps=4)
        optimizer.step()
        for (name, a), b in zip(rank.named_parameters(), model.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
