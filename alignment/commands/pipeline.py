"""The whole recipe in one command: prepare, then the registry's stages in order, then a report that evaluates every
model on the same held-out prompts.

Each stage is the ordinary stage on its own preset plus overrides; the pipeline appends the wiring overrides (folders,
the previous stage's ``final/``, the demo data, one W&B group per pipeline run) after the stage's own, so the pipeline
wins on wiring and the user on everything else. Re-runs are incremental: a stage whose resolved config and inputs
hash as before is skipped, an interrupted one resumes, a changed one re-runs from scratch with everything after it.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from dataclasses import asdict, dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import Any, Literal

from alignment.commands.pipeline_records import (
    PENDING,
    RECORD,
    data_hash,
    move_aside,
    older_pipeline,
    read_json,
    stage_state,
    write_record,
)
from alignment.commands.pipeline_report import write_report
from alignment.commands.pipeline_tracking import PipelineTracking, track_report, wandb_run_lines
from alignment.schemas.rl import EpisodeConfig
from alignment.shared.episodes import load_environment
from alignment.shared.evaluation import check_disjoint
from alignment.shared.tools import CALCULATOR
from alignment.stages import registry
from data.demo.arithmetic import OPERATIONS, write_arithmetic_dataset
from data.demo.tasks import write_demo_dataset
from data.pretrain.mixture import MIXTURE_RECORD, prepare_data
from data.records.prompts import PromptDataConfig, load_prompts
from data.tokenizer.tokenizer import Tokenizer
from models.config_checks import bounded
from models.errors import ConfigError
from models.files.digests import content_key, folder_fingerprint
from models.files.folders import claim_folder, lock_folder, release_folder
from models.model_config import PeftConfig
from trainer.config import HarnessEvalConfig, load_config, to_yaml
from trainer.interrupts import checkpoint_note, resume_command, stop_if_received
from trainer.storage import claim_run_directory

log = logging.getLogger("lantern.pipeline")

PREPARE = "prepare"  # the pipeline's data step, before the registry's stages


def pipeline_steps() -> tuple[str, ...]:
    """What a pipeline runs, in order: prepare, then every stage (ppo, grpo, dpo and rejection_sampling each start
    from the SFT model: alternatives to compare, any of them alone or all together)."""
    return (PREPARE, *(stage.name for stage in registry.STAGES))


def corpus_stage() -> registry.Stage:
    """The stage the prepared corpus is for (pretraining): ``prepare`` reads its config and section."""
    return next(stage for stage in registry.STAGES if stage.corpus_key)


@dataclass
class StageSection:
    config: str = ""  # the stage's preset YAML
    overrides: list[str] = field(default_factory=list)  # key=value, applied before the pipeline's wiring


@dataclass
class DemoDataSection:
    # shakespeare: the corpus tasks (data/demo/tasks.py); arithmetic: sums with an answer line (data/demo/arithmetic.py)
    kind: Literal["shakespeare", "arithmetic"] = "shakespeare"
    arithmetic_tasks: list[str] = field(default_factory=lambda: list(OPERATIONS))  # kind arithmetic: which ones
    tool_calls: bool = False  # kind arithmetic: SFT's demonstrations call the calculator (docs/tools.md)
    n_train: int = bounded(4000, ge=1)
    n_val: int = bounded(400, ge=1)  # the held-out prompts every model is scored on
    n_pairs: int = bounded(2000, ge=1)
    seed: int = bounded(0, ge=0)
    short_share: float = bounded(0.3, ge=0, le=1)  # share of short-answer examples in the demo data
    line_count_max: int = bounded(4, ge=1, le=9)  # the longest passage line_count asks about (1-9)
    line_count_miscount: float = bounded(
        0.0, ge=0, le=1
    )  # share of line_count SFT demonstrations one too high (imperfect demonstrations)


@dataclass
class PipelineLoggerSection:  # every stage's W&B runs are in one group per pipeline run (pipeline_tracking.py)
    kind: Literal["wandb", "csv", "none"] = "wandb"
    project: str = "lantern"
    mode: Literal["auto", "offline", "online"] = "auto"
    log_model: bool | Literal["off", "final", "all"] = "off"  # every stage's, unless its own overrides say
    system_stats: bool = True


@dataclass
class ReportSection(HarnessEvalConfig):  # harness_tasks: lm-eval tasks every model is also scored on
    prompts: int = bounded(16, ge=0)  # held-out prompts whose answers by each model are shown in report.md
    max_new_tokens: int = bounded(64, ge=1)  # one token budget for every model's answers
    # the ground truth every model's answers are scored by (a checker's import path); every held-out prompt is used
    checker: str = "data.demo.scoring:score_example"
    max_prompt_tokens: int = bounded(192, ge=1)
    batch_size: int = bounded(64, ge=1)
    pass_k: int = bounded(
        8, ge=0
    )  # pass@k of k samples (temperature 1) per prompt, for SFT and the stages after it; 0: off
    pass_k_prompts: int = bounded(
        0, ge=0
    )  # held-out prompts the samples (sampled accuracy, pass@k) are drawn on; 0: all
    seed: int = bounded(0, ge=0)  # of the samples behind pass@k and the KL estimates
    # environment set: every model answers in tool episodes (docs/tools.md), max_new_tokens a turn; the report then
    # shows tool calls and malformed calls per episode, and report/transcripts-STAGE.jsonl holds every episode
    episodes: EpisodeConfig = field(default_factory=EpisodeConfig)


def pipeline_schema(stages: tuple[registry.Stage, ...]) -> type:
    """``PipelineConfig`` for these stages: one ``StageSection`` per stage, named as the stage, its preset the
    default."""
    sections = [
        (stage.name, StageSection, field(default_factory=functools.partial(StageSection, stage.preset)))
        for stage in stages
    ]
    schema = make_dataclass(
        "PipelineConfig",
        [
            ("name", str, field(default="pipeline")),
            ("out_dir", str | None, field(default=None)),  # None: runs/pipeline-NAME
            ("stages", list[str], field(default_factory=lambda: [PREPARE, *(stage.name for stage in stages)])),
            # the model a stage starts from when the stage before it is not run
            ("start_checkpoint", str | None, field(default=None)),
            # what the stages after SFT start from: sft (its final/), or start (start_checkpoint, e.g. an instruct
            # model; SFT, if run, is then a control trained from the same start)
            ("align_from", Literal["sft", "start"], field(default="sft")),
            ("seed", int | None, bounded(None, ge=0)),  # run.seed of every model stage; None: each preset's own
            ("demo", DemoDataSection, field(default_factory=DemoDataSection)),
            ("logger", PipelineLoggerSection, field(default_factory=PipelineLoggerSection)),
            *sections,
            ("report", ReportSection, field(default_factory=ReportSection)),
            # LoRA adapters for every fine-tuning stage, e.g. peft.kind=lora; a stage's own STAGE.peft.KEY=VALUE
            # wins. Pretraining always trains every weight.
            ("peft", PeftConfig, field(default_factory=PeftConfig)),
        ],
    )
    schema.__module__ = __name__
    return schema


_pipeline_schema = functools.cache(pipeline_schema)
PipelineConfig = _pipeline_schema(registry.STAGES)  # the pipeline's config with the registry's stages


class Pipeline:
    def __init__(self, config: Any) -> None:
        steps = pipeline_steps()
        unknown = [s for s in config.stages if s not in steps]
        if (
            unknown
            or config.stages != sorted(config.stages, key=steps.index)
            or len(set(config.stages)) != len(config.stages)
        ):
            raise ConfigError(f"stages must be a subset of {list(steps)} in that order, got {config.stages}")
        if config.align_from == "start" and not config.start_checkpoint:
            raise ConfigError("align_from=start: the stages after SFT start from start_checkpoint; give one")
        if config.start_checkpoint and not Path(config.start_checkpoint).is_dir():
            raise ConfigError(f"start_checkpoint: no checkpoint folder at {config.start_checkpoint}")
        load_environment(config.report.episodes.environment, "report.episodes.environment")  # refused before compute
        self.config = config
        self.root = Path(config.out_dir or f"runs/pipeline-{config.name}")
        self.corpus, self.demo = self.root / "data" / "corpus", self.root / "data" / "demo"
        self.outputs: dict[str, tuple[Path, str]] = {}  # stage -> (final folder or data folder, hash), this run
        self.configs: dict[str, Any] = {}  # stage -> its loaded config
        self.status: dict[str, str] = {}  # stage -> ran | resumed | skipped, for the report
        self.tracking = PipelineTracking(self.root, config.name)  # the W&B group of this pipeline run

    def stage_dir(self, stage: str) -> Path:
        return self.root / "data" if stage == PREPARE else self.root / stage

    def load_stage_config(self, stage: str) -> tuple[Any, dict[str, str]]:
        """The stage's preset + its overrides + the wiring, and the hashes of everything it reads (``prepare``: the
        config of the stage the corpus is for)."""
        record = corpus_stage() if stage == PREPARE else registry.stage_named(stage)
        upstream = {} if stage == PREPARE else record.starts_from
        section: StageSection = getattr(self.config, record.name)
        logger = self.config.logger
        nested = record.training_prefix  # where its logger and trainer are
        wiring: dict[str, Any] = {
            "run.out_dir": str(self.root), "run.name": stage, f"{nested}logger.kind": logger.kind,
            f"{nested}logger.project": logger.project, f"{nested}logger.mode": logger.mode,
            f"{nested}logger.group": self.tracking.group,
        }  # fmt: skip
        if record.corpus_key:
            wiring[record.corpus_key] = str(self.corpus)
        if self.config.seed is not None and stage != PREPARE:
            wiring["run.seed"] = self.config.seed
        inputs: dict[str, str] = {}
        for key, source in upstream.items():
            if source == "sft" and self.config.align_from == "start":
                source = "start"  # the model this key reads in this pipeline
            path, inputs[source] = self.upstream(source)
            if path is not None:  # else the preset's own value stays (e.g. a random init)
                wiring[key] = str(path)
        for key, name in ({} if stage == PREPARE else record.demo_files).items():
            wiring[key] = [str(self.demo / f"{name}.jsonl")]
        # the pipeline's peft section comes first, so that the stage's own overrides win
        adapters = self.peft_overrides(nested) if stage != PREPARE and record.trains_adapters() else []
        tracked = [f"{nested}logger.{key}={json.dumps(getattr(logger, key))}" for key in ("log_model", "system_stats")]
        # JSON values are valid YAML, so paths with odd characters survive load_config's parsing
        overrides = [
            *tracked,
            *adapters,
            *section.overrides,
            *(f"{key}={json.dumps(value)}" for key, value in wiring.items()),
        ]
        config = load_config(record.schema, section.config, overrides)
        trainer = record.training_section(config).trainer
        if trainer.strategy != "single":
            # each rank would re-run the whole pipeline and race on its records; run such stages on their own
            raise ConfigError(
                f"{stage}: the pipeline runs single-process stages; got {nested}trainer.strategy={trainer.strategy}"
            )
        for key, source in upstream.items():
            if key not in wiring and (value := functools.reduce(getattr, key.split("."), config)):
                log.info("%s: %s=%s from the preset (no %s output in this pipeline)", stage, key, value, source)
                inputs[source] = folder_fingerprint(Path(value))  # its contents are an input all the same
        if stage != PREPARE:
            inputs["data"] = self.upstream(PREPARE)[1] if record.corpus_key else self.demo_hash
        self.configs[stage] = config
        return config, inputs

    def check_stage_configs(self) -> None:
        """Every stage's config (its preset, overrides and wiring) loaded and checked before the first stage runs,
        each wired to the outputs the stages before it will write, as ``lantern plan`` does: a bad key or value in
        a later stage's overrides is one line before any compute, not after prepare and pretrain have run."""
        outputs, configs = dict(self.outputs), dict(self.configs)
        self.demo_hash = getattr(self, "demo_hash", "check")
        try:
            for stage in self.config.stages:
                self.load_stage_config(stage)
                output = self.corpus if stage == PREPARE else self.stage_dir(stage) / "final"
                self.outputs.setdefault(stage, (output, "check"))
        finally:
            self.outputs, self.configs = outputs, configs

    def peft_overrides(self, prefix: str) -> list[str]:
        """The pipeline's ``peft`` section as a stage's overrides (none while it is off)."""
        if not self.config.peft.enabled:
            return []
        return [f"{prefix}peft.{key}={json.dumps(value)}" for key, value in asdict(self.config.peft).items()]

    def upstream(self, stage: str) -> tuple[Path | None, str]:
        """Where a stage's input comes from: this run's output, else start_checkpoint (a language model; ``start``
        names it alone), else what an earlier pipeline run left, else nothing."""
        if stage in self.outputs:
            return self.outputs[stage]
        if self.config.start_checkpoint and stage in ("pretrain", "sft", "start"):
            path = Path(self.config.start_checkpoint)
            return path, folder_fingerprint(path)
        if stage == PREPARE:
            # one corpus's manifest, or a mixture's record (each source's manifest digest)
            manifest = read_json(self.corpus / "manifest.json") or read_json(self.corpus / MIXTURE_RECORD)
            return self.corpus, data_hash(manifest) if manifest else "none"
        record = read_json(self.stage_dir(stage) / RECORD)
        final = self.stage_dir(stage) / "final"
        return (final, record["hash"]) if record and final.is_dir() else (None, "none")

    def write_demo(self, *, only_if_current: bool = False) -> None:
        """The demo data is cheap and idempotent, and every stage after pretraining reads it: always made, and its
        held-out prompts checked against the training prompts before any compute. only_if_current (the scoring
        tools): a folder written with other demo settings is refused, not rewritten under the pipeline's models."""
        demo = self.config.demo
        where = {"refuse_other_settings": only_if_current, "key": "out_dir"}
        if demo.kind == "arithmetic":
            counts = {"n_train": demo.n_train, "n_val": demo.n_val, "n_pairs": demo.n_pairs, "seed": demo.seed}
            calculator = CALCULATOR.schema() if demo.tool_calls else None
            paths = write_arithmetic_dataset(
                self.demo, tasks=demo.arithmetic_tasks, **counts, **where, calculator=calculator
            )
        else:
            shakespeare = {f.name: getattr(demo, f.name) for f in fields(DemoDataSection)}
            del shakespeare["kind"], shakespeare["arithmetic_tasks"], shakespeare["tool_calls"]
            paths = write_demo_dataset(self.demo, **where, **shakespeare)
        self.demo_hash = content_key(paths["manifest"].read_text())
        self.check_heldout_disjoint()

    def run(self) -> None:
        # the pipeline moves and replaces stage folders in out_dir: only in a folder that is its own, and one pipeline
        # at a time (a second one would move the first one's live stage away)
        claim_folder(self.root, "pipeline", key="out_dir", adopt=older_pipeline)
        lock_folder(
            self.root,
            what="pipeline folder",
            hint="wait for that pipeline to finish, stop it, or set out_dir to another folder",
        )
        try:
            self._run_stages()
        finally:
            release_folder(self.root)

    def _run_stages(self) -> None:
        self.check_stage_configs()
        self.write_demo()
        for index, stage in enumerate(self.config.stages, start=1):
            where = f"stage {index}/{len(self.config.stages)}"
            print(f"\n=== pipeline {self.config.name}: {where}: {stage} ===", flush=True)
            start = time.perf_counter()
            try:
                stop_if_received()  # a SIGTERM the stage before finished through: no further stage starts
                self.prepare() if stage == PREPARE else self.model_stage(stage)
            except (KeyboardInterrupt, SystemExit) as stop:  # SIGTERM or Ctrl-C
                # the stage's pending record stays: the same command resumes it from its checkpoints
                note = f"{where} ({stage}) stopped"
                if stage != PREPARE:
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
        digest = data_hash(prepare_data(self.load_stage_config("prepare")[0].data))
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
        if state == "new" and stage == next(s for s in self.config.stages if s != PREPARE) and self.tracking.renew():
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
        record, run_dir = registry.stage_named(stage), self.stage_dir(stage)
        if resume:
            record.training_section(config).checkpoint.resume, self.status[stage] = (
                "auto",
                "resumed",
            )  # the stage's own resume
        else:
            # new or changed: never resume another config's checkpoints; keep one backup, not a pile of them. Only
            # this stage's Lantern runs are moved or removed: anything else there is refused, untouched.
            if run_dir.exists():
                backup = move_aside(run_dir, stage)
                log.info("%s: config or inputs changed; moved the old run to %s (nothing deleted)", stage, backup)
            record.training_section(config).checkpoint.resume, self.status[stage] = "none", "ran"
        claim_run_directory(run_dir, stage)  # before the pipeline's record is written into it
        self.tracking.save()  # the group this stage's W&B run is in, for its resume and the stages after it
        write_record(run_dir, {"stage": stage, "hash": digest}, name=PENDING)  # "started with this hash"
        record.run(config)


def load_pipeline_config(config_path: str | None, overrides: list[str]) -> Any:
    """The pipeline config with its overrides. STAGE.KEY=VALUE (e.g. sft.trainer.max_steps=50) is appended to that
    stage's overrides: one stage setting changes from the command line without restating the preset's list."""
    staged: dict[str, list[str]] = {}
    plain = []
    for item in overrides:
        stage, _, rest = item.partition("=")[0].strip().partition(".")
        if stage in pipeline_steps()[1:] and rest and rest.split(".")[0] not in ("config", "overrides"):
            staged.setdefault(stage, []).append(item.strip()[len(stage) + 1 :])
        else:
            plain.append(item)
    config = load_config(_pipeline_schema(registry.STAGES), config_path, plain)
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
        if stage != PREPARE:
            lines.append(f"{stage + ':':<12} {pipeline.stage_dir(stage) / 'final'}  ({pipeline.status[stage]})")
    print("\n".join(lines + wandb_run_lines(pipeline)), flush=True)
    return pipeline.root
