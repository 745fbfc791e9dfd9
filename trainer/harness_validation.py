"""lm-evaluation-harness tasks scored during training (an ``eval`` section's ``harness_*`` fields): at each validation
of the stages that validate (``HarnessValidation``), and at each held-out evaluation of the RL stages, which find the
scorer with ``harness_of``. Logged as ``val/harness/TASK/METRIC`` (RL: ``eval/harness/...``); lm-eval's numbers of
each evaluation in ``harness/step-NNNNNNN.json`` beside the run, and their curves in ``harness.csv`` and
``harness.png``.

Rank 0 scores the whole model while the other ranks wait for its numbers: FSDP2 weights are gathered once on every
rank (as for validation answers), so rank 0's forwards need no collective. The global RNGs are left as they were, so
a run with harness tasks trains exactly the weights of one without; an evaluation that fails is an error line and a
record, and training goes on.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import lightning as L
import numpy as np
from torch import nn

from data.tokenizer.base import TokenizerBase
from models.errors import one_line
from models.files.atomic import write_atomically
from trainer.callbacks import write_curves
from trainer.config import HarnessEvalConfig
from trainer.harness import LanternLM, evaluate, flat_metrics
from trainer.harness_tasks import load_tasks, resolve_tasks, task_manager
from trainer.lm_module import rng_state, set_rng_state
from trainer.parallel import unsharded_for_generation

log = logging.getLogger(__name__)
RESULTS = ("results", "groups", "group_subtasks", "versions", "n-shot", "higher_is_better", "n-samples")


class HarnessScorer:
    """The tasks of ``config`` (names resolved and data loaded here, before any training) scored on a model; ``key``
    is the config section's path, for messages; ``folder`` keeps each evaluation's numbers (``score``)."""

    def __init__(
        self, config: HarnessEvalConfig, tokenizer: TokenizerBase, *, key: str, folder: Path | None = None
    ) -> None:
        self.config, self.tokenizer, self.key, self.folder = config, tokenizer, key, folder
        self.manager = task_manager(config.harness_include_path, config.harness_tasks, key=f"{key}harness_include_path")
        self.tasks = resolve_tasks(config.harness_tasks, self.manager, key=f"{key}harness_tasks")
        load_tasks(self.tasks, self.manager, key=f"{key}harness_tasks")

    def score(self, model: nn.Module, trainer: L.Trainer, step: int) -> dict[str, float]:
        """``TASK/METRIC`` -> value (standard errors as ``METRIC_stderr``), the same on every rank; call on all. An
        evaluation that fails is logged and recorded, and training goes on: it costs its numbers, never the run."""
        metrics: dict[str, float] | None = None
        with unsharded_for_generation(model):
            if trainer.is_global_zero:
                try:
                    results = self.results(model)
                    metrics = flat_metrics(results)
                except Exception as error:
                    problem = f"{type(error).__name__}: {one_line(error)}"
                    log.error("%sharness_tasks at step %d failed (%s); training goes on", self.key, step, problem)
                    results, metrics = {"error": problem}, {}
                if self.folder is not None:
                    self._record(results, step)
        if trainer.world_size > 1:
            metrics = trainer.strategy.broadcast(metrics, src=0)
        return metrics

    def results(self, model: nn.Module) -> dict:
        """lm-eval's results of the tasks on ``model`` (whole on this process), which is left in the mode it was in,
        and the global RNGs as they were (lm-eval seeds them)."""
        was_training, state, numpy_state = model.training, rng_state(), np.random.get_state()
        config = self.config
        try:
            lm = LanternLM(model, self.tokenizer, batch_size=config.harness_batch_size)  # in eval mode
            return evaluate(
                lm, self.tasks, self.manager, num_fewshot=config.harness_num_fewshot, limit=config.harness_limit,
                apply_chat_template=config.harness_apply_chat_template,
                confirm_run_unsafe_code=config.harness_confirm_run_unsafe_code,
            )  # fmt: skip
        finally:
            model.train(was_training)
            set_rng_state(state)
            np.random.set_state(numpy_state)

    def _record(self, results: dict, step: int) -> None:
        """This evaluation's JSON, then the curves of every evaluation in the folder (a resumed run's too)."""
        record = {"step": step, **{key: results[key] for key in (*RESULTS, "error") if key in results}}
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"step-{step:07d}.json"
        write_atomically(path, json.dumps(record, indent=1, default=str) + "\n", what="harness results")
        history: dict[str, list[tuple[int, float]]] = {}
        for saved in sorted(self.folder.glob("step-*.json")):
            earlier = json.loads(saved.read_text())  # one that failed has no metrics
            for name, value in headline_metrics(earlier).items():
                history.setdefault(name, []).append((earlier["step"], value))
        title = "lm-evaluation-harness during training"
        run_dir = self.folder.parent
        write_curves(history, run_dir / "harness.csv", run_dir / "harness.png", title=title, ylabel="score")


def headline_metrics(results: dict) -> dict[str, float]:
    """Each task's first metric, a perplexity only where the task has nothing else (its scale dwarfs the others):
    what harness.png draws."""
    by_task: dict[str, list[tuple[str, float]]] = {}
    for name, value in flat_metrics(results).items():
        if not name.endswith("_stderr"):
            by_task.setdefault(name.split("/")[0], []).append((name, value))
    return dict(next((m for m in metrics if "perplexity" not in m[0]), metrics[0]) for metrics in by_task.values())


class HarnessValidation(L.Callback):
    """``scorer``'s tasks at the end of every validation but the sanity check, logged under ``val/harness/``."""

    def __init__(self, scorer: HarnessScorer) -> None:
        self.scorer = scorer

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        for name, value in self.scorer.score(pl_module.model, trainer, trainer.global_step).items():
            pl_module.log(f"val/harness/{name}", value, rank_zero_only=True)


def harness_of(trainer: L.Trainer) -> HarnessScorer | None:
    """The run's harness scorer (an RL stage scores it at each held-out evaluation), else None."""
    return next((c.scorer for c in trainer.callbacks if isinstance(c, HarnessValidation)), None)
