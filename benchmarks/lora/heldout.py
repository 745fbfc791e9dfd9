"""``bench_lora heldout``: the demo pipeline's full SFT and LoRA SFT runs at several settings, every model scored
on the same 400 held-out prompts (greedy and sampled, paired with full SFT), and each model's loss on the answers'
end-of-turn token and on the other tokens."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.lora.params import count_preset

ROOT = Path(__file__).resolve().parents[2]


def parse_lora(spec: str) -> dict[str, Any]:
    """NAME:RANK:ALPHA:LR, e.g. lora-r16:16:32:1e-2."""
    try:
        name, rank, alpha, lr = spec.split(":")
        return {"name": name, "rank": int(rank), "alpha": float(alpha), "lr": float(lr)}
    except ValueError:
        raise SystemExit(f"--lora expects NAME:RANK:ALPHA:LR, got {spec!r}") from None


def timed(cmd: list[str], log: Path) -> float:
    print("$ " + " ".join(cmd), flush=True)
    start = time.perf_counter()
    with log.open("w") as handle:
        status = subprocess.run(cmd, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT).returncode
    if status:
        raise SystemExit(f"exit {status}: see {log}")
    return time.perf_counter() - start


def run_heldout(args: argparse.Namespace) -> dict[str, Any]:
    pipeline = Path(args.pipeline).resolve()
    lora_root = Path(args.lora_dir).resolve() if args.lora_dir else pipeline.parent / "lora"
    lora_root.mkdir(parents=True, exist_ok=True)
    lantern = [sys.executable, "-m", "alignment.commands.cli"]
    walls: dict[str, float] = {}
    if not (pipeline / "sft" / "final" / "lantern.json").is_file():
        pipeline.parent.mkdir(parents=True, exist_ok=True)
        walls["pipeline (prepare, pretrain, full sft)"] = timed(
            [
                *lantern,
                "pipeline",
                args.config,
                "stages=[prepare,pretrain,sft]",
                f"out_dir={pipeline}",
                "logger.kind=csv",
            ],
            pipeline.parent / "pipeline.log",
        )
    sft_config = pipeline / "sft" / "config.yaml"
    models, settings = {}, {}
    for lora in map(parse_lora, args.lora):
        run = lora_root / lora["name"]
        settings[lora["name"]] = lora
        if not (run / "final" / "lantern.json").is_file():
            walls[lora["name"]] = timed(
                [
                    *lantern,
                    "sft",
                    str(sft_config),
                    f"run.out_dir={lora_root}",
                    f"run.name={lora['name']}",
                    "peft.kind=lora",
                    f"peft.rank={lora['rank']}",
                    f"peft.alpha={lora['alpha']}",
                    f"optim.lr={lora['lr']}",
                    f"optim.min_lr={lora['lr'] / 10}",
                    "logger.kind=csv",
                ],
                lora_root / f"{lora['name']}.log",
            )
        models[lora["name"]] = run / "final"
    start = time.perf_counter()
    scored = score_beside_sft(args.config, pipeline, models)
    walls["scoring"] = time.perf_counter() - start
    finals = {"base": pipeline / "pretrain" / "final", "sft": pipeline / "sft" / "final", **models}
    full = load_yaml(sft_config)
    losses = answer_losses(pipeline / "data" / "demo" / "val.jsonl", full["data"]["tokenizer"], finals)
    trained = {"sft": count_preset(full["model"], 16, 32.0)["base_params"]}
    trained.update(
        {name: count_preset(full["model"], s["rank"], s["alpha"])["lora_params"] for name, s in settings.items()}
    )
    report = json.loads((pipeline / "report.json").read_text()) if (pipeline / "report.json").is_file() else {}
    stage_seconds = {stage: r.get("seconds") for stage, r in report.get("stages", {}).items()}
    return {
        "full_lr": full["optim"]["lr"],
        # training time of each run, from its folder (config.yaml written at the start, final/ at the end), so that
        # runs made by an earlier invocation keep theirs; the pipeline's stages as its report has them
        "run_seconds": {"pretrain": stage_seconds.get("pretrain"), "sft": stage_seconds.get("sft")}
        | {name: folder_seconds(path.parent) for name, path in models.items()},
        "trained_params": trained,
        "pipeline": str(pipeline),
        "lora_runs": str(lora_root),
        "settings": settings,
        "wall_seconds": walls,
        "heldout_prompts": scored["heldout_prompts"],
        "results": scored["results"],
        "answer_loss": losses,
    }


def score_beside_sft(config_path: str, pipeline: Path, models: dict[str, Path]) -> dict[str, Any]:
    """benchmarks/score_models.py's scoring (the pipeline report's: greedy and sampled accuracy, pass@k, each model
    paired with the pipeline's SFT model), with each model's result cached in its folder's parent under the
    folder's fingerprint, so that an interrupted run scores only what is left."""
    from alignment.commands.pipeline_eval import compare_with, evaluate_stage, scoring_inputs, without_per_prompt
    from alignment.shared.evaluation import json_safe
    from benchmarks.score_models import pipeline_at
    from models.files.digests import content_key, folder_fingerprint

    runner = pipeline_at(config_path, pipeline, [])
    config = runner.config
    sft, tokenizer, prompts = scoring_inputs(runner)  # refuses demo data written with other settings
    results = {}
    for name, path in {"sft": sft, **models}.items():
        cache = path.parent / "bench_lora_score.json"
        key = content_key(folder_fingerprint(path), folder_fingerprint(sft), runner.demo_hash, str(config.report))
        cached = json.loads(cache.read_text()) if cache.is_file() else {}
        if cached.get("key") == key:
            results[name] = cached["result"]
            continue
        results[name] = json_safe(
            evaluate_stage(config.report, name, path, prompts, tokenizer, None if name == "sft" else sft)
        )
        cache.write_text(json.dumps({"key": key, "result": results[name]}) + "\n")
    compare_with(results, "sft", "vs_sft")
    return {
        "heldout_prompts": len(prompts),
        "results": {name: without_per_prompt(result) for name, result in results.items()},
    }


