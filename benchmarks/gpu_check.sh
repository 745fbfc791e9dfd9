#!/usr/bin/env bash
# The GPU check anyone can run, on a bare CUDA machine that has Python with a CUDA torch but no network:
#   1. install   a venv that reuses the machine's torch (--system-site-packages), Lantern installed editable
#                from this checkout with its dependencies from wheels carried beside it (--no-index)
#   2. tests     the whole test suite (pytest; the CUDA-only tests run instead of being skipped)
#   3. pipeline  the default pipeline end to end on the GPU (configs/pipeline/default.yaml, bf16)
#   4. pretrain  the pretraining benchmark: Lantern's Lightning path vs a plain loop vs Hugging Face compiled,
#                Llama 3.2 1B, seq 2048 x 4, bf16, in one run (pretrain-1b.json)
#   5. pretrain-3b  3B with FSDP2 + full activation checkpointing on the one GPU (pretrain-3b.json)
#   6. generation  the KV-cache generation benchmark, 1B in bf16, batch 1 and 64 (generation.json)
#   7. one markdown table (benchmarks/gpu_table.py): each step's result, MFU, tokens/s and peak memory, the
#      date and the GPU, printed and written to OUT/table.md; beside each Lightning run's peak memory
#      (torch.cuda.max_memory_allocated), the peak `lantern plan` predicted for it (docs/plan.md)
# A failed step is reported and the others still run; the exit status is non-zero if any step failed.
#
# Usage (from anywhere; the paths are relative to the checkout):
#   bash benchmarks/gpu_check.sh [--wheels DIR] [--venv DIR] [--out DIR] [--no-install] [--cpu-smoke]
#                                [--steps LIST] [-- PYTEST ARGS]
#   --wheels DIR   wheel folder (default: .whl/ in the checkout; git ignores it)
#   --venv DIR     venv to create or reuse (default: .venv-gpu-check/ in the checkout)
#   --no-install   use the venv as it is (it must already have Lantern and its test extra)
#   --out DIR      results (default: runs/gpu-check/UTC-TIMESTAMP)
#   --steps LIST   comma-separated subset of: tests,pipeline,pretrain,pretrain-3b,generation (default: all)
#   --cpu-smoke    the same steps on CPU with tiny sizes (tiny models, a few steps, a few test files), to check
#                  the script itself on a machine without a GPU
#   -- ARGS        arguments for pytest instead of the default (the whole suite; in --cpu-smoke one quick file)
#
# Making the wheel folder, on a machine WITH network, same CPU architecture and Python minor version as the
# GPU machine (torch itself is not carried: the GPU machine's CUDA build is used):
#   python3 -m venv /tmp/wheel-env && . /tmp/wheel-env/bin/activate
#   pip install torch --index-url https://download.pytorch.org/whl/cpu   # only to resolve the other deps
#   pip install ".[test]"                                                # from the checkout
#   pip list --format=freeze --exclude-editable | grep -viE '^(torch|triton|nvidia-|lantern|pip|setuptools|wheel)=' > /tmp/lantern-requirements.txt
#   pip download --no-deps -d .whl -r /tmp/lantern-requirements.txt
#   pip download -d .whl "setuptools>=68" wheel                         # the editable install's build backend
#   pip wheel --no-deps -w .whl .                                        # the project itself, for machines without the checkout
# From another platform add to both downloads: --only-binary=:all: --python-version 3.12 --implementation cp
#   --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
# Then copy the checkout with its .whl/ folder to the GPU machine and run this script there.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELS="$ROOT/.whl"
VENV="$ROOT/.venv-gpu-check"
OUT=""
INSTALL=1
SMOKE=0
STEPS="tests,pipeline,pretrain,pretrain-3b,generation"
PYTEST_ARGS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --wheels) WHEELS="$(cd "$2" && pwd)" || exit 2; shift 2 ;;
    --venv) VENV="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --steps) STEPS="$2"; shift 2 ;;
    --no-install) INSTALL=0; shift ;;
    --cpu-smoke) SMOKE=1; shift ;;
    --) shift; PYTEST_ARGS=("$@"); break ;;
    -h|--help) sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
