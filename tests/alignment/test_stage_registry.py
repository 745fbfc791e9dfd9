"""A stage is one record (alignment/stages/registry.py): a minimal SFT variant, defined here as a record (SFT's own
recipe, which receives the variant's record) and added to the list, is a ``lantern`` command that trains, a pipeline
stage and a plan, and says where it stopped when interrupted; every reader (CLI, pipeline, report, plan) lists
exactly the registry's stages."""

from __future__ import annotations

import dataclasses
import json
import re
import signal
from pathlib import Path

import pytest

from alignment.commands import cli
from alignment.commands.pipeline import load_pipeline_config, pipeline_steps
from alignment.commands.pipeline_eval import policy_stages
from alignment.commands.plan_command import detect_stage
from alignment.schemas.sft import SFTConfig
from alignment.stages import pretrain as pretrain_stage
from alignment.stages import registry
from alignment.stages.registry import ModelRole, Stage
from models.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
NOT_STAGES = {"tokenizer", "generate", "convert", "eval", "prepare", "pipeline", "plan", "demo-data", "export"}


VARIANT = Stage(
    "sft_variant", "sft-variant", "SFT once more, on the SFT model (a test's stage)",
    "alignment.schemas.sft:SFTConfig", "alignment.stages.sft:run_sft", "alignment.stages.sft:SFTModule",
    "alignment.shared.stage_plan:plan_sft", "configs/sft/tiny.yaml", ("data.seq_len",),
    models=(ModelRole("init.checkpoint", "policy", start=True, upstream="sft"),),
    demo_files={"data.train": "train", "data.val": "val"},
)  # fmt: skip


@pytest.fixture
def variant(monkeypatch) -> Stage:
    monkeypatch.setattr(registry, "STAGES", registry.with_stage(VARIANT))
    return VARIANT


def stage_commands() -> list[str]:
    return [name for name in cli.build_parser()._subparsers._group_actions[0].choices if name not in NOT_STAGES]


def test_the_variant_is_a_command_that_trains(variant, setup, tmp_path, capsys):
    """`lantern sft-variant CONFIG`: parsed, loaded with its record's schema and run by its record's run (2 steps)."""
    demo = setup["root"] / "demo"
    overrides = [
        f"init.checkpoint={setup['policy']}", f"data.train=[{demo / 'train.jsonl'}]",
        f"data.val=[{demo / 'val.jsonl'}]", f"run.out_dir={tmp_path}", "run.name=variant", "logger.kind=none",
        "trainer.max_steps=2", "trainer.val_every_n_steps=1000", "trainer.accelerator=cpu",
        "checkpoint.every_n_steps=1000", "eval.generations=0",
    ]  # fmt: skip
    assert cli.main(["sft-variant", "configs/sft/tiny.yaml", *overrides]) == 0, capsys.readouterr().err
    run_dir = tmp_path / "variant"
    assert (run_dir / "final").is_dir() and f"final model: {run_dir / 'final'}" in capsys.readouterr().out
    assert json.loads((run_dir / ".lantern-folder.json").read_text())["stage"] == "sft_variant"  # its run


def test_an_interrupted_variant_says_where_it_stopped(variant, monkeypatch, tmp_path, capsys):
    """The interrupt message reads the config again through the record's schema."""

    def interrupted(config: SFTConfig, stage: Stage) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(registry, "STAGES", registry.with_stage(dataclasses.replace(variant, run_at=interrupted)))
    code = cli.main(["sft-variant", "configs/sft/tiny.yaml", f"run.out_dir={tmp_path}", "logger.kind=none"])
    assert code == 128 + signal.SIGINT
    err = capsys.readouterr().err
    assert (
        "lantern sft-variant: interrupted by SIGINT" in err and "running the same command again starts it over" in err
    )


