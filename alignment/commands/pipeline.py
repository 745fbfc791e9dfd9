"""The whole recipe in one command: prepare → pretrain → SFT → reward model → PPO (and/or GRPO, DPO, rejection
sampling, each from the SFT model), then a report that evaluates every model on the same held-out prompts.

Each stage is the ordinary stage (``run_pretrain``, ``run_sft``, ...) on its own preset plus overrides; the
pipeline only appends the wiring overrides (folders, the previous stage's ``final/``, the demo data, one shared
logger in one W&B group per pipeline run: ``alignment/commands/pipeline_tracking.py``) after the stage's own ones,
so the pipeline always wins on wiring and the user on everything else.

Re-runs are incremental. A finished stage leaves ``pipeline_stage.json`` holding a hash of its fully resolved
config and of its inputs' hashes, so the hashes chain: an unchanged stage is skipped, a changed one re-runs
from scratch (its old folder moved to ``<stage>.previous``) and so does everything after it. A stage that was
interrupted (``pipeline_stage.pending.json`` with the same hash, no record) resumes from its own checkpoints.

This module owns the pipeline's config and running it: each stage's config and wiring, where its inputs come
from, skipping, resuming or re-training it, and the summary printed at the end. The records and hashes those
decisions read are ``alignment/commands/pipeline_records.py``; ``report.md`` is written by ``alignment/commands/pipeline_report.py``.
"""

from __future__ import annotations

import functools
import json
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from alignment.commands.pipeline_records import (
    PENDING,
    RECORD,
    data_hash,
    older_pipeline,
    read_json,
    stage_state,
    write_record,
)
from alignment.commands.pipeline_report import write_report
from alignment.commands.pipeline_tracking import PipelineTracking, track_report, wandb_run_lines
from alignment.schemas.dpo import DPOConfig
from alignment.schemas.pretrain import PretrainConfig
from alignment.schemas.rejection_sampling import RejectionSamplingConfig
from alignment.schemas.reward import RMConfig
from alignment.schemas.rl import GRPOConfig, PPOConfig
from alignment.schemas.sft import SFTConfig
from alignment.shared.evaluation import check_disjoint
from alignment.stages.dpo import run_dpo
from alignment.stages.grpo import run_grpo
from alignment.stages.ppo import run_ppo
from alignment.stages.pretrain import run_pretrain
from alignment.stages.rejection_sampling import run_rejection_sampling
from alignment.stages.reward import run_rm
from alignment.stages.sft import run_sft
from data.demo.tasks import write_demo_dataset
from data.pretrain.prepare import prepare
from data.records.prompts import PromptDataConfig, load_prompts
from data.tokenizer.tokenizer import Tokenizer
from models.adapter_config import PeftConfig
from models.digests import content_key, folder_fingerprint
from models.errors import ConfigError
from models.folders import claim_folder
from trainer.config import load_config, to_yaml
from trainer.interrupts import checkpoint_note, resume_command, stop_if_received
from trainer.storage import claim_run_directory

log = logging.getLogger("lantern.pipeline")

# the order stages run in; ppo, grpo, dpo and rejection_sampling each start from the SFT model (alternatives to
# compare, any of them alone or all together)
STAGES = ("prepare", "pretrain", "sft", "rm", "ppo", "grpo", "dpo", "rejection_sampling")


@dataclass
class StageSection:
    config: str = ""  # the stage's preset YAML
    overrides: list[str] = field(default_factory=list)  # key=value, applied before the pipeline's wiring


@dataclass
class DemoDataSection:
    n_train: int = 4000
    n_val: int = 400  # the held-out prompts every model is scored on
    n_pairs: int = 2000
    seed: int = 0
    short_share: float = 0.3  # share of short-answer examples (data/demo/examples.py)
    line_count_max: int = 4  # the longest passage line_count asks about (1-9)
    line_count_miscount: float = 0.0  # share of line_count SFT demonstrations one too high (imperfect demonstrations)


@dataclass
class PipelineLoggerSection:  # every stage's W&B runs are in one group per pipeline run (pipeline_tracking.py)
    kind: Literal["wandb", "csv", "none"] = "wandb"
    project: str = "lantern"
    mode: Literal["auto", "offline", "online"] = "auto"
    log_model: bool | Literal["off", "final", "all"] = "off"  # every stage's, unless its own overrides say
    system_stats: bool = True