def answer_losses(val: Path, tokenizer_spec: str, finals: dict[str, Path], limit: int = 400) -> dict[str, Any]:
    """Each model's mean loss (nats) on the supervised tokens of the demo's val conversations, split into the
    end-of-turn token (<|eot_id|>: a token pretraining never saw, whose embedding and LM-head row LoRA cannot change)
    and the answers' other tokens."""
    import torch

    from data.tokenizer.tokenizer import Tokenizer
    from models.formats.checkpoint import load_checkpoint

    tokenizer = Tokenizer.load(tokenizer_spec)
    rows = [json.loads(line) for line in val.read_text().splitlines()[:limit]]
    encoded = [tokenizer.encode_chat(row["messages"]) for row in rows]
    result = {}
    for name, path in finals.items():
        model = load_checkpoint(path, dtype=torch.float32).eval()
        sums = {"eot": [0.0, 0], "other": [0.0, 0]}
        with torch.no_grad():
            for ids, mask in encoded:
                ids = torch.tensor(ids[: model.config.max_seq_len + 1])
                supervised = torch.tensor(mask[: len(ids)])[1:]
                targets = ids[1:]
                nll = -torch.log_softmax(model(ids[None, :-1])[0], -1).gather(-1, targets[:, None])[:, 0]
                for key, where in (("eot", targets == tokenizer.eot_id), ("other", targets != tokenizer.eot_id)):
                    sums[key][0] += float(nll[supervised & where].sum())
                    sums[key][1] += int((supervised & where).sum())
        result[name] = {key: {"loss": total / max(n, 1), "tokens": n} for key, (total, n) in sums.items()}
    return result


def folder_seconds(run: Path) -> float:
    return (run / "final" / "lantern.json").stat().st_mtime - (run / "config.yaml").stat().st_mtime


def load_yaml(path: Path) -> dict[str, Any]:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)


# ---------------------------------------------------------------------------------------------------------


def print_heldout(result: dict[str, Any]) -> None:
    print("\nloss on the val answers' supervised tokens (nats): <|eot_id|> / the other tokens")
    for name, parts in result.get("answer_loss", {}).items():
        print(f"  {name:<16}{parts['eot']['loss']:>7.2f} / {parts['other']['loss']:.2f}")
    print(f"\n{result['heldout_prompts']} held-out prompts; every model paired with the full SFT model (2-SE verdict)")
    print(f"{'model':<16}{'rank':>5}{'lr':>8}{'trained':>11}  {'greedy':<15}{'vs full SFT':<36}"
          f"{'sampled':<15}{'vs full SFT':<36}{'train s':>8}")  # fmt: skip
    for name, r in result["results"].items():
        setting = result["settings"].get(name, {"rank": "-", "lr": result.get("full_lr", "-")})
        trained = result.get("trained_params", {}).get(name) or 0
        print(
            f"{name:<16}{setting['rank']!s:>5}{setting['lr']!s:>8}{trained:>11,}  {fmt(r.get('heldout')):<15}"
            f"{paired(r.get('vs_sft')):<36}{fmt(r.get('sampled')):<15}{paired(r.get('vs_sft_sampled')):<36}"
            f"{result.get('run_seconds', {}).get(name) or 0:>8.0f}"
        )


def fmt(summary: dict[str, Any] | None) -> str:
    return "-" if not summary else f"{summary['accuracy']:.3f} ± {summary['se']:.3f}"


def paired(comparison: dict[str, Any] | None) -> str:
    if not comparison:
        return "-"
    return f"{comparison['difference']:+.3f} ± {comparison['se']:.3f} {comparison['verdict']}"
