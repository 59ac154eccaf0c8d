#!/usr/bin/env bash
# The one GPU check, from a source checkout with nothing installed: `grpo-fast doctor`, the gpu-marked tests, the
# micro benchmarks (bench/micro, when present), the loss head measured against the cost model's projection, the loss,
# shared-prefix and memory benchmarks and the trainer on CUDA, then one summary line per step (its exit status and
# seconds) and the head's table of measured vs projected. Results and one log per step go to $OUT (default
# bench/results/gpu); every benchmark writes each CSV row as soon as it finishes, so a step cut by its timeout keeps
# its finished rows. Exit status 1 when any step failed or timed out.
#
# Needs only python3 with torch, triton, transformers and pytest (liger-kernel and pytest-benchmark are used when
# there, skipped when not) and Python >= 3.11. Nothing is installed: grpo-fast maps `grpo_fast.kernels` to the
# top-level kernels/ folder (setuptools package-dir), so a plain PYTHONPATH=. cannot import it. A link farm does:
# a temporary copy of grpo_fast/ made of symlinks, with kernels/ linked in as grpo_fast/kernels, first on PYTHONPATH,
# and PYTHONSAFEPATH=1 so that `python -m ...` run from the checkout (this script, bench/harness.py's child processes)
# does not put the checkout's own grpo_fast/ in front of it.
#
# Budget (tests/test_gpu_check.py holds it): step timeouts 10+30+45+97+25+40+25+55+40+30+40 = 437 s, plus 3 s of kill
# grace for each of the 11 steps = 470 s, within 8 minutes (480 s) even if every step runs into its timeout.
#
#   bash bench/gpu_check.sh                # the whole check (OUT=dir to choose where results go)
#   bash bench/gpu_check.sh --setup-only   # only the link farm and its import check (runs on a CPU)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
HEAD_MD=$OUT/head_gpu.md  # the head step's table, shown after the summary: none left over from an earlier run
rm -f "$HEAD_MD"
PY=${PYTHON:-python3}
GRACE=3  # seconds between the timeout's SIGTERM and its SIGKILL
SETUP_ONLY=0
[ "${1:-}" = "--setup-only" ] && SETUP_ONLY=1
start=$(date +%s)
SUMMARY=()
FAILED=0
LAST_RC=0