@dataclass
class ReportSection:
    prompts: int = 16  # held-out prompts whose answers by each model are shown in report.md
    max_new_tokens: int = 64  # one token budget for every model's answers
    # the ground truth every model's answers are scored by (alignment/shared/rewards.py); every held-out prompt is used
    checker: str = "data.demo.scoring:score_example"
    max_prompt_tokens: int = 192
    batch_size: int = 64
    pass_k: int = 8  # pass@k of k samples (temperature 1) per prompt, for SFT and the stages after it; 0: off
    pass_k_prompts: int = 0  # held-out prompts the samples (sampled accuracy, pass@k) are drawn on; 0: all
    seed: int = 0  # of the samples behind pass@k and the KL estimates


@dataclass
class PipelineConfig:
    name: str = "pipeline"
    out_dir: str | None = None  # None: runs/pipeline-NAME
    stages: list[str] = field(default_factory=lambda: list(STAGES))
    start_checkpoint: str | None = None  # the model a stage starts from when the stage before it is not run
    seed: int | None = None  # run.seed of every model stage; None: each stage preset's own seed
    demo: DemoDataSection = field(default_factory=DemoDataSection)
    logger: PipelineLoggerSection = field(default_factory=PipelineLoggerSection)
    pretrain: StageSection = field(default_factory=lambda: StageSection("configs/pretrain/tiny.yaml"))
    sft: StageSection = field(default_factory=lambda: StageSection("configs/sft/tiny.yaml"))
    rm: StageSection = field(default_factory=lambda: StageSection("configs/rm/tiny.yaml"))
    ppo: StageSection = field(default_factory=lambda: StageSection("configs/ppo/tiny.yaml"))
    grpo: StageSection = field(default_factory=lambda: StageSection("configs/grpo/tiny.yaml"))
    dpo: StageSection = field(default_factory=lambda: StageSection("configs/dpo/tiny.yaml"))
    rejection_sampling: StageSection = field(
        default_factory=lambda: StageSection("configs/rejection_sampling/tiny.yaml")
    )
    report: ReportSection = field(default_factory=ReportSection)
    # LoRA adapters for every fine-tuning stage (sft, rm, ppo, grpo, dpo, rejection sampling), e.g. peft.kind=lora;
    # a stage's own STAGE.peft.KEY=VALUE wins. Pretraining always trains every weight.
    peft: PeftConfig = field(default_factory=PeftConfig)


# stage -> (schema, {config key: the upstream stage whose final/ it receives})
MODEL_STAGES: dict[str, tuple[type, dict[str, str]]] = {
    "pretrain": (PretrainConfig, {}),
    "sft": (SFTConfig, {"init.checkpoint": "pretrain"}),
    # the reward model's policy_samples (when its preset names a checker) sample the SFT model
    "rm": (RMConfig, {"init.checkpoint": "sft", "policy_samples.policy": "sft"}),
    "ppo": (PPOConfig, {"init.policy": "sft", "init.reward_model": "rm"}),
    "grpo": (GRPOConfig, {"init.policy": "sft"}),
    "dpo": (DPOConfig, {"init.policy": "sft"}),
    "rejection_sampling": (RejectionSamplingConfig, {"init.policy": "sft"}),
}
# RL stages train on the training pool's prompts and evaluate on the val split's (never trained on by any stage)
DEMO_FILES = {
    "sft": {"data.train": "train", "data.val": "val"},
    "rm": {"data.train": "pairs", "policy_samples.prompts": "train_prompts", "policy_samples.heldout": "prompts"},
    "ppo": {"data.train": "train_prompts", "data.val": "prompts"},
    "grpo": {"data.train": "train_prompts", "data.val": "prompts"},
    "dpo": {"data.train": "pairs"},
    "rejection_sampling": {"data.train": "train_prompts", "sft.data.val": "val"},
}


def training_section(config: Any) -> Any:
    """The part of a stage config that holds its trainer and checkpoint sections: rejection sampling's are in its
    embedded SFT section."""
    return getattr(config, "sft", None) if isinstance(config, RejectionSamplingConfig) else config


