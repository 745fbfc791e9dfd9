"""The plans of the stages that sample: PPO and GRPO / RLOO (one rollout a step: generate, score, then train on it) and
rejection sampling (sample and score once, then SFT). The RL plan reads its algorithm from the stage record (its
hyperparameter section and the keys whose product is a rollout's sequences); a critic is planned when the stage
holds one (``Models.critic``).

An RL step holds: the policy (LoRA: adapters only) and PPO's critic, trained; the frozen reference (none under LoRA)
and reward models in ``frozen_dtype`` on ``frozen_device``; for generation, the policy gathered whole under FSDP2 and
the rollout's KV cache (kept between rollouts by the compiled decoder on CUDA, so it stays during training too); for
scoring, full (B, width, V) logits a micro-batch at a time; for training, each micro-batch's policy (and critic)
pass with gradients. Decoding time is bound by memory bandwidth at ``DECODE_EFFICIENCY`` (an assumption until
measured); the other passes run at the table's MFU. The chat template's preamble, which every prompt starts with,
is prefilled and scored once a pass (``models.prefill``), and a row stops costing decode steps when it stops
(``Target.mean_response_tokens``).
"""

from __future__ import annotations

import math
from typing import Any

from alignment.shared.stage_plan import (
    Item,
    Models,
    Phase,
    Setup,
    StagePlan,
    Target,
    activation_items,
    describe_model,
    describe_run,
    finish,
    frozen_items,
    lm_flops_per_token,
    peft_of,
    plan_sft,
    step_timing,
    trained_items,
)
from data.tokenizer.base import load_tokenizer, resolve_tokenizer_spec
from models.errors import ConfigError
from models.memory import (
    activation_bytes,
    attention_path,
    inference_bytes,
    kv_cache_bytes,
    logprob_pass_bytes,
)
from models.parameter_shapes import meta_parameters
from models.prefill import SHARED_PREFIX_MIN, shared_prefix_length
from trainer.hardware import mfu_for
from trainer.plan import model_state, peak_flops

DECODE_EFFICIENCY = 0.6  # share of the memory bandwidth a decode step reaches (assumed, not measured by Lantern)
CACHE_BUCKET = 128  # the static decoder's LENGTH_BUCKET: its caches are rounded up to it on CUDA