# step NAME SECONDS COMMAND...: COMMAND under a timeout (its whole process group), output in $OUT/NAME.log, the tail
# printed; one summary line with its exit status (124: timed out) and elapsed seconds.
step() {
  local name=$1 secs=$2 t0 rc cmd
  shift 2
  cmd="$*"
  cmd=${cmd//$'\n'/ }
  echo "== $name (timeout ${secs} s): ${cmd:0:200}"
  t0=$(date +%s)
  timeout -k "$GRACE" "$secs" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  LAST_RC=$rc
  tail -n 15 "$OUT/$name.log"
  [ "$rc" -ne 0 ] && FAILED=1
  SUMMARY+=("$(printf '%-10s rc=%-4s %4d s   %s' "$name" "$rc" $(($(date +%s) - t0)) "$OUT/$name.log")")
}

skipped() {  # skipped NAME REASON: a summary line for a step that did not run
  echo "== $1: skipped ($2)"
  SUMMARY+=("$(printf '%-10s %-8s %4s     %s' "$1" "skipped" "" "$2")")
}

summary() {
  echo
  echo "== summary: $(($(date +%s) - start)) s in all; results and logs in $OUT"
  printf '%s\n' "${SUMMARY[@]}"
  if [ -f "$HEAD_MD" ]; then
    echo
    echo "== the loss head, measured vs projected by bench/cost_model.py (rows: $OUT/head_gpu.csv)"
    cat "$HEAD_MD"
  fi
}

# ---- the link farm: grpo_fast/ as symlinks (their resolved paths stay in the checkout), kernels/ as grpo_fast/kernels
FARM=$(mktemp -d "${TMPDIR:-/tmp}/grpo_fast_src.XXXXXX")
trap 'rm -rf "$FARM"' EXIT
mkdir "$FARM/grpo_fast"
cp -rs "$ROOT/grpo_fast/." "$FARM/grpo_fast/"
find "$FARM/grpo_fast" -name __pycache__ -prune -exec rm -rf {} +
ln -s "$ROOT/kernels" "$FARM/grpo_fast/kernels"
export PYTHONPATH="$FARM:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONSAFEPATH=1

if [ "$SETUP_ONLY" = 0 ]; then
  step device 10 nvidia-smi
fi
# the set-up check: versions, and grpo_fast.kernels imported from the farm here and in a benchmark's child process
cat >"$FARM/setup_check.py" <<'PYTHON'
import sys

farm = sys.argv[1]
if sys.version_info < (3, 11):
    sys.exit(f"gpu_check.sh needs Python >= 3.11 (PYTHONSAFEPATH), got {sys.version.split()[0]}")
import pytest, torch, transformers, triton

import bench.harness
import grpo_fast.kernels

child = bench.harness.run_isolated("bench.harness:child_imports", {"modules": ["grpo_fast.kernels"]}, timeout=240)
for where, path in [("here", grpo_fast.kernels.__file__), ("in a benchmark child", child["grpo_fast.kernels"])]:
    print(f"grpo_fast.kernels {where}: {path}")
    if not path.startswith(farm + "/"):
        sys.exit(f"grpo_fast.kernels {where} came from {path}, not from the link farm {farm}")
print("bench:", bench.harness.__file__)
print("torch", torch.__version__, "CUDA", torch.cuda.is_available(), "| triton", triton.__version__,
      "| transformers", transformers.__version__, "| pytest", pytest.__version__)
if "--need-cuda" in sys.argv and not torch.cuda.is_available():
    sys.exit("torch sees no CUDA device: nothing to check here")
PYTHON
SETUP_S=30
[ "$SETUP_ONLY" = 1 ] && SETUP_S=300  # run alone (on a CPU, by the tests): outside the GPU budget
step setup "$SETUP_S" "$PY" "$FARM/setup_check.py" "$FARM" $([ "$SETUP_ONLY" = 0 ] && echo --need-cuda)
has() {  # has MODULE: whether python can import MODULE (found without importing it)
  "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)" >/dev/null 2>&1
}
if has liger_kernel; then
  LIGER="liger liger_triton"
else
  LIGER=""
  echo "liger-kernel is not installed: the loss benchmark runs without its two implementations"
fi
echo "loss benchmark implementations: triton reference $LIGER matmul"
if [ "$SETUP_ONLY" = 1 ] || [ "$LAST_RC" != 0 ]; then  # set-up only, or a set-up the checks cannot run on
  summary
  exit "$FAILED"
fi

# ---- the checks, cheapest and most telling first
step doctor 45 "$PY" -m grpo_fast doctor --budget 25 --json "$OUT/doctor.json"

# every gpu-marked test (the kernels on the GPU, the loss kernel's reduced option grid, the bf16 shared-prefix forward)
step gpu_tests 97 "$PY" -m pytest -q -p no:cacheprovider -m gpu -rfEs --continue-on-collection-errors \
  --junitxml="$OUT/gpu_tests.xml" tests/

# the micro benchmarks at both sizes, one step each (pytest-benchmark writes its JSON at the end: a step cut by its
# timeout keeps nothing, so the small size is not put at risk by the large one)
if [ ! -d bench/micro ]; then
  skipped micro_small "no bench/micro in this checkout"; skipped micro_large "no bench/micro in this checkout"
elif ! has pytest_benchmark; then
  skipped micro_small "pytest-benchmark is not installed"; skipped micro_large "pytest-benchmark is not installed"
else
  step micro_small 25 "$PY" -m pytest -q -p no:cacheprovider bench/micro -k small --benchmark-max-time=0.2 \
    --benchmark-group-by=group --benchmark-json "$OUT/micro_small.json"
  step micro_large 40 "$PY" -m pytest -q -p no:cacheprovider bench/micro -k large --benchmark-max-time=0.2 \
    --benchmark-group-by=group --benchmark-json "$OUT/micro_large.json"
fi

# the loss head alone against the cost model (bench/bench_head.py): fused_logprobs (triton) forward+backward and the
# three bare lm_head GEMMs in one process, bf16, H=4096, V=151936, N=4096 and 16384, each next to its projection for
# the profile matching this GPU; a shape that would end past --budget-s is not started
step head 25 "$PY" -m bench.bench_head --warmup 2 --reps 5 --budget-s 15 --csv "$OUT/head_gpu.csv" --md "$HEAD_MD"

# grpo_loss fwd+bwd, bf16, N=16384, H=4096, V=151936: triton vs the materialised reference (vs Liger) vs the bare
# matmuls; one process checks every loss against the float64 oracle first, then one process per implementation
step loss 55 "$PY" -m bench.bench_loss --device cuda --dtype bf16 --n 16384 --batch 8 --h 4096 --vocab 151936 \
  --warmup 2 --reps 5 --timeout 40 --impls triton reference $LIGER matmul --csv "$OUT/loss_gpu.csv"

# shared-prefix training step (shared vs unshared forward), bf16, H=1024, 8 layers, P:C 8:1 and 1:8 of 512 tokens, G 8
step prefix 40 "$PY" -m bench.bench_prefix --device cuda --dtype bf16 --hidden 1024 --layers 8 --groups 2 \
  --ratios 8:1 1:8 --group-sizes 8 --warmup 2 --reps 5 --timeout 20 --csv "$OUT/prefix_gpu.csv"

# the trainer on the default task, Triton kernel path; --rewards exact: the GPU image has no math-verify
step train 30 "$PY" -m grpo_fast train --device cuda --steps 50 --rewards exact --output-dir "$OUT/train" \
  --progress false

# GRPO vs PPO memory, one training step per configuration in its own process (bf16, 8 layers, H=1024, V=151936)
step memory 40 "$PY" -m bench.bench_memory --device cuda --dtype bfloat16 --layers 8 --hidden 1024 \
  --intermediate 2816 --heads 16 --kv-heads 4 --vocab 151936 --prompts 2 --group-size 8 --prompt-len 128 \
  --completion-len 256 --reps 2 --timeout 25 --configs ppo grpo_reference grpo_fused grpo_shared \
  --csv "$OUT/memory_gpu.csv"

summary
exit "$FAILED"