class Pipeline:
    def __init__(self, config: PipelineConfig) -> None:
        unknown = [s for s in config.stages if s not in STAGES]
        if (
            unknown
            or config.stages != sorted(config.stages, key=STAGES.index)
            or len(set(config.stages)) != len(config.stages)
        ):
            raise ConfigError(f"stages must be a subset of {list(STAGES)} in that order, got {config.stages}")
        self.config = config
        self.root = Path(config.out_dir or f"runs/pipeline-{config.name}")
        self.corpus, self.demo = self.root / "data" / "corpus", self.root / "data" / "demo"
        self.outputs: dict[str, tuple[Path, str]] = {}  # stage -> (final folder or data folder, hash), this run
        self.configs: dict[str, Any] = {}  # stage -> its loaded config
        self.status: dict[str, str] = {}  # stage -> ran | resumed | skipped, for the report
        self.tracking = PipelineTracking(self.root, config.name)  # the W&B group of this pipeline run

    def stage_dir(self, stage: str) -> Path:
        return self.root / "data" if stage == "prepare" else self.root / stage

    def load_stage_config(self, stage: str) -> tuple[Any, dict[str, str]]:
        """The stage's preset + its overrides + the wiring, and the hashes of everything it reads."""
        schema, upstream = MODEL_STAGES["pretrain" if stage == "prepare" else stage]
        section: StageSection = getattr(self.config, "pretrain" if stage == "prepare" else stage)
        logger = self.config.logger
        # rejection sampling trains through its embedded SFT section, which holds its logger and trainer
        nested = "sft." if stage == "rejection_sampling" else ""
        wiring: dict[str, Any] = {
            "run.out_dir": str(self.root), "run.name": stage, f"{nested}logger.kind": logger.kind,
            f"{nested}logger.project": logger.project, f"{nested}logger.mode": logger.mode,
            f"{nested}logger.group": self.tracking.group,
        }  # fmt: skip
        if stage in ("prepare", "pretrain"):
            wiring["data.out_dir"] = str(self.corpus)
        if self.config.seed is not None and stage != "prepare":
            wiring["run.seed"] = self.config.seed
        inputs: dict[str, str] = {}
        for key, source in upstream.items():
            path, inputs[source] = self.upstream(source)
            if path is not None:  # else the preset's own value stays (e.g. a random init)
                wiring[key] = str(path)
        for key, name in DEMO_FILES.get(stage, {}).items():
            wiring[key] = [str(self.demo / f"{name}.jsonl")]
        # the pipeline's peft section comes first, so that the stage's own overrides win
        adapters = [] if stage in ("prepare", "pretrain") else self.peft_overrides(nested)
        tracked = [f"{nested}logger.{key}={json.dumps(getattr(logger, key))}" for key in ("log_model", "system_stats")]
        # JSON values are valid YAML, so paths with odd characters survive load_config's parsing
        overrides = [
            *tracked,
            *adapters,
            *section.overrides,
            *(f"{key}={json.dumps(value)}" for key, value in wiring.items()),
        ]
        config = load_config(schema, section.config, overrides)
        trainer = training_section(config).trainer
        if trainer.strategy != "single":
            # each rank would re-run the whole pipeline and race on its records; run such stages on their own
            raise ConfigError(
                f"{stage}: the pipeline runs single-process stages; got {nested}trainer.strategy={trainer.strategy}"
            )
        for key, source in upstream.items():
            if key not in wiring and (value := functools.reduce(getattr, key.split("."), config)):
                log.info("%s: %s=%s from the preset (no %s output in this pipeline)", stage, key, value, source)
                inputs[source] = folder_fingerprint(Path(value))  # its contents are an input all the same
        if stage != "prepare":
            inputs["data"] = self.upstream("prepare")[1] if stage == "pretrain" else self.demo_hash
        self.configs[stage] = config
        return config, inputs

    def peft_overrides(self, prefix: str) -> list[str]:
        """The pipeline's ``peft`` section as a stage's overrides (none while it is off)."""
        if not self.config.peft.enabled:
            return []
        return [f"{prefix}peft.{key}={json.dumps(value)}" for key, value in asdict(self.config.peft).items()]

    def upstream(self, stage: str) -> tuple[Path | None, str]:
        """Where a stage's input comes from: this run's output, else start_checkpoint (a language model),
        else what an earlier pipeline run left, else nothing."""
        if stage in self.outputs:
            return self.outputs[stage]
        if self.config.start_checkpoint and stage in ("pretrain", "sft"):
            path = Path(self.config.start_checkpoint)
            return path, folder_fingerprint(path)
        if stage == "prepare":
            manifest = read_json(self.corpus / "manifest.json")
            return self.corpus, data_hash(manifest) if manifest else "none"
        record = read_json(self.stage_dir(stage) / RECORD)
        final = self.stage_dir(stage) / "final"
        return (final, record["hash"]) if record and final.is_dir() else (None, "none")

    def write_demo(self, *, only_if_current: bool = False) -> None:
        """The demo data is cheap and idempotent, and every stage after pretraining reads it: always made, and its
        held-out prompts checked against the training prompts before any compute. only_if_current (the scoring
        tools): a folder written with other demo settings is refused, not rewritten under the pipeline's models."""
        arguments = {f.name: getattr(self.config.demo, f.name) for f in fields(DemoDataSection)}
        paths = write_demo_dataset(self.demo, refuse_other_settings=only_if_current, key="out_dir", **arguments)
        self.demo_hash = content_key(paths["manifest"].read_text())
        self.check_heldout_disjoint()

    def run(self) -> None:
        # the pipeline moves, replaces and removes stage folders in out_dir: only in a folder that is its own
        claim_folder(self.root, "pipeline", key="out_dir", adopt=older_pipeline)
        self.write_demo()
        for index, stage in enumerate(self.config.stages, start=1):
            where = f"stage {index}/{len(self.config.stages)}"
            print(f"\n=== pipeline {self.config.name}: {where}: {stage} ===", flush=True)
            start = time.perf_counter()
            try:
                stop_if_received()  # a SIGTERM the stage before finished through: no further stage starts
                self.prepare() if stage == "prepare" else self.model_stage(stage)
            except (KeyboardInterrupt, SystemExit) as stop:  # SIGTERM or Ctrl-C (trainer/interrupts.py)
                # the stage's pending record stays: the same command resumes it from its checkpoints
                note = f"{where} ({stage}) stopped"
                if stage != "prepare":
                    note += f", {checkpoint_note(self.stage_dir(stage) / 'checkpoints')}"
                stop.add_note(note)
                raise
            log.info("%s: %s in %.0fs", stage, self.status[stage], time.perf_counter() - start)

    def check_heldout_disjoint(self) -> None:
        """Before any compute: the held-out prompts every model is scored on share none with the training prompts."""
        tokenizer = Tokenizer.load("default")
        config = PromptDataConfig(max_prompt_tokens=self.config.report.max_prompt_tokens)
        train = load_prompts(config, [str(self.demo / "train_prompts.jsonl")], tokenizer)[0]
        heldout = load_prompts(config, [str(self.demo / "prompts.jsonl")], tokenizer)[0]
        check_disjoint(train, heldout, f"{self.demo / 'prompts.jsonl'}")

    def prepare(self) -> None:
        # prepare() is idempotent with exact change detection (input sha256, tokenizer fingerprint, settings):
        # calling it costs seconds, and the manifest it leaves is the data's identity for the stages after.
        digest = data_hash(prepare(self.load_stage_config("prepare")[0].data))
        record = read_json(self.stage_dir("prepare") / RECORD)
        self.status["prepare"] = "skipped: up to date" if record and record["hash"] == digest else "ran"
        if self.status["prepare"] == "ran":
            write_record(self.stage_dir("prepare"), {"stage": "prepare", "hash": digest})
        self.outputs["prepare"] = (self.corpus, digest)

    def model_stage(self, stage: str) -> None:
        config, inputs = self.load_stage_config(stage)
        digest = content_key(to_yaml(config), inputs)  # before resume is set: not part of it
        run_dir, final = self.stage_dir(stage), self.stage_dir(stage) / "final"
        state = stage_state(run_dir, digest)
        if state == "new" and stage == next(s for s in self.config.stages if s in RUNNERS) and self.tracking.renew():
            return self.model_stage(stage)  # a new pipeline run, in a new W&B group (part of the stage's wiring)
        if state == "up to date":
            self.status[stage] = "skipped: up to date"
        else:
            start = time.perf_counter()
            resume = state == "interrupted"  # same config and inputs: the stage's own resume
            self.train(stage, config, digest, resume)
            if resume and not final.is_dir():
                # the stage's export is the only way a model leaves a run; never record a stage without one
                log.warning("%s: the resumed run exported no final model; training it again from scratch", stage)
                self.train(stage, config, digest, resume=False)
            if not final.is_dir():
                raise RuntimeError(f"{stage} ended without writing {final}")
            write_record(
                run_dir,
                {"stage": stage, "hash": digest, "inputs": inputs, "seconds": round(time.perf_counter() - start, 1)},
            )
            (run_dir / PENDING).unlink(missing_ok=True)
        self.outputs[stage] = (final, digest)

    def train(self, stage: str, config: Any, digest: str, resume: bool) -> None:
        run_dir = self.stage_dir(stage)
        if resume:
            training_section(config).checkpoint.resume, self.status[stage] = "auto", "resumed"  # the stage's own resume
        else:
            # new or changed: never resume another config's checkpoints; keep one backup, not a pile of them. Only
            # this stage's Lantern runs are moved or removed: anything else there is refused, untouched.
            if run_dir.exists():
                claim_run_directory(run_dir, stage)
                backup = run_dir.with_name(f"{stage}.previous")
                if backup.exists():
                    claim_run_directory(backup, stage)
                    shutil.rmtree(backup)
                run_dir.rename(backup)
                log.info("%s: config or inputs changed; moved the old run to %s", stage, backup)
            training_section(config).checkpoint.resume, self.status[stage] = "none", "ran"
        claim_run_directory(run_dir, stage)  # before the pipeline's record is written into it
        self.tracking.save()  # the group this stage's W&B run is in, for its resume and the stages after it
        write_record(run_dir, {"stage": stage, "hash": digest}, name=PENDING)  # "started with this hash"
        RUNNERS[stage](config)


