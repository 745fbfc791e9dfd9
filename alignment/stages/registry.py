"""Every training stage as one record, listed once (``STAGES``, in pipeline order): the CLI, the pipeline, its report,
``lantern plan`` and the interrupt message read this list and nothing else; a stage's recipe receives its record
(``Stage.run``), and an RL stage's algorithm is its module's class methods (``RLModule``), not a second record.

Light on purpose (``lantern --help`` imports it): the heavy parts are named ``"module:attr"`` and imported when first
used. Readers go through this module's ``STAGES`` at call time, so a test may add a stage with
``monkeypatch.setattr(registry, "STAGES", with_stage(record))``.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any


def _imported(location: str) -> Any:
    # looked up on every use, not cached: the module is cached by Python already, and the attribute is the one the
    # module holds now (a test's monkeypatch of ``alignment.stages.pretrain.run_pretrain`` included)
    module, _, attr = location.partition(":")
    return functools.reduce(getattr, attr.split("."), importlib.import_module(module))


def resolve(reference: Any) -> Any:
    """``"module:attr"`` imported, anything else as given (a test's own function or class)."""
    return _imported(reference) if isinstance(reference, str) else reference


def config_value(config: Any, key: str) -> Any:
    """The value at a dotted key path of a config (None where a section is missing)."""
    return functools.reduce(lambda section, name: getattr(section, name, None), key.split("."), config)


@dataclass(frozen=True, eq=False)  # compared by identity, like a Stage (``when`` may hold a list)
class ModelRole:
    """A model folder a stage reads, declared in its record: the config key that names it and what it is for. The
    config checks (its tokenizer), ``lantern plan``, the pipeline's wiring and the report read these, nothing else."""

    key: str  # the config key of the folder; "reward.terms[].path": that field of each item of a list
    role: str  # what the stage uses it as: "policy", "reference", "reward model", "critic", ...
    start: bool = False  # the model the stage starts from: data.tokenizer auto is its tokenizer, the others share it
    upstream: str | None = None  # the stage whose final/ the pipeline wires into ``key``
    only: tuple[tuple[str, Any], ...] = ()  # of a list's items, those whose fields have these values
    when: tuple[str, Any] | None = None  # used as ``role`` only while this config key has this value

    def folders(self, config: Any) -> list[tuple[str, str]]:
        """(folder, key) of each folder ``config`` names under ``key`` (unset ones left out)."""
        if "[]." not in self.key:
            value = config_value(config, self.key)
            return [(str(value), self.key)] if value else []
        items_key, field_name = self.key.split("[].")
        found = []
        for index, item in enumerate(config_value(config, items_key) or []):
            value = getattr(item, field_name, None)
            if value and all(getattr(item, name, None) == wanted for name, wanted in self.only):
                found.append((str(value), f"{items_key}[{index}].{field_name}"))
        return found

    def applies(self, config: Any) -> bool:
        return self.when is None or config_value(config, self.when[0]) == self.when[1]


@dataclass(frozen=True, eq=False)  # one record a stage: compared and hashed by identity
class Stage:
    name: str  # the pipeline's section and run folder, the plan's and the report's label
    command: str  # `lantern COMMAND CONFIG [key=value ...]`
    help: str
    schema_at: str | type  # its config dataclass
    run_at: str | Callable[[Any], Any]  # run(config) -> the run folder on rank 0, else None
    module_at: str | type  # the LightningModule it trains
    plan_at: str | Callable[..., Any]  # plan(stage, config, models, target) -> StagePlan
    preset: str  # the pipeline's default preset
    # the config keys whose tokens one row holds, summed: what must fit the model's context (check_row_tokens)
    row_tokens: tuple[str, ...]
    # the model folders it reads, by role (the first with start=True is the one it starts from)
    models: tuple[ModelRole, ...] = ()
    demo_files: Mapping[str, str] = field(default_factory=dict)  # config key -> the demo file (no .jsonl) it reads
    corpus_key: str | None = None  # the config key the pipeline's prepared corpus goes to (pretraining's data)
    # where the trainer, checkpoint, logger and peft sections are: rejection sampling's are in its ``sft`` section
    training_prefix: str = ""
    # an RL stage's rollout: the keys of its hyperparameter section (the config section of the stage's name) whose
    # product is the sequences one rollout samples per rank, the first counting its prompts; () for the others.
    # The algorithm's other hooks (its reward, extra models, plots) are class methods of its module (RLModule)
    rollout: tuple[str, ...] = ()
    language_model: bool = True  # whether final/ is a language model the report scores (the reward model's is not)
    # the config section of the stage's multi-turn tool episodes (an ``EpisodeConfig``, docs/tools.md), if it has one:
    # with an environment set there, a row is an episode of up to its ``max_tokens``
    episodes_section: str | None = None
    # the report's line for the stage: (metric, note, "first_last" | "final") over its run's CSVs; {stage} is its name,
    # and a metric with a * (val/*/loss) is each series it matches
    headline: tuple[tuple[str, str, str], ...] = (("val/loss", "", "first_last"),)
    # the report's overview panel: (title, (left metrics, label), (right metrics, label)); None: no panel
    panel: tuple[str, tuple[tuple[str, ...], str], tuple[tuple[str, ...], str]] | None = None

    @property
    def schema(self) -> type:
        return resolve(self.schema_at)

    @property
    def recipe(self) -> Callable[..., Any]:
        """The run function, as its module holds it now."""
        return resolve(self.run_at)

    def run(self, config: Any) -> Any:
        """The stage's recipe on ``config``, given this record (a variant's own): the run folder on rank 0, else None."""
        return self.recipe(config, stage=self)

    @property
    def module(self) -> type:
        return resolve(self.module_at)

    @property
    def schema_location(self) -> tuple[str, str]:
        """(module, class) of the schema, read without importing it (what ``interrupted_message`` takes)."""
        if isinstance(self.schema_at, str):
            module, _, name = self.schema_at.partition(":")
            return module, name
        return self.schema_at.__module__, self.schema_at.__qualname__

    @property
    def rollout_section(self) -> str | None:
        """The config section of an RL stage's rollout hyperparameters (named as the stage), else None."""
        return self.name if self.rollout else None

    @property
    def title(self) -> str:
        """The stage's name in messages (``GRPO``)."""
        return self.name.upper()

    @property
    def starts_from(self) -> dict[str, str]:
        """Config key -> the stage whose final/ the pipeline wires into it."""
        return {role.key: role.upstream for role in self.models if role.upstream}

    @property
    def start_role(self) -> ModelRole | None:
        """The role of the model the stage starts from (none: pretraining from scratch builds its ``model``)."""
        return next((role for role in self.models if role.start), None)

    def model_folders(self, config: Any) -> tuple[str | None, list[tuple[str, str]]]:
        """(the folder the stage starts from, or None; (folder, key) of each other model folder it reads)."""
        start = self.start_role
        first = start.folders(config) if start else []
        seen = {folder for folder, _ in first}
        others = []
        for role in self.models:
            for folder, key in role.folders(config):
                if folder not in seen:
                    seen.add(folder)
                    others.append((folder, key))
        return (first[0][0] if first else None), others

    @property
    def x_axis(self) -> str:
        """What a step of its curves is: an RL stage's is a rollout."""
        return "rollout" if self.rollout else "optimizer step"

    def training_section(self, config: Any) -> Any:
        """The part of ``config`` that holds its trainer, checkpoint, logger and peft sections."""
        return functools.reduce(getattr, self.training_prefix.split(".")[:-1], config)

    def trains_adapters(self) -> bool:
        """Whether the stage takes a ``peft`` section (pretraining trains every weight)."""
        return any(f.name == "peft" for f in fields(self.training_section(self.schema())))

    def check_row_tokens(self, config: Any, max_seq_len: int, limit: str) -> None:
        """The stage's one context rule, for its run and its plan alike: the tokens of a row (``row_tokens``) fit
        ``max_seq_len``; a one-line ConfigError naming the keys and ``limit`` otherwise."""
        from trainer.checks import check_context_length

        if (episodes := self.episodes(config)) is not None:  # an episode is one row
            lengths = {f"{self.episodes_section}.max_tokens": episodes.max_tokens}
        else:
            lengths = {key: functools.reduce(getattr, key.split("."), config) for key in self.row_tokens}
        check_context_length(lengths, max_seq_len, limit)

    def episodes(self, config: Any) -> Any | None:
        """The stage's episodes section when an environment is set there, else None (single-turn responses)."""
        section = getattr(config, self.episodes_section) if self.episodes_section else None
        return section if section is not None and section.enabled else None

    def environment(self, config: Any) -> Any | None:
        """The environment the stage's episodes section names, loaded and checked before compute (errors name the
        key); None: single-turn responses."""
        from alignment.shared.episodes import load_environment

        episodes = self.episodes(config)
        return load_environment(episodes.environment, f"{self.episodes_section}.environment") if episodes else None

    def plan(self, config: Any, models: Any, target: Any) -> Any:
        """The stage's ``StagePlan`` with the knob that makes it fit; refused like the run when a row does not fit
        the model's context."""
        from alignment.shared.plan_knobs import plan_stage

        self.check_row_tokens(config, models.policy.max_seq_len, "the model's max_seq_len")
        return plan_stage(self, config, models, target)

    def plan_without_knob(self, config: Any, models: Any, target: Any) -> Any:
        return resolve(self.plan_at)(self, config, models, target)

    def preflight(self, config: Any) -> Any:
        """The stage's plan on this machine's device before any weights load (``plan_knobs.preflight``): printed,
        and refused in one line when it does not fit; the ``PlannedRun`` its run is held against, or None."""
        from alignment.shared.plan_knobs import preflight

        return preflight(self, config)


_PLANS = "alignment.shared.stage_plan"
_RL_HEADLINE = (
    ("eval/gt_score", "(ground truth)", "first_last"),
    ("eval/reward", "(its reward)", "first_last"),
    ("{stage}/kl", "", "final"),
)


def _rl_panel(title: str) -> tuple[str, tuple[tuple[str, ...], str], tuple[tuple[str, ...], str]]:
    return (
        f"{title}: greedy answers to held-out prompts",
        (("eval/gt_score", "eval/reward"), "score"),
        (("{stage}/kl",), "KL to the SFT model (nats)"),
    )


PRETRAIN = Stage(
    "pretrain", "pretrain", "pretrain a model on prepared token shards",
    "alignment.schemas.pretrain:PretrainConfig", "alignment.stages.pretrain:run_pretrain",
    "alignment.stages.pretrain:PretrainModule", f"{_PLANS}:plan_pretrain", "configs/pretrain/tiny.yaml",
    ("loader.seq_len",),
    models=(ModelRole("init.checkpoint", "initial weights", start=True),),  # continued pretraining
    corpus_key="data.out_dir",
    # val/*/loss: each source of a mixture (data.sources), as its run logged it
    headline=(("val/loss", "", "first_last"), ("val/*/loss", "", "first_last")),
    panel=("pretraining", (("train/loss", "val/loss", "val/*/loss"), "loss"), ((), "")),
)  # fmt: skip

SFT = Stage(
    "sft", "sft", "supervised fine-tuning on chat / prompt-response / Alpaca data",
    "alignment.schemas.sft:SFTConfig", "alignment.stages.sft:run_sft", "alignment.stages.sft:SFTModule",
    f"{_PLANS}:plan_sft", "configs/sft/tiny.yaml", ("data.seq_len",),
    models=(ModelRole("init.checkpoint", "policy", start=True, upstream="pretrain"),),
    demo_files={"data.train": "train", "data.val": "val"},
    headline=(("val/loss", "", "first_last"), ("val/accuracy", "(exact match)", "first_last")),
    panel=("SFT", (("train/loss", "val/loss"), "loss"), (("val/accuracy",), "exact-match accuracy")),
)  # fmt: skip

RM = Stage(
    "rm", "rm", "train a reward model on preference pairs",
    "alignment.schemas.reward:RMConfig", "alignment.stages.reward:run_rm", "alignment.stages.reward:RewardModule",
    f"{_PLANS}:plan_rm", "configs/rm/tiny.yaml", ("data.seq_len",),
    models=(
        ModelRole("init.checkpoint", "backbone", start=True, upstream="sft"),
        # its policy_samples (when its preset names a checker) sample the SFT model
        ModelRole("policy_samples.policy", "samples' policy", upstream="sft"),
    ),
    demo_files={"data.train": "pairs", "policy_samples.prompts": "train_prompts", "policy_samples.heldout": "prompts"},
    language_model=False, headline=(("val/accuracy", "(pairwise, held-out pairs)", "first_last"),),
    panel=("reward model", (("train/accuracy", "val/accuracy"), "pairwise accuracy"), ((), "")),
)  # fmt: skip

# the RL stages train on the training pool's prompts and evaluate on the val split's (never trained on)
PPO = Stage(
    "ppo", "ppo", "optimise the SFT policy against the reward model with PPO",
    "alignment.schemas.rl:PPOConfig", "alignment.stages.ppo:run_ppo", "alignment.stages.ppo:PPOModule",
    "alignment.shared.plan_rl:plan_rl_stage", "configs/ppo/tiny.yaml",
    ("data.max_prompt_tokens", "ppo.response_max_tokens"),
    models=(
        ModelRole("init.policy", "policy", start=True, upstream="sft"),
        ModelRole("reward.terms[].path", "reward model", only=(("kind", "reward_model"),)),
        ModelRole("init.reward_model", "reward model", upstream="rm", when=("reward.terms", [])),
        # the critic, in this order: the reward's first reward model, init.reward_model, a head on the policy
        ModelRole("reward.terms[].path", "critic", only=(("kind", "reward_model"),), when=("init.critic", "reward_model")),
        ModelRole("init.reward_model", "critic", when=("init.critic", "reward_model")),
        ModelRole("init.policy", "critic"),
    ),
    demo_files={"data.train": "train_prompts", "data.val": "prompts"}, rollout=("rollout_batch_size",),
    episodes_section="episodes", headline=_RL_HEADLINE, panel=_rl_panel("PPO"),
)  # fmt: skip

GRPO = Stage(
    "grpo", "grpo", "critic-free RL (GRPO or RLOO): groups of samples per prompt, scored by the reward",
    "alignment.schemas.rl:GRPOConfig", "alignment.stages.grpo:run_grpo", "alignment.stages.grpo:GRPOModule",
    "alignment.shared.plan_rl:plan_rl_stage", "configs/grpo/tiny.yaml",
    ("data.max_prompt_tokens", "grpo.response_max_tokens"),
    models=(
        ModelRole("init.policy", "policy", start=True, upstream="sft"),
        ModelRole("reward.terms[].path", "reward model", only=(("kind", "reward_model"),)),
    ),
    demo_files={"data.train": "train_prompts", "data.val": "prompts"},
    rollout=("prompts_per_rollout", "group_size"), episodes_section="episodes",
    headline=_RL_HEADLINE, panel=_rl_panel("GRPO"),
)  # fmt: skip

DPO = Stage(
    "dpo", "dpo", "direct preference optimisation (DPO, IPO or SimPO) on preference pairs",
    "alignment.schemas.dpo:DPOConfig", "alignment.stages.dpo:run_dpo", "alignment.stages.dpo:DPOModule",
    f"{_PLANS}:plan_dpo", "configs/dpo/tiny.yaml", ("data.seq_len",),
    models=(
        ModelRole("init.policy", "policy", start=True, upstream="sft"), ModelRole("init.reference", "reference"),
    ),
    demo_files={"data.train": "pairs"},
    headline=(
        ("val/loss", "", "first_last"), ("val/reward_accuracy", "(implicit reward, held-out pairs)", "first_last")
    ),
)  # fmt: skip

REJECTION_SAMPLING = Stage(
    "rejection_sampling", "rejection-sampling",
    "sample K answers per prompt, keep the best by the reward, then SFT on them",
    "alignment.schemas.rejection_sampling:RejectionSamplingConfig",
    "alignment.stages.rejection_sampling:run_rejection_sampling", "alignment.stages.sft:SFTModule",
    "alignment.shared.plan_rl:plan_rejection_sampling", "configs/rejection_sampling/tiny.yaml",
    ("data.max_prompt_tokens", "sampling.response_max_tokens"),
    models=(
        ModelRole("init.policy", "policy", start=True, upstream="sft"),
        ModelRole("reward.terms[].path", "reward model", only=(("kind", "reward_model"),)),
    ),
    demo_files={"data.train": "train_prompts", "sft.data.val": "val"},
    training_prefix="sft.", episodes_section="episodes",
    headline=(("val/loss", "(SFT on the kept samples)", "first_last"),),
)  # fmt: skip

# in pipeline order
STAGES: tuple[Stage, ...] = (PRETRAIN, SFT, RM, PPO, GRPO, DPO, REJECTION_SAMPLING)


def stage_named(name: str) -> Stage:
    """The stage of a name (``rejection_sampling``) or command (``rejection-sampling``); KeyError if none."""
    for stage in STAGES:
        if name in (stage.name, stage.command):
            return stage
    raise KeyError(name)


def find_stage(name: str) -> Stage | None:
    try:
        return stage_named(name)
    except KeyError:
        return None


def with_stage(stage: Stage) -> tuple[Stage, ...]:
    """The list with ``stage`` in place of the one of its name, else added last (a test's or a plugin's)."""
    if any(s.name == stage.name for s in STAGES):
        return tuple(stage if s.name == stage.name else s for s in STAGES)
    return (*STAGES, stage)
