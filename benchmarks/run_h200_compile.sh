#!/usr/bin/env bash
# torch.compile with the fastest kernels on a one-H200 machine, in one device call (about 9 minutes;
# compile warm-ups ran 80-115 s a row).
# FA4 is brought there by ../shared/device/fa4-wheels.sh (two calls; the second sources
# .fa4/b/install.sh), then:
#   OUT=dir bash benchmarks/run_h200_compile.sh
# GPU tests of FA4 and the VSA fine stages inside compiled code (custom operators), then one 1.3B-shaped
# transformer step: stock eager (cuDNN, FA4) and compiled against ours eager and compiled, Ulysses and
# VSA. Logs and JSON go to $OUT (default ./bench_out).
set -u
OUT=${OUT:-bench_out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, diffusers, flash_attn.cute as c; print('torch', torch.__version__, 'diffusers', diffusers.__version__, 'fa4', c.__file__)" >> "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  echo "=== $name ($(date -u +%H:%M:%S))"
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1; echo "=== $name exit $?"
  grep -v "Warning\|warn(\|_warn_once\|^W1" "$OUT/$name.log" | tail -n ${TAIL:-15}
}
TAIL=25 step compile_tests ${TESTS_S:-100} python3 -m pytest -q -x -rs tests/test_kernels.py tests/test_vsa_kernel.py \
  -k "compiled"
TAIL=40 step bench_compile ${BENCH_S:-480} torchrun --nproc-per-node 1 benchmarks/bench_transformer.py --cases 1.3b \
  --modes ulysses,vsa --compile-modes ulysses,vsa --no-diffusers-cp --no-sdpa-report --no-profile \
  --json "$OUT/bench_compile.json"
