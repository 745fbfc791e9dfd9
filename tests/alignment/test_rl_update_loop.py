"""PPO, GRPO and RLOO step through one update loop (``RLModule.optimise``: epochs, minibatches, micro-batches, the
normaliser, the first-minibatch ratio check, the guarded update). Against the loops each module carried before
(``rl_update_reference.py``), on the same seeds: the same weights bit for bit and the same logged metrics."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors.torch import load_file

from alignment.stages.grpo import GRPOModule, run_grpo
from alignment.stages.ppo import PPOModule, run_ppo
from tests.alignment import rl_update_reference
from tests.alignment.test_grpo import TOY, grpo_config
from tests.alignment.test_ppo import ppo_config

QUIET = ["eval.every_n_rollouts=100", "eval.pass_k=0", "trainer.max_steps=3"]
CASES = {
    # several epochs (a reshuffled order from the sampler), minibatches and micro-batches; the critic warms up first
    "ppo": (run_ppo, ppo_config, PPOModule, rl_update_reference.ppo_update,
            ["ppo.epochs=2", "ppo.minibatch_size=4", "ppo.micro_batch_size=2", "ppo.critic_warmup_rollouts=1"]),
    "grpo": (run_grpo, grpo_config, GRPOModule, rl_update_reference.grpo_update,
             [TOY, "grpo.epochs=2", "grpo.minibatch_size=8", "grpo.micro_batch_size=4", "grpo.kl_coef=0.1",
              "grpo.entropy_coef=0.01"]),
    # one update a rollout (its own forward gives the sampling log-probs), each response weighted alike
    "rloo": (run_grpo, grpo_config, GRPOModule, rl_update_reference.grpo_update,
             [TOY, "grpo.baseline=rloo", "grpo.minibatch_size=16", "grpo.micro_batch_size=8",
              "grpo.loss_aggregation=sequence"]),
}  # fmt: skip


def logged(run_dir: Path) -> dict[str, list[str]]:
    """The rows of every curve the run wrote (losses, rewards, KL, held-out scores) but the timings, which differ
    between any two runs."""
    timings = ("time", "per_second", "generation_share")
    return {
        csv.name: [row for row in csv.read_text().splitlines() if not any(word in row for word in timings)]
        for csv in sorted(run_dir.glob("*.csv"))
    }


class LoggedMetrics(L.Callback):
    """Every metric the module logged at each rollout (statistics of the update included), timings left out."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, *args) -> None:
        timings = ("time", "per_second", "generation_share")
        metrics = {k: float(v) for k, v in trainer.logged_metrics.items() if not any(w in k for w in timings)}
        self.rows.append(metrics)


@pytest.mark.parametrize("case", CASES)
def test_the_shared_loop_trains_the_weights_the_algorithms_own_loops_trained(setup, tmp_path, monkeypatch, case):
    run, config_of, module, reference_update, overrides = CASES[case]
    ours_logged, theirs_logged = LoggedMetrics(), LoggedMetrics()
    ours = run(config_of(setup, tmp_path / "ours", *QUIET, *overrides), [ours_logged])
    monkeypatch.setattr(module, "update", reference_update)
    theirs = run(config_of(setup, tmp_path / "theirs", *QUIET, *overrides), [theirs_logged])
    a, b = load_file(ours / "final/model.safetensors"), load_file(theirs / "final/model.safetensors")
    assert a.keys() == b.keys()
    changed = [name for name in a if not torch.equal(a[name], b[name])]
    assert not changed, f"weights differ: {changed[:5]}"
    curves = logged(ours)
    assert {"metrics.csv", "reward.csv", "kl.csv", "eval.csv"} <= curves.keys()
    assert curves == logged(theirs)
    assert len(ours_logged.rows) == 3 and any(
        name.endswith("first_minibatch_max_log_ratio") for name in ours_logged.rows[0]
    )
    assert ours_logged.rows == theirs_logged.rows
