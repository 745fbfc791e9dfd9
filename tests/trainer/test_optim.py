import math

import pytest

from models.model import ModelConfig, Transformer
from trainer.optim import build_optimizer, parameter_groups, warmup_cosine


def test_weight_decay_only_on_matrices():
    model = Transformer(ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=50, multiple_of=16, tie_embeddings=True))
    decay, no_decay = parameter_groups(model, 0.1)
    decayed = {id(p) for p in decay["params"]}
    names = {name for name, p in model.named_parameters() if id(p) in decayed}
    assert all(
        name.endswith(("wq.weight", "wk.weight", "wv.weight", "wo.weight", "w1.weight", "w2.weight", "w3.weight"))
        for name in names
    )
    assert id(model.tok_embeddings.weight) not in decayed and id(model.norm.weight) not in decayed
    # tied embeddings are counted once
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    all_decay, _ = parameter_groups(model, 0.1, decay_embeddings_and_norms=True)
    assert len(all_decay["params"]) == len(list(model.parameters()))


def test_warmup_then_cosine_to_min_lr():
    kwargs = dict(warmup_steps=10, max_steps=110, lr=1.0, min_lr=0.1)
    assert warmup_cosine(0, **kwargs) == pytest.approx(0.1)
    assert warmup_cosine(9, **kwargs) == pytest.approx(1.0)
    assert warmup_cosine(10, **kwargs) == pytest.approx(1.0)
    assert warmup_cosine(60, **kwargs) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert warmup_cosine(110, **kwargs) == pytest.approx(0.1)
    assert warmup_cosine(500, **kwargs) == pytest.approx(0.1)
    values = [warmup_cosine(s, **kwargs) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_scheduler_follows_the_schedule():
    model = Transformer(ModelConfig(dim=32, n_layers=1, n_heads=4, vocab_size=50, multiple_of=16))
    optimizer, schedule = build_optimizer(
        model, lr=1e-3, min_lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, warmup_steps=4, max_steps=20
    )
    lrs = []
    for _ in range(20):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    expected = [warmup_cosine(s, warmup_steps=4, max_steps=20, lr=1e-3, min_lr=1e-4) for s in range(20)]
    assert lrs == pytest.approx(expected)
    assert optimizer.param_groups[1]["weight_decay"] == 0.0
