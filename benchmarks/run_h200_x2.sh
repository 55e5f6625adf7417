#!/usr/bin/env bash
# Everything this project measures on a 2 x H200 machine, in one go (device time is scarce):
# 2-GPU benchmarks (1.3B and 14B shapes), the VSA kernel benchmark, the NCCL bf16 correctness tests,
# and the main job with --check on the GPUs. Each step has its own time limit so that a
# slow step cannot starve the others; logs and JSON go to $OUT (default ./bench_out).
set -u
OUT=${OUT:-bench_out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, diffusers; print('torch', torch.__version__, 'diffusers', diffusers.__version__)" >> "$OUT/gpu.txt"
step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  echo "=== $name ($(date -u +%H:%M:%S))"
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1; echo "=== $name exit $?"
  tail -n 25 "$OUT/$name.log"
}
step bench2_13b 170 torchrun --nproc-per-node 2 benchmarks/bench_transformer.py --cases 1.3b --no-compile \
  --no-stock-variants --json "$OUT/bench2_13b.json"
step bench2_14b 150 torchrun --nproc-per-node 2 benchmarks/bench_transformer.py --cases 14b --no-compile \
  --no-stock-variants --no-sdpa-report --json "$OUT/bench2_14b.json"
step vsa_kernel 90 python3 benchmarks/bench_vsa_kernel.py --json "$OUT/vsa.json"
step nccl_tests 80 python3 -m pytest -q tests/test_gpu_nccl.py
step main_job 60 accelerate launch --config_file examples/accelerate_gpu.yaml --num_processes 2 \
  examples/generate_video.py --check --output "$OUT/video.gif"
# One GPU: processor overhead, kernel choice and torch.compile (RESULTS.md, first session):
#   torchrun --nproc-per-node 1 benchmarks/bench_transformer.py --cases 1.3b --compile-modes kv_gather
# Collectives alone: torchrun --nproc-per-node 2 benchmarks/bench_collectives.py
