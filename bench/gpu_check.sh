#!/usr/bin/env bash
# The one GPU check: CUDA tests of the Triton kernels, then the GPU benchmarks, then a short results table.
# Installs nothing from the network (only grpo-fast itself, in place, so that `grpo_fast.kernels` maps to kernels/);
# expects torch, triton and transformers on the machine (liger-kernel optional: its rows then record the error).
# Budget: under 10 minutes on one H200 even if every step runs into its timeout (150 + 130 + 90 + 60 + 150 s), which
# leaves room for the machine's start-up within a 15-minute device allowance.
# Results go to $OUT (default bench/results/gpu).
#   bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
start=$(date +%s)
python -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1 \
  || echo "note: in-place install failed (see $OUT/install.log); kernels may not import"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"

echo "== CUDA tests (kernels on the GPU, bf16, V=151936 / N=65553; the shared-prefix forward in bf16, SDPA and FlexAttention)"
timeout 150 python -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_logprobs_torch.py \
  tests/test_shared_prefix.py::test_cuda_bfloat16_within_the_tolerance_rule -k "not peak_memory" 2>&1 \
  | tee "$OUT/tests.log" | tail -5
tests_rc=${PIPESTATUS[0]}

echo "== GPU benchmark: grpo_loss fwd+bwd, bf16, H=4096"
bench_rc=0
for n in 16384; do
  # triton vs the materialised reference vs Liger (chunked, and its Triton loss on logits) vs the bare matmuls
  timeout 130 python -m bench.bench_loss --device cuda --dtype bf16 --n "$n" --batch 8 --h 4096 \
    --vocab 128256 151936 --warmup 2 --reps 5 --timeout 60 \
    --impls triton reference liger liger_triton matmul --csv "$OUT/loss_gpu_n$n.csv" 2>&1 \
    | tee "$OUT/bench_n$n.log" | tail -13
  rc=${PIPESTATUS[0]}; [ "$rc" -ne 0 ] && bench_rc=$rc
done

echo "== GPU benchmark: shared-prefix training step (shared vs unshared forward), bf16, H=1024, 8 layers"
# P:C 8:1, 1:1, 1:8 of 512 tokens x G 4, 16; one process per configuration, each checks the fp32 losses first
timeout 90 python -m bench.bench_prefix --device cuda --dtype bf16 --hidden 1024 --layers 8 --groups 2 \
  --warmup 2 --reps 5 --timeout 40 --csv "$OUT/prefix_gpu.csv" 2>&1 | tee "$OUT/bench_prefix.log" | tail -10
prefix_rc=${PIPESTATUS[0]}

echo "== trainer on CUDA: the default task, bf16, Triton kernel path, 100 steps"
# --rewards exact (exact match of the digit answer): the GPU image has no math-verify
timeout 60 python -m grpo_fast train --device cuda --steps 100 --rewards exact --output-dir "$OUT/train" --progress false \
  2>&1 | tee "$OUT/train.log" | grep -E "kernel path|grpo-fast:|Error|error"
train_rc=${PIPESTATUS[0]}

echo "== GPU memory: GRPO vs PPO, one training step per configuration (bf16, 8 layers, H=1024, V=151936, 2 x 8 x 256 tokens)"
# one fresh process per configuration; components from the storage tracker, totals also from torch.cuda.max_memory_allocated
timeout 150 python -m bench.bench_memory --device cuda --dtype bfloat16 --layers 8 --hidden 1024 --intermediate 2816 \
  --heads 16 --kv-heads 4 --vocab 151936 --prompts 2 --group-size 8 --prompt-len 128 --completion-len 256 --reps 2 \
  --timeout 60 --csv "$OUT/memory_gpu.csv" 2>&1 | tee "$OUT/bench_memory.log" | tail -9
memory_rc=${PIPESTATUS[0]}

echo "== summary ($(($(date +%s) - start)) s): tests rc=$tests_rc, bench rc=$bench_rc, prefix rc=$prefix_rc, train rc=$train_rc, memory rc=$memory_rc; files in $OUT"
