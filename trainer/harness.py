"""EleutherAI's lm-evaluation-harness over a Lantern model. ``LanternLM`` answers lm-eval's three request types as its
``hf`` backend does (the same tokenization, truncation, stop strings and prefix token), through Lantern's own paths:
log-likelihoods packed into rows, each context run once for all its choices, and KV-cache generation that stops a
row once a stop string appears. ``evaluate`` runs tasks through lm-eval's registry and metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm import tqdm

from data.tokenizer.base import TokenizerBase
from models.errors import ConfigError
from models.generation import generate
from models.model import Transformer

HEAD_CHUNK = 1024  # positions per LM-head call when scoring: bounds the (positions, vocab) logits held at once


class LanternLM(TemplateLM):
    """lm-eval's ``LM`` over a Lantern ``model`` and its ``tokenizer``. ``batch_size``: rows per forward when scoring
    (rows as wide as the longest request, at most ``row_tokens``) and prompts per generate call; ``max_length``: the
    context kept (left truncation), by default the model's ``max_seq_len``; ``decode``: as ``lantern generate``'s."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: TokenizerBase,
        *,
        batch_size: int = 8,
        max_length: int | None = None,
        row_tokens: int = 2048,
        max_gen_toks: int = 256,
        decode: str = "auto",
    ) -> None:
        super().__init__()
        self.model = model.eval()
        self.tok = tokenizer
        self.batch_size = batch_size
        if max_length is not None and max_length > model.config.max_seq_len:
            raise ConfigError(f"--max-length {max_length} exceeds the model's max_seq_len {model.config.max_seq_len}")
        self._max_length = max_length or model.config.max_seq_len
        self.row_tokens = min(row_tokens, model.config.max_seq_len)  # a packed row is one sequence to the model
        self.max_gen_toks = max_gen_toks
        self.decode = decode
        self._device = model.tok_embeddings.weight.device

    # --- tokenization, as the hf backend's -------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:  # what an empty context is scored after: BOS, else EOS (as hf's)
        return self.tok.bos_id if self.tok.bos_id is not None else self.tok.eos_id

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return str(self.tok.path).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        if add_special_tokens is None:  # the tokenizer's own default, but never a second BOS
            bos = self.tok.bos_id
            add_special_tokens = not (bos is not None and string.startswith(self.tok.decode([bos])))
        return self.tok.encode_as_hf(string, add_special_tokens=add_special_tokens)

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        if isinstance(tokens, int):
            tokens = [tokens]
        kept = [t for t in tokens if not (skip_special_tokens and self.tok.is_special(t))]
        return self.tok.decode(kept)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        template = getattr(self.tok, "template", None)
        return template.source if template is not None else "llama3"

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation rendered by the checkpoint's own chat template, as text (special tokens as strings)."""
        if add_generation_prompt:
            return self.tok.decode(self.tok.encode_chat_prompt(chat_history))
        return self.tok.decode(self.tok.encode_chat(chat_history)[0])

    # --- log-likelihoods ------------------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probs, whether greedy decoding gives it) per (key, context, continuation).

        A unit is a prefix (the inputs up to the one that predicts the continuation's first token) and the
        continuations after it: the choices of a multiple-choice question share their context, so it runs once (k
        short choices after a long context cost little more than one). Units are packed first-fit-decreasing into
        rows as wide as the longest (at most ``row_tokens``); each continuation attends to its prefix and itself."""
        results: list[tuple[float, bool]] = [(0.0, True)] * len(requests)
        units: dict[tuple[int, ...], list[tuple[int, list[int]]]] = {}
        for index, (_, context, continuation) in enumerate(requests):
            whole = (list(context) + list(continuation))[-(self.max_length + 1) :]  # left truncation, as hf's
            scored = len(continuation)  # may be 0 (a BPE merge across the boundary): log-prob 0, greedy, as hf's
            if scored:
                units.setdefault(tuple(whole[: len(whole) - scored]), []).append((index, whole[-scored:]))
        packed = []
        for prefix, branches in units.items():
            if len(prefix) + sum(len(c) - 1 for _, c in branches) <= self.model.config.max_seq_len:
                packed.append((list(prefix), branches))
            else:  # too long together for one sequence: each alone (each fits, being at most max_length + 1)
                packed += [(list(prefix), [branch]) for branch in branches]
        lengths = [len(prefix) + sum(len(c) - 1 for _, c in branches) for prefix, branches in packed]
        rows = pack_rows(lengths, min(max(lengths, default=1), self.row_tokens))
        rows.sort(key=lambda row: -sum(lengths[i] for i in row))  # a batch's rows about as long as each other
        for start in tqdm(range(0, len(rows), self.batch_size), desc="Scoring rows", disable=disable_tqdm):
            for index, value in self._score_rows(
                [[packed[u] for u in row] for row in rows[start : start + self.batch_size]]
            ):
                results[index] = value
        return results

    @torch.inference_mode()
    def _score_rows(self, rows: list[list[tuple[list[int], list]]]) -> list[tuple[int, tuple[float, bool]]]:
        width = max(sum(len(p) + sum(len(c) - 1 for _, c in b) for p, b in row) for row in rows)
        input_ids = torch.full((len(rows), width), self.tok.pad_id, dtype=torch.long)
        positions = torch.zeros((len(rows), width), dtype=torch.long)
        units = torch.zeros((len(rows), width), dtype=torch.long)  # padding: unit 0, never attended to
        branch = torch.zeros((len(rows), width), dtype=torch.long)  # 0: a prefix, j: its j-th continuation
        where, targets, spans = [], [], []
        for r, row in enumerate(rows):
            offset = 0
            for unit, (prefix, branches) in enumerate(row, start=1):
                end = offset + len(prefix)
                input_ids[r, offset:end] = torch.tensor(prefix)
                positions[r, offset:end] = torch.arange(len(prefix))
                units[r, offset:end] = unit
                for j, (index, continuation) in enumerate(branches, start=1):
                    inputs = continuation[:-1]  # the last token is only a target
                    stop = end + len(inputs)
                    input_ids[r, end:stop] = torch.tensor(inputs, dtype=torch.long)
                    positions[r, end:stop] = torch.arange(len(prefix), len(prefix) + len(inputs))
                    units[r, end:stop], branch[r, end:stop] = unit, j
                    spans.append((index, len(targets), len(continuation)))
                    where += [(r, offset + len(prefix) - 1)] + [(r, p) for p in range(end, stop)]
                    targets += continuation
                    end = stop
                offset = end
        mask = None  # one prefix and one continuation a row: right padding under the plain causal mask is harmless
        if any(len(row) > 1 or len(row[0][1]) > 1 for row in rows):
            causal = torch.ones(width, width, dtype=torch.bool).tril()
            same_unit = units[:, :, None] == units[:, None, :]
            visible = (branch[:, None, :] == 0) | (branch[:, :, None] == branch[:, None, :])
            mask = (causal & same_unit & visible)[:, None].to(self.device)
        hidden = self.model.hidden_states(
            input_ids.to(self.device), position_ids=positions.to(self.device), query_key_mask=mask
        )
        rows_at, at = (torch.tensor(x, device=self.device) for x in zip(*where))
        target = torch.tensor(targets, device=self.device)
        logprobs, greedy = [], []
        for chunk in range(0, len(targets), HEAD_CHUNK):
            part = slice(chunk, chunk + HEAD_CHUNK)
            scores = self.model.logits(hidden[rows_at[part], at[part]]).float().log_softmax(-1)
            logprobs.append(scores.gather(-1, target[part, None]).squeeze(-1))
            greedy.append(scores.argmax(-1) == target[part])
        logprob, is_greedy = torch.cat(logprobs).double().cpu(), torch.cat(greedy).cpu()
        return [(index, (float(logprob[s : s + n].sum()), bool(is_greedy[s : s + n].all()))) for index, s, n in spans]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood over disjoint windows of ``max_length`` tokens (lm-eval's perplexity tasks)."""
        windows, owners = [], []
        for index, (text,) in enumerate(request.args for request in requests):
            tokens = self.tok_encode(text)
            for window in lm_utils.get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, 1):
                context, continuation = lm_utils.make_disjoint_window(window)
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm), strict=True):
            totals[owner] += logprob
        return totals

    # --- generation -----------------------------------------------------------------------------------------

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context continued (KV cache) until a stop string, the tokenizer's stop token or ``max_gen_toks``;
        the text is cut before the first stop string, as the hf backend cuts it."""
        batches = Collator(
            [request.args for request in requests],
            sort_fn=lambda args: (-len(self.tok_encode(args[0])), args[0]),
            group_by="gen_kwargs",
            group_fn=lambda args: args[1],
        )
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        results = []
        progress = tqdm(total=len(requests), desc="Generating", disable=disable_tqdm)
        for chunk in batches.get_batched(n=self.batch_size):
            contexts, all_kwargs = zip(*chunk, strict=True)
            kwargs = normalize_gen_kwargs(dict(all_kwargs[0]), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            new_tokens = kwargs.pop("max_gen_toks")
            if new_tokens >= self.max_length:
                raise ConfigError(f"max_gen_toks {new_tokens} leaves no room for a context of {self.max_length}")
            prompts = [self.tok_encode(c)[-(self.max_length - new_tokens) :] for c in contexts]
            for context, text in zip(contexts, self._generate(prompts, until, new_tokens, kwargs), strict=True):
                results.append(text)
                self.cache_hook.add_partial("generate_until", (context, all_kwargs[0]), text)
            progress.update(len(contexts))
        progress.close()
        return batches.get_original(results)

    def _generate(self, prompts: list[list[int]], until: list[str], new_tokens: int, kwargs: dict) -> list[str]:
        window = max((len(s) for s in until), default=0) + 4  # tokens enough to hold any stop string

        def stop_when(tokens: torch.Tensor) -> torch.Tensor:
            tails = tokens[:, -window:].tolist()
            return torch.tensor([any(s and s in self.tok.decode(t) for s in until) for t in tails])

        generator = torch.Generator(self.device).manual_seed(int(kwargs.get("seed", 1234)))
        out = generate(
            self.model,
            prompts,
            max_new_tokens=new_tokens,
            temperature=float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0,
            top_k=kwargs.get("top_k"),
            top_p=kwargs.get("top_p"),
            stop_ids=self.tok.stop_ids,
            pad_id=self.tok.pad_id,
            generator=generator,
            decode=self.decode,
            stop_when=stop_when if until else None,
        )
        texts = [self.tok_decode(row[mask].tolist()) for row, mask in zip(out.tokens, out.mask, strict=True)]
        return [postprocess_generated_text(text, until, None) for text in texts]


def pack_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` packed first-fit-decreasing into rows of at most ``capacity`` tokens (a longer item
    gets a row of its own)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        slot = next((r for r, free in enumerate(room) if free >= lengths[index]), None)
        if slot is None:
            rows.append([index])
            room.append(capacity - lengths[index])
        else:
            rows[slot].append(index)
            room[slot] -= lengths[index]
    return rows


def evaluate(
    lm: LanternLM,
    tasks: Sequence[str | dict],
    manager,
    *,
    num_fewshot: int | None = None,
    limit: int | float | None = None,
    apply_chat_template: bool = False,
    confirm_run_unsafe_code: bool = False,
    log_samples: bool = False,
    seed: int = 1234,
) -> dict:
    """lm-eval's ``simple_evaluate`` of ``tasks`` (``resolve_tasks``' names and configs): its results dict
    (per-task metrics with standard errors, the config, per-request samples when ``log_samples``)."""
    from lm_eval import simple_evaluate

    return simple_evaluate(
        model=lm,
        tasks=list(tasks),
        task_manager=manager,
        num_fewshot=num_fewshot,
        limit=limit,
        apply_chat_template=apply_chat_template,
        fewshot_as_multiturn=apply_chat_template and bool(num_fewshot),
        confirm_run_unsafe_code=confirm_run_unsafe_code,
        log_samples=log_samples,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
    )


def flat_metrics(results: dict) -> dict[str, float]:
    """lm-eval's per-task and per-group numbers as ``TASK/METRIC`` (``acc``, ``acc_stderr``; a filter other than
    ``none`` after an underscore): how they are logged."""
    return {
        f"{task}/{name.replace(',none', '').replace(',', '_')}": float(value)
        for table in ("results", "groups")
        for task, values in (results.get(table) or {}).items()
        for name, value in values.items()
        if "," in name and isinstance(value, (int, float)) and not isinstance(value, bool)  # lm-eval's METRIC,FILTER
    }
