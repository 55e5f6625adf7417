#!/usr/bin/env python
"""Wan's RoPE on one GPU: the model's eight operations against the one Triton kernel of
``diffusers_sp.kernels.rope`` (the same bits; checked here on every input it times).

    python benchmarks/bench_rope.py [--repeats 50] [--json PATH]

Per shape (queries or keys of the Wan 1.3B and 14B self-attention, ``[1, S, H, 128]`` bf16, float32 tables
``[1, S, 1, 128]``): ms per call, the median of ``--repeats`` calls after a warm-up, each between CUDA
events on an idle GPU (``bench_vsa_kernel.time_ms``); the memory each reads and writes at its minimum
(the input, the tables and the output once); and whether the outputs are equal bit for bit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_vsa_kernel import time_ms  # noqa: E402  (median of CUDA-event timings after warm-up)
from diffusers_sp.kernels.rope import fused_rope_applies, rope_adjacent_pairs, rope_adjacent_pairs_reference  # noqa: E402

#: (name, tokens, heads): the self-attention of Wan 1.3B (480x832x81) and 14B (1280x720x81).
SHAPES = [("1.3b", 32760, 12), ("14b", 75600, 40)]
HEAD_DIM = 128


def run_shape(name: str, tokens: int, heads: int, repeats: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, tokens, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    angles = torch.rand(1, tokens, 1, HEAD_DIM // 2, device="cuda", dtype=torch.float64, generator=gen) * 100
    cos = angles.cos().repeat_interleave(2, -1).float()
    sin = angles.sin().repeat_interleave(2, -1).float()
    assert fused_rope_applies(x, cos, sin)
    versions = {"model's operations": lambda: rope_adjacent_pairs_reference(x, cos, sin),
                "Triton kernel": lambda: rope_adjacent_pairs(x, cos, sin)}
    equal = torch.equal(versions["Triton kernel"](), versions["model's operations"]())
    ms = {k: time_ms(fn, warmup=3, iters=repeats) for k, fn in versions.items()}  # warm-up: the kernel's compile
    model_ms, kernel_ms = ms["model's operations"], ms["Triton kernel"]
    minimum_bytes = 2 * x.numel() * x.element_size() + 2 * cos.numel() * cos.element_size()
    row = dict(shape=name, x=list(x.shape), ms=ms, equal=equal, minimum_gb=minimum_bytes / 1e9,
               speedup=model_ms / kernel_ms, kernel_tb_per_s=minimum_bytes / (kernel_ms * 1e-3) / 1e12)
    print(f"{name} {tuple(x.shape)}: model's operations {model_ms:.3f} ms, Triton kernel {kernel_ms:.3f} ms "
          f"({row['speedup']:.1f}x; {row['kernel_tb_per_s']:.2f} TB/s of the minimum {row['minimum_gb']:.3f} GB), "
          f"equal bit for bit: {equal}")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", default=None, help="write the rows and the machine's facts here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_rope.py needs a CUDA GPU (and Triton)")
    rows = [run_shape(name, tokens, heads, args.repeats) for name, tokens, heads in SHAPES]
    if args.json:
        import triton

        meta = dict(date_utc=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
                    device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    command=" ".join(sys.argv))
        Path(args.json).write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
    if not all(r["equal"] for r in rows):
        raise SystemExit("the kernel's output differs from the model's operations")


if __name__ == "__main__":
    main()