def cache_length(width: int, setup: Setup, max_seq_len: int) -> int:
    length = width - 1  # the last generated token is never fed back
    if setup.device == "cuda":
        length = -(-length // CACHE_BUCKET) * CACHE_BUCKET
    return min(length, max_seq_len)


def template_prefix(stage: Any, config: Any) -> int:
    """The tokens the stage's chat template writes before every prompt's user turn (a default system turn): a rollout
    of several questions shares at least those, prefilled and scored once a pass (``models.prefill``). 0 when fewer
    than ``SHARED_PREFIX_MIN`` or the tokenizer cannot be read where the plan runs (a folder an upstream stage
    writes)."""
    try:
        tokenizer = load_tokenizer(resolve_tokenizer_spec(config.data.tokenizer, stage.model_folders(config)[0]))
        first, second = (tokenizer.encode_chat_prompt([{"role": "user", "content": text}]) for text in ("1 + 2", "x"))
    except (OSError, ValueError, ConfigError):
        return 0
    shared = shared_prefix_length([first, second])
    return shared if shared >= SHARED_PREFIX_MIN else 0


def decode_steps(target: Target, hp: Any, turns: int = 1) -> tuple[int, float, str]:
    """(decode steps of a rollout, the mean steps a row takes, the note saying which): the longest row runs to
    ``response_max_tokens`` (times ``turns``, a tool episode's policy turns); a row leaves the batch when it stops,
    at ``--mean-response-tokens`` on average (the policy's tokens of a whole episode)."""
    limit = hp.response_max_tokens * turns
    of = f"{turns} turns of {hp.response_max_tokens}" if turns > 1 else f"{limit}"
    if target.mean_response_tokens is None:
        return limit, limit, f"every row decodes {of} tokens (an upper bound: give --mean-response-tokens)"
    mean = min(target.mean_response_tokens, limit)
    return limit, mean, f"rows leave the batch at {mean:g} tokens on average (--mean-response-tokens), of {of}"


def episode_turns(stage: Any, config: Any) -> int:
    """The policy turns a row may take: the episodes section's ``max_turns`` when the stage plays tool episodes."""
    episodes = stage.episodes(config)
    return episodes.max_turns if episodes is not None else 1


def rollout_shape(stage: Any, config: Any) -> tuple[Any, int, int]:
    """(the hyperparameter section, sequences one rollout samples per GPU, prompt + response width)."""
    hp = getattr(config, stage.rollout_section)
    sequences = math.prod(getattr(hp, key) for key in stage.rollout)
    if (episodes := stage.episodes(config)) is not None:  # an episode is one row
        return hp, sequences, episodes.max_tokens
    return hp, sequences, config.data.max_prompt_tokens + hp.response_max_tokens


def frozen_models(config: Any, models: Models, hp: Any, setup: Setup, reference: bool) -> list[Item]:
    """The frozen reference (unless LoRA makes the policy its own) and the reward models, in frozen_dtype, on the GPU
    unless frozen_device is cpu (the reference follows the policy under LoRA, so it costs nothing here)."""
    width = 2 if hp.frozen_dtype == "bfloat16" else 4
    on_host = hp.frozen_device == "cpu"
    items = []
    if reference:
        items += frozen_items("reference (frozen)", meta_parameters(models.policy), width, on_host)
    for index, reward in enumerate(models.rewards, start=1):
        label = "reward model (frozen)" if len(models.rewards) == 1 else f"reward model {index} (frozen)"
        items += frozen_items(label, meta_parameters(reward, scalar_head=True), width, on_host)
    return items


def plan_rl_stage(stage: Any, config: Any, models: Models, target: Target) -> StagePlan:
    """PPO or GRPO: the memory of the rollout's generation and scoring and of the training passes, and a rollout's
    time."""
    trainer = config.trainer
    setup = Setup.of(trainer, target)
    peft = peft_of(config)
    hp, sequences, width = rollout_shape(stage, config)
    policy = models.policy
    params = meta_parameters(policy, peft=peft)
    trained = trained_items("policy", params, setup, trainer, peft, config.optim)
    critic_params = None
    if models.critic is not None:
        critic_params = meta_parameters(models.critic, scalar_head=True, peft=peft, trainable=("head.",))
        trained += trained_items("critic", critic_params, setup, trainer, peft, getattr(config, "critic_optim", None))
    frozen = frozen_models(config, models, hp, setup, reference=peft is None)
    cuda = setup.device == "cuda"
    weights_dtype = 2 if setup.numerics == "bf16" else 4  # the gathered / kept weights the cache takes its dtype from
    caches = [(sequences, cache_length(width, setup, policy.max_seq_len))]
    if cuda:
        eval_width = config.data.max_prompt_tokens + hp.response_max_tokens
        caches.append((config.eval.batch_size, cache_length(eval_width, setup, policy.max_seq_len)))
    rollout_cache = kv_cache_bytes(policy, caches[0][0], caches[0][1], weights_dtype)
    cache = sum(kv_cache_bytes(policy, rows, length, weights_dtype) for rows, length in caches)
    kept = [Item("KV caches (kept)", cache, "rollout and evaluation batches, compiled decoding")] if cuda else []
    no_grads = [item for item in trained if "gradients" not in item.name]
    attention = attention_path(policy, masked=True, device=setup.device)
    numerics = setup.numerics
    gathered = (
        [Item("policy gathered for generation", weights_dtype * params.total, "FSDP2, whole")]
        if setup.strategy == "fsdp"
        else []
    )
    prefill = inference_bytes(
        policy, sequences, config.data.max_prompt_tokens, numerics=numerics, attention=attention, head="last"
    )
    # tool episodes: each turn's prompts' keys and values are kept for the next turn's prefill (models.prefix_cache)
    turn_prompts = (
        [Item("last turn's prompts (kept)", rollout_cache, "tool episodes: for the next turn's prefill")]
        if episode_turns(stage, config) > 1
        else []
    )
    generation = Phase("rollout: generation", [
        *no_grads, *frozen, *gathered,
        Item("KV cache", rollout_cache, f"{sequences} rows x {caches[0][1]} positions"), *turn_prompts,
        Item("prefill working set", prefill, "no grad"),
    ], "prefill")  # fmt: skip
    micro = hp.micro_batch_size
    # under FlexAttention the full-sequence passes pad rows to a multiple of 128 (generation's flex_bucketed)
    padded = min(-(-width // CACHE_BUCKET) * CACHE_BUCKET, policy.max_seq_len) if attention == "flex" else width
    scoring = [logprob_pass_bytes(policy, micro, padded, hp.response_max_tokens, numerics=numerics, attention=attention, grad=False).peak]  # fmt: skip
    if hp.frozen_device != "cpu":  # frozen models on the host score there
        scoring += [
            inference_bytes(reward, sequences, padded, numerics=numerics, attention=attention)
            for reward in models.rewards
        ]
    score_phase = Phase("rollout: scoring", [
        *no_grads, *frozen, *kept, Item("scoring pass", max(scoring), "log-probs, values, rewards; no grad"),
    ], "the largest scoring pass")  # fmt: skip
    passes = logprob_pass_bytes(
        policy, micro, padded, hp.response_max_tokens, numerics=numerics, attention=attention, grad=True,
        ac=trainer.activation_checkpointing, ac_every=trainer.ac_every, head_trains=peft is None,
        compiled=setup.compiled,
    )  # fmt: skip
    if critic_params is not None:
        critic = activation_bytes(
            models.critic, micro, padded, numerics=numerics, attention=attention, head="scalar",
            ac=trainer.activation_checkpointing, ac_every=trainer.ac_every, embedding_trains=peft is None,
            compiled=setup.compiled,
        )  # fmt: skip
        for name, value in critic.saved.items():
            passes.saved[f"critic {name}"] = value
        passes.moments = {name: value + critic.saved_total for name, value in passes.moments.items()}
    act, moment = activation_items(passes, f"({micro} x {width} tokens{', policy + critic' if critic_params else ''})")
    training = Phase("training", [*trained, *frozen, *kept, *act], moment)
    timing = rl_timing(stage, config, models, target, setup, params, critic_params, sequences, width)
    plan = StagePlan(
        stage.name, describe_model(policy, params), describe_run(setup, trainer, target),
        f"{sequences} sequences of up to {width} tokens per GPU a rollout, micro-batches of {micro}, "
        f"{hp.epochs} epoch(s); one step = one rollout", [generation, score_phase, training], None, "", 0, timing,
        parameters=params.total, trainable_parameters=params.trainable, tokens_per_step=sequences * width * setup.world,
    )  # fmt: skip
    if models.rewards and hp.frozen_device == "cpu":
        plan.notes.append("frozen models on the host: their scoring runs on the CPU")
    return finish(plan, target, setup)


def decode_seconds(
    target: Target, setup: Setup, weights: int, cache: int, rows: int, steps: int, matmuls: int, row_steps: float
) -> float:
    """``steps`` decode steps of up to ``rows`` rows, ``row_steps`` the mean a row takes before it leaves the batch:
    each step reads the weights, and each row still decoding its cache (on average half of it); bound by memory
    bandwidth or, for large batches, by compute (2 FLOPs per weight per row, at the table's MFU)."""
    gpu = target.gpu
    mfu = mfu_for(gpu, True, target.mfu).mfu
    bandwidth = gpu.memory_tbs * 1e12 * DECODE_EFFICIENCY
    reads = (steps * weights + row_steps * cache / 2) / bandwidth  # each row's cache (cache / rows) for row_steps
    computes = 2 * matmuls * rows * row_steps / (peak_flops(gpu, setup.precision) * mfu)
    return max(reads, computes)


def rl_timing(
    stage: Any, config: Any, models: Models, target: Target, setup: Setup, params: Any, critic_params: Any,
    sequences: int, width: int,
) -> Any:  # fmt: skip
    """One rollout: generation (memory-bound decoding), the scoring forwards, the training epochs."""
    if target.gpu is None:
        return None
    trainer, hp = config.trainer, rollout_shape(stage, config)[0]
    policy = models.policy
    tokens = sequences * width * setup.world
    shared = template_prefix(stage, config)
    # each pass over the rollout (scoring, every training epoch) runs the shared prefix once a micro-batch, not once
    # a row: the share of a full pass's tokens it computes
    micro_batches = sequences // hp.micro_batch_size
    unshared = (sequences * (width - shared) + micro_batches * shared) / (sequences * width)
    policy_fpt = lm_flops_per_token(policy, width, params)
    forward = policy_fpt / 3  # a forward is 2 of a training token's 6 units
    scoring = forward * (2 + (1 if critic_params is not None else 0)) * unshared  # old log-probs, reference, values
    scoring += sum(
        lm_flops_per_token(reward, width, meta_parameters(reward), head=False) / 3 for reward in models.rewards
    )
    critic_fpt = 0.0
    if critic_params is not None:
        critic_fpt = lm_flops_per_token(models.critic, width, critic_params, head=False)
    training = hp.epochs * (policy_fpt + critic_fpt) * unshared
    turns = episode_turns(stage, config)
    steps, row_steps, rows_note = decode_steps(target, hp, turns)
    notes = [
        f"decoding at {DECODE_EFFICIENCY:.0%} of the memory bandwidth (assumed, not measured by Lantern)",
        rows_note,
    ]
    if shared:
        notes.append(f"the chat template's {shared}-token preamble prefilled and scored once a pass, not once a row")
    timing = step_timing(
        target, setup, trainer, tokens_per_step=tokens, flops_per_token=scoring + training,
        micro_batches=hp.epochs * (sequences // hp.micro_batch_size) * 2,
        params=[p for p in (params, critic_params) if p is not None], compiled=setup.compiled,
        n_layers=policy.n_layers, notes=notes,
    )  # fmt: skip
    if timing is None or not target.gpu.memory_tbs:
        return timing
    weights_dtype = 2 if setup.numerics == "bf16" or setup.precision.startswith("bf16") else 4
    cache = kv_cache_bytes(policy, sequences, width, weights_dtype)
    matmuls = params.total - policy.vocab_size * policy.dim * (0 if policy.tie_embeddings else 1)
    decode = decode_seconds(target, setup, weights_dtype * params.total, cache, sequences, steps, matmuls, row_steps)
    choice = mfu_for(target.gpu, setup.compiled, target.mfu)
    # a tool episode prefills what it did not decode: its prompt, then each turn's observations
    prefilled = config.data.max_prompt_tokens if turns == 1 else max(width - steps, config.data.max_prompt_tokens)
    prompt_tokens = shared + sequences * (prefilled - shared)
    prefill = 2 * matmuls * prompt_tokens / (peak_flops(target.gpu, setup.precision) * choice.mfu)
    timing.compute_s += decode + prefill
    timing.step_s = max(timing.compute_s, timing.communication_s)
    timing.notes.append(f"generation ~{decode + prefill:.3g} s of the step ({steps} decode steps)")
    return timing


def plan_sampling(stage: Any, config: Any, models: Models, target: Target) -> tuple[Phase, Any]:
    """Rejection sampling's sampling phase: the policy generating ``batch_size x samples_per_prompt`` rows (no
    optimizer yet), the reward models beside it; and the time of one batch."""
    setup = Setup.of(stage.training_section(config).trainer, target)
    sampling = config.sampling
    policy = models.policy
    params = meta_parameters(policy)
    rows = sampling.batch_size * sampling.samples_per_prompt
    width = config.data.max_prompt_tokens + sampling.response_max_tokens
    if (episodes := stage.episodes(config)) is not None:  # an episode is one row
        width = episodes.max_tokens
    weights = 2 if setup.numerics == "bf16" else 4
    state = model_state(params, setup.precision, trains=False)
    cache = kv_cache_bytes(policy, rows, cache_length(width, setup, policy.max_seq_len), weights)
    attention = attention_path(policy, masked=True, device=setup.device)
    rewards = [
        item
        for index, reward in enumerate(models.rewards, start=1)
        for item in frozen_items(f"reward model {index} (frozen)", meta_parameters(reward, scalar_head=True), 4, False)
    ]
    scoring = max(
        [inference_bytes(policy, rows, config.data.max_prompt_tokens, numerics=setup.numerics, attention=attention, head="last")]
        + [inference_bytes(r, rows, width, numerics=setup.numerics, attention=attention) for r in models.rewards]
    )  # fmt: skip
    phase = Phase("sampling", [
        Item("policy parameters", state.parameters, "no optimizer yet"), *rewards,
        Item("KV cache", cache, f"{rows} rows x {width} positions"), Item("prefill / scoring working set", scoring, "no grad"),
    ], "prefill")  # fmt: skip
    seconds = None
    if target.gpu is not None:
        matmuls = params.total - policy.vocab_size * policy.dim * (0 if policy.tie_embeddings else 1)
        steps, row_steps, _ = decode_steps(target, sampling, episode_turns(stage, config))
        seconds = decode_seconds(target, setup, weights * params.total, cache, rows, steps, matmuls, row_steps)
    return phase, seconds


def plan_rejection_sampling(stage: Any, config: Any, models: Models, target: Target) -> StagePlan:
    """Sampling, then the SFT plan of its training section on the same policy; the peak is the larger."""
    phase, seconds = plan_sampling(stage, config, models, target)
    plan = plan_sft(stage, stage.training_section(config), models, target)
    plan.phases.insert(0, phase)
    prompts = config.sampling.prompts
    if seconds is not None:
        per_batch = f"~{seconds:.3g} s per batch of {config.sampling.batch_size} prompts"
        total = f"; {prompts} prompts ~{seconds * -(-prompts // config.sampling.batch_size):.3g} s" if prompts else ""
        rows = decode_steps(target, config.sampling, episode_turns(stage, config))[2]
        plan.notes.append(f"sampling before SFT: {per_batch}{total} (decoding at the bandwidth assumption; {rows})")
    return plan