RUNNERS: dict[str, Callable[[Any], Any]] = {
    "pretrain": run_pretrain,
    "sft": run_sft,
    "rm": run_rm,
    "ppo": run_ppo,
    "grpo": run_grpo,
    "dpo": run_dpo,
    "rejection_sampling": run_rejection_sampling,
}


def load_pipeline_config(config_path: str | None, overrides: list[str]) -> PipelineConfig:
    """The pipeline config with its overrides. STAGE.KEY=VALUE (e.g. sft.trainer.max_steps=50) is appended to that
    stage's overrides: one stage setting changes from the command line without restating the preset's list."""
    staged: dict[str, list[str]] = {}
    plain = []
    for item in overrides:
        stage, _, rest = item.partition("=")[0].strip().partition(".")
        if stage in MODEL_STAGES and rest and rest.split(".")[0] not in ("config", "overrides"):
            staged.setdefault(stage, []).append(item.strip()[len(stage) + 1 :])
        else:
            plain.append(item)
    config = load_config(PipelineConfig, config_path, plain)
    for stage, items in staged.items():
        getattr(config, stage).overrides.extend(items)
    return config


def run_pipeline(config_path: str | None, overrides: list[str]) -> Path:
    """Run the configured stages (skipping the up-to-date ones), write OUT_DIR/report.md, print where
    everything is and return OUT_DIR."""
    config = load_pipeline_config(config_path, overrides)
    pipeline = Pipeline(config)
    try:
        pipeline.run()
        stop_if_received()
        report = write_report(pipeline)
        track_report(pipeline)  # its figures into each stage's W&B run, and the report as an artifact
    except (KeyboardInterrupt, SystemExit) as stop:  # SIGTERM or Ctrl-C: the same command carries on from here
        command = resume_command("pipeline", *([config_path] if config_path else []), *overrides)
        stop.add_note(f"run the same command again to resume it (finished stages are skipped): {command}")
        raise
    lines = [f"\npipeline {pipeline.config.name} finished: {pipeline.root}", f"report:      {report}"]
    for stage in pipeline.config.stages:
        if stage != "prepare":
            lines.append(f"{stage + ':':<12} {pipeline.stage_dir(stage) / 'final'}  ({pipeline.status[stage]})")
    print("\n".join(lines + wandb_run_lines(pipeline)), flush=True)
    return pipeline.root
