#!/usr/bin/env bash
# What this project checks and measures on a one-H200 machine, in one device call (about 9 minutes):
#   OUT=dir bash benchmarks/run_h200.sh
# GPU tests (the CUDA kernels; the two-GPU NCCL cases skip), the video and image jobs with --check
# on CUDA, one transformer step at world size 1 against stock (the cost of the hooks and processors),
# and First Block Cache with and without sequence parallelism at world size 1
# (benchmarks/bench_cache.py; the decision's collective needs 2 GPUs to cost anything). Each step has
# its own time limit; logs and JSON go to $OUT (default ./bench_out).
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
  grep -v "Warning\|warn(\|_warn_once\|^W1" "$OUT/$name.log" | tail -n 15
}
step gpu_tests 150 python3 -m pytest -q tests/test_gpu_nccl.py tests/test_vsa_kernel.py
step video_job 60 torchrun --nproc-per-node 1 examples/generate_video.py --check --output "$OUT/video.gif"
step image_job 60 torchrun --nproc-per-node 1 examples/generate_image.py --check --output "$OUT/image.png"
step bench1_13b 120 torchrun --nproc-per-node 1 benchmarks/bench_transformer.py --cases 1.3b --no-compile \
  --no-stock-variants --no-diffusers-cp --no-sdpa-report --no-profile --modes ulysses,kv_gather \
  --json "$OUT/bench1_13b.json"
step cache_1gpu 180 torchrun --nproc-per-node 1 benchmarks/bench_cache.py --json "$OUT/cache_1gpu.json"
