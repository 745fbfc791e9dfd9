"""Log-probs, entropies and critic values of the response tokens of prompt + response rows (left-padded prompts,
right-padded responses), computed the same way in the rollout, reference and training passes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from alignment.shared.losses import logprobs_and_entropy
from models.attention import use_flex_attention
from models.generation import flex_bucketed, ids_and_positions
from models.heads import ScalarModel
from models.model import Transformer
from models.prefill import SHARED_PREFIX_MIN, logits_with_shared_prefix

RewardFunction = Callable[[Tensor, Tensor], Tensor]  # (input_ids (B, T), real mask (B, T)) -> scores (B,)


@dataclass
class Rollout:
    input_ids: Tensor  # (B, P + N) left-padded prompt, then the response, right-padded
    real: Tensor  # (B, P + N) bool, real tokens
    prompt_len: int  # P
    shared_prefix: int  # tokens every prompt starts with (models.prefill.shared_prefix_length)
    mask: Tensor  # (B, N) bool, real response tokens
    old_logp: Tensor  # (B, N)
    values: Tensor  # (B, N)
    advantages: Tensor  # (B, N)
    returns: Tensor  # (B, N)


def response_logprobs(
    model: Transformer, input_ids: Tensor, real: Tensor, prompt_len: int, temperature: float, shared: int = 0
) -> tuple[Tensor, Tensor]:
    """Log-probs and entropies (B, N) of the response tokens (positions prompt_len..) of left-padded prompt +
    right-padded response rows; ``real`` marks real tokens. Rollout, reference and training all use this.
    ``shared``: how many tokens every prompt starts with (``models.prefill.shared_prefix_length``); from
    ``SHARED_PREFIX_MIN`` on, the blocks run them once for all rows (docs/generation.md), except under
    FlexAttention (CUDA's default), where it is not yet measured."""
    width, config = input_ids.shape[1], getattr(model, "config", None)
    flex = config is not None and use_flex_attention(config, real, None)  # CUDA: the prefix path is unmeasured there
    if shared >= SHARED_PREFIX_MIN and not flex:
        # the LM head from the last prompt position on: what predicts each response token
        logits = logits_with_shared_prefix(model, input_ids, real, shared, logits_from=prompt_len - 1)
    else:
        input_ids, real = flex_bucketed(config, input_ids, real)
        document_ids, position_ids = ids_and_positions(real)
        logits = model(input_ids, position_ids=position_ids, document_ids=document_ids, logits_from=prompt_len - 1)
    logits = logits[:, : width - prompt_len]
    return logprobs_and_entropy(logits, input_ids[:, prompt_len:width], temperature)


def response_values(critic: ScalarModel, input_ids: Tensor, real: Tensor, prompt_len: int) -> Tensor:
    """The critic's value (B, N) of the state before each response token (read where its log-prob is)."""
    width = input_ids.shape[1]
    input_ids, real = flex_bucketed(getattr(critic, "config", None), input_ids, real)
    document_ids, position_ids = ids_and_positions(real)
    values = critic(input_ids, position_ids=position_ids, document_ids=document_ids)
    return values[:, prompt_len - 1 : width - 1].float()
