#!/usr/bin/env bash
# Everything this project measures on a 2 x H200 machine (device time is scarce), in two parts that
# each fit one 10-minute device call:
#   bash benchmarks/run_h200_x2.sh bench   # 2-GPU benchmarks (1.3B, 14B shapes), VSA kernel on GPU 0
#   bash benchmarks/run_h200_x2.sh bench2  # only the 2-GPU benchmarks
#   bash benchmarks/run_h200_x2.sh checks  # GPU tests, the main job with --check, 1-GPU VSA step
# (no argument: both). Each step has its own time limit so that a slow step cannot starve the
# others; logs and JSON go to $OUT (default ./bench_out).
set -u
PART=${1:-all}
OUT=${OUT:-bench_out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, diffusers; print('torch', torch.__version__, 'diffusers', diffusers.__version__)" >> "$OUT/gpu.txt"
step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  echo "=== $name ($(date -u +%H:%M:%S))"
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1; echo "=== $name exit $?"
  grep -v "Warning\|warn(\|_warn_once\|^W1" "$OUT/$name.log" | tail -n 25
}
# Rows of both transports side by side (on 2 GPUs of one host sp_transport="auto" is the copy
# engines for Ulysses and, on these Wan shapes with their K/V-first path, NCCL for K/V-gather, so
# the other transport of each is asked for by name); TRANSPORT_ROWS in the environment replaces
# them (bench_transformer's --variants JSON).
TRANSPORT_ROWS=${TRANSPORT_ROWS:-'{"ulysses nccl": ["ulysses", {"sp_transport": "nccl"}], "kv_gather copy_engine": ["kv_gather", {"sp_transport": "copy_engine"}]}'}
if [ "$PART" = bench ] || [ "$PART" = bench2 ] || [ "$PART" = all ]; then
  step bench2_13b 220 torchrun --nproc-per-node 2 benchmarks/bench_transformer.py --cases 1.3b --no-compile \
    --no-stock-variants --variants "$TRANSPORT_ROWS" --json "$OUT/bench2_13b.json"
  step bench2_14b 200 torchrun --nproc-per-node 2 benchmarks/bench_transformer.py --cases 14b --no-compile \
    --no-stock-variants --no-sdpa-report --variants "$TRANSPORT_ROWS" --json "$OUT/bench2_14b.json"
fi
if [ "$PART" = bench ] || [ "$PART" = all ]; then
  step vsa_kernel 120 python3 benchmarks/bench_vsa_kernel.py --sweep --bound --json "$OUT/vsa.json"
fi
if [ "$PART" = checks ] || [ "$PART" = all ]; then
  step gpu_tests 170 python3 -m pytest -q -s tests/test_gpu_nccl.py tests/test_vsa_kernel.py -k "cuda or nccl"
  step main_job 60 accelerate launch --config_file examples/accelerate_gpu.yaml --num_processes 2 \
    examples/generate_video.py --check --output "$OUT/video.gif"
  step bench1_13b_vsa 120 torchrun --nproc-per-node 1 benchmarks/bench_transformer.py --cases 1.3b --no-compile \
    --no-stock-variants --no-diffusers-cp --no-sdpa-report --modes vsa --json "$OUT/bench1_13b_vsa.json"
fi
# Also: torchrun --nproc-per-node 2 benchmarks/profile_step.py (kernel time per category), and the
#       scripts of benchmarks/experiments/ (see its README).