def test_the_pipeline_takes_the_variant_and_lantern_plan_plans_it(variant, tmp_path, capsys):
    """In a pipeline's ``stages`` after SFT (its section and STAGE.KEY overrides included), planned on the model the
    SFT stage trains; and a stage config planned as the variant with ``--stage``."""
    stages = "stages=[prepare,pretrain,sft,sft_variant]"
    config = load_pipeline_config(
        str(ROOT / "configs/pipeline/tiny.yaml"), [stages, f"out_dir={tmp_path}", "sft_variant.trainer.max_steps=3"]
    )
    assert config.sft_variant.config == "configs/sft/tiny.yaml" and config.sft_variant.overrides == [
        "trainer.max_steps=3"
    ]
    assert cli.main(["plan", "configs/pipeline/tiny.yaml", stages, f"out_dir={tmp_path}", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)["stages"]
    assert [plan["stage"] for plan in plans] == ["pretrain", "sft", "sft_variant"]
    assert plans[2]["model"] == plans[1]["model"]  # the variant starts from the SFT model
    assert cli.main(["plan", "configs/sft/tiny.yaml", "--stage", "sft-variant", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stage"] == "sft_variant"


@dataclasses.dataclass
class TeacherConfig:
    path: str | None = None  # a model folder the variant reads beside the one it trains


@dataclasses.dataclass
class TeacherSFTConfig(SFTConfig):
    teacher: TeacherConfig = dataclasses.field(default_factory=TeacherConfig)


# a stage with a role no stage had, declared in its own record only: the config checks, the plan and the pipeline
# read it from there (nothing below alignment/ names teacher.path)
TEACHER_VARIANT = dataclasses.replace(
    VARIANT, schema_at=TeacherSFTConfig,
    models=(*VARIANT.models, ModelRole("teacher.path", "teacher", upstream="sft")),
)  # fmt: skip


def test_a_new_role_declared_in_the_record_alone_is_checked_planned_and_wired(monkeypatch, setup, tmp_path, capsys):
    monkeypatch.setattr(registry, "STAGES", registry.with_stage(TEACHER_VARIANT))
    from models.formats.checkpoint import save_checkpoint
    from models.model import ModelConfig, Transformer
    from tests.alignment.conftest import TINY

    other_vocab = save_checkpoint(Transformer(ModelConfig(**{**TINY, "vocab_size": 300})), tmp_path / "teacher")
    demo = setup["root"] / "demo"
    overrides = [
        f"init.checkpoint={setup['policy']}", f"data.train=[{demo / 'train.jsonl'}]", f"run.out_dir={tmp_path}",
        "logger.kind=none", "trainer.accelerator=cpu",
    ]  # fmt: skip
    # the tokenizer check: the teacher must read data.tokenizer like the model the stage starts from
    code = cli.main(["sft-variant", "configs/sft/tiny.yaml", *overrides, f"teacher.path={other_vocab}"])
    err = capsys.readouterr().err
    assert code == 2 and str(other_vocab) in err and "data.tokenizer" in err, err
    # the plan resolves the role: a teacher that is not there is named by its key
    assert cli.main(["plan", "configs/sft/tiny.yaml", "--stage", "sft-variant", f"teacher.path={tmp_path / 'no'}"]) == 2
    assert "teacher.path: " in capsys.readouterr().err
    from alignment.shared.plan_models import ModelResolver, stage_models
    from trainer.config import load_config

    config = load_config(TeacherSFTConfig, ROOT / "configs/sft/tiny.yaml", [f"teacher.path={setup['policy']}"])
    assert stage_models(TEACHER_VARIANT, config, ModelResolver(None)).others["teacher"][0].dim == TINY["dim"]
    # the pipeline wires the SFT stage's final/ into it
    assert TEACHER_VARIANT.starts_from == {"init.checkpoint": "sft", "teacher.path": "sft"}


@pytest.mark.parametrize("added", [False, True], ids=["as-shipped", "with-the-variant"])
def test_every_reader_lists_exactly_the_registrys_stages(added, monkeypatch):
    if added:
        monkeypatch.setattr(registry, "STAGES", registry.with_stage(VARIANT))
    names = [stage.name for stage in registry.STAGES]
    assert stage_commands() == [stage.command for stage in registry.STAGES]
    assert pipeline_steps() == ("prepare", *names)
    config = load_pipeline_config(str(ROOT / "configs/pipeline/tiny.yaml"), [])
    assert [f.name for f in dataclasses.fields(config) if f.name in names] == names  # a section per stage
    assert load_pipeline_config(None, []).stages == ["prepare", *names]
    assert policy_stages() == [name for name in names if name != "rm"]
    assert [detect_stage("unused.yaml", [], stage.command) for stage in registry.STAGES] == list(registry.STAGES)
    assert ("sft_variant" in names) == added


def test_a_record_reads_its_run_function_as_the_module_holds_it_now(monkeypatch):
    """The record names its run function; resolving it once must not pin it (a test's monkeypatch, a reload)."""
    stage = registry.stage_named("pretrain")
    assert stage.recipe is pretrain_stage.run_pretrain

    def replaced(config):
        return None

    monkeypatch.setattr("alignment.stages.pretrain.run_pretrain", replaced)
    assert stage.recipe is replaced


@pytest.mark.parametrize("stage", [s.name for s in registry.STAGES])
def test_every_stage_names_the_row_tokens_its_context_must_hold(stage):
    """Each stage's one context rule (its record's ``row_tokens``), read from its schema's defaults."""
    record = registry.stage_named(stage)
    config = record.schema()
    record.check_row_tokens(config, 10**6, "the model's max_seq_len")
    with pytest.raises(
        ConfigError, match=rf"{re.escape(record.row_tokens[0])} \(\d+\).* the model's max_seq_len \(8\)"
    ):
        record.check_row_tokens(config, 8, "the model's max_seq_len")


def test_a_command_reaches_its_stage_and_loss_in_three_files():
    """Issue 50's three hops from ``lantern STAGE`` to the code that uses a key: the CLI (commands/cli.py) calls the
    record's ``run``; the record (registry.py) names one file that holds both the recipe, which receives the record,
    and the module whose step computes the loss (an RL stage's ``MicroBatchLoss`` for the shared update loop).
    Rejection sampling fine-tunes with SFT's module, in SFT's file."""
    import inspect

    cli_source = inspect.getsource(cli)
    assert "stage.run(" in cli_source and "registry.STAGES" in cli_source
    for stage in registry.STAGES:
        assert isinstance(stage.run_at, str) and isinstance(stage.module_at, str), stage.name
        recipe_file, module_file = (location.partition(":")[0] for location in (stage.run_at, stage.module_at))
        home = registry.SFT.run_at.partition(":")[0] if stage is registry.REJECTION_SAMPLING else recipe_file
        assert module_file == home, stage.name
        assert inspect.signature(stage.recipe).parameters["stage"].default is stage, stage.name  # its own record
        if stage.rollout:  # the algorithm's hooks are its module's, not a second record
            source = inspect.getsource(stage.module)
            assert "MicroBatchLoss(" in source and "def plots" in source, stage.name