for step in ${STEPS//,/ }; do
  case "$step" in tests|pipeline|pretrain|pretrain-3b|generation) ;;
    *) echo "gpu_check.sh: --steps: unknown step '$step' (tests,pipeline,pretrain,pretrain-3b,generation)" >&2; exit 2 ;;
  esac
done
[[ $VENV == /* ]] || VENV="$PWD/$VENV"  # relative to where the script was started
OUT="${OUT:-$ROOT/runs/gpu-check/$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"
cd "$ROOT" || exit 2
# No network at run time: every library must work offline; W&B runs are written locally.
export WANDB_MODE=offline HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
: >"$OUT/steps.tsv"
FAILED=0

# record STEP STATUS SECONDS DETAIL: one line of steps.tsv, which gpu_table.py reads
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$OUT/steps.tsv"; [[ "$2" == 0 || "$2" == skip ]] || FAILED=1; }

# run STEP TIMEOUT COMMAND...: runs it with its output shown and kept in OUT/STEP.log
run() {
  local step="$1" limit="$2" start status
  shift 2
  if [[ ",$STEPS," != *",$step,"* ]]; then record "$step" skip "" "not in --steps"; return; fi
  echo "=== $step: $*" | tee "$OUT/$step.log"
  start=$(date +%s)
  timeout --signal=TERM --kill-after=60 "$limit" "$@" 2>&1 | tee -a "$OUT/$step.log"
  status=${PIPESTATUS[0]}
  [[ $status == 124 ]] && echo "=== $step: stopped after ${limit}s" | tee -a "$OUT/$step.log"
  record "$step" "$status" "$(( $(date +%s) - start ))" "log: $step.log"
}

# ---- 1. install ----
PY="$VENV/bin/python"
start=$(date +%s)
if [[ $INSTALL == 1 ]]; then
  (
    set -e
    if [[ ! -x "$PY" ]]; then
      python3 -m venv --system-site-packages "$VENV"
      # When python3 is itself a venv (common on GPU images), --system-site-packages reaches only the base
      # interpreter's packages: point the new venv at the parent's site-packages too, so its CUDA torch is found.
      python3 -c 'import site; print("\n".join(site.getsitepackages()))' >"$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/lantern-parent-site.pth"
    fi
    [[ -d "$WHEELS" ]] || { echo "no wheel folder $WHEELS (see the top of this script for how to make it)"; exit 1; }
    # --no-index: nothing from the network; packages the machine already has (torch) are kept.
    "$PY" -m pip install --no-index --find-links "$WHEELS" -e "$ROOT[test]"
  ) 2>&1 | tee "$OUT/install.log"
  status=${PIPESTATUS[0]}
else
  status=0
fi
# the packages the steps import, imported from outside the checkout (so from the venv, not the working tree)
if [[ $status == 0 ]] && ! (cd / && "$PY" -c 'import alignment.commands.cli, transformers, pytest') >>"$OUT/install.log" 2>&1; then
  echo "=== install: $PY cannot import Lantern, transformers and pytest" | tee -a "$OUT/install.log"
  status=1
fi
record install "$status" "$(( $(date +%s) - start ))" "$([[ $INSTALL == 1 ]] && echo "log: install.log" || echo "--no-install: $VENV as it is")"
if [[ $status != 0 ]]; then
  "$PY" -m benchmarks.gpu_table "$OUT" 2>/dev/null || cat "$OUT/steps.tsv"
  exit 1
fi

# ---- environment (date, GPU, versions), for the table ----
MODE=$([[ $SMOKE == 1 ]] && echo cpu-smoke || echo gpu)
"$PY" - "$OUT/env.json" "$MODE" "$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)" <<'EOF'
import json, sys, time
import torch
path, mode, commit = sys.argv[1:]
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
env = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gpu": gpu, "torch": torch.__version__,
       "cuda": torch.version.cuda, "mode": mode, "commit": commit}
open(path, "w").write(json.dumps(env, indent=2))
print(f"=== {env['date']}: {gpu}, torch {env['torch']} (CUDA {env['cuda']}), mode {mode}, commit {commit}")
EOF
if [[ $SMOKE == 0 ]] && ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "=== no CUDA device visible to $PY (torch $("$PY" -c 'import torch; print(torch.__version__)')); use --cpu-smoke to check the script on CPU" >&2
  record cuda 1 0 "torch.cuda.is_available() is False"
  "$PY" -m benchmarks.gpu_table "$OUT"
  exit 1
fi

# ---- sizes: the real ones on the GPU, tiny ones for --cpu-smoke ----
LANTERN="$VENV/bin/lantern"
if [[ $SMOKE == 1 ]]; then
  ACCEL=cpu
  [[ ${#PYTEST_ARGS[@]} == 0 ]] && PYTEST_ARGS=(-q -n 0 -m "not slow" tests/trainer/test_optim.py)
  PIPELINE=configs/pipeline/tiny.yaml
  PIPELINE_STAGES=("stages=[prepare,pretrain,sft]")  # the script's plumbing; tests/ runs the whole tiny pipeline
  BENCH=(--device cpu --config configs/pretrain/tiny.yaml --seq-len 64 --micro-batch 4 --steps 2 --warmup 1
         --threads 1 --peak-size 256 --peak-seconds 0.05)
  BENCH_1B=(--precision 32-true)
  BENCH_3B=(--precision bf16-mixed)
  GENERATION=(--device cpu --dtype float32 --preset tiny --batch-sizes 1,4 --new-tokens 8 --modes eager,static
              --repeats 1 --threads 1)
else
  ACCEL=gpu
  [[ ${#PYTEST_ARGS[@]} == 0 ]] && PYTEST_ARGS=(-q)
  PIPELINE=configs/pipeline/default.yaml
  PIPELINE_STAGES=()
  ONE_GPU=configs/pretrain/llama3.2-1b-1gpu.yaml
  if [[ -f $ONE_GPU ]]; then  # the single-GPU preset as it is (seq 2048 x 4, bf16, compile)
    BENCH=(--device cuda --config "$ONE_GPU")
    BENCH_1B=()
  else  # the 8-GPU preset brought down to one GPU
    BENCH=(--device cuda --config configs/pretrain/llama3.2-1b.yaml --seq-len 2048 --micro-batch 4
           --override trainer.compile=true trainer.init_device=cpu)
    BENCH_1B=(--precision bf16-mixed --override trainer.activation_checkpointing=none)
  fi
  BENCH+=(--steps 20 --warmup 5)
  BENCH_3B=(--preset llama3.2-3b --seq-len 2048 --micro-batch 4 --precision bf16-mixed)
  GENERATION=(--device cuda --dtype bfloat16 --preset llama3.2-1b --batch-sizes 1,64)
fi
STAGE_OVERRIDES=()  # the pipeline's GPU overrides: every model stage on the accelerator under test
for stage in pretrain sft rm ppo; do STAGE_OVERRIDES+=("$stage.trainer.accelerator=$ACCEL"); done

# ---- 2-6 ----
run tests 5400 "$PY" -m pytest "${PYTEST_ARGS[@]}" --junitxml="$OUT/pytest.xml"
run pipeline 5400 "$LANTERN" pipeline "$PIPELINE" "out_dir=$OUT/pipeline" "${PIPELINE_STAGES[@]}" "${STAGE_OVERRIDES[@]}"
run pretrain 2400 "$PY" -m benchmarks.bench_pretrain "${BENCH[@]}" "${BENCH_1B[@]}" --json "$OUT/pretrain-1b.json"
run pretrain-3b 2400 "$PY" -m benchmarks.bench_pretrain "${BENCH[@]}" "${BENCH_3B[@]}" --fsdp-ac --json "$OUT/pretrain-3b.json"
run generation 2400 "$PY" -m benchmarks.bench_generation "${GENERATION[@]}" --json "$OUT/generation.json"

# ---- 7. the table ----
echo
"$PY" -m benchmarks.gpu_table "$OUT" || FAILED=1
echo "results: $OUT"
exit $FAILED
