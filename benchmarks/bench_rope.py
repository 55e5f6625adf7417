#!/usr/bin/env python
"""Wan's RoPE on one GPU: the model's eight operations against the one Triton kernel of
``diffusers_sp.kernels.rope`` (the same bits; checked here on every input it times).

    python benchmarks/bench_rope.py [--repeats 50] [--sweep] [--json PATH]

Per shape (queries or keys of the Wan 1.3B and 14B self-attention, ``[1, S, H, 128]`` bf16, float32 tables
``[1, S, 1, 128]``): ms per call, "synced" (the median of ``--repeats`` calls after a warm-up, each between
CUDA events on an idle GPU, so the host's launch latency counts: ``bench_vsa_kernel.time_ms``) and "queued"
(``--repeats`` calls back to back between one event pair, as inside a model:
``bench_vsa_kernel.time_ms_back_to_back``); the memory each reads and writes at its minimum (the input, the
tables and the output once) and the kernel's rate over it, queued; and whether the outputs are equal bit
for bit. ``--sweep`` also times the kernel's launch configurations (rows a program, warps), queued, each
checked for equality.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_vsa_kernel import time_ms, time_ms_back_to_back  # noqa: E402  (CUDA-event timers, synced and queued)
from diffusers_sp.kernels.rope import (  # noqa: E402
    _rope_triton, fused_rope_applies, rope_adjacent_pairs, rope_adjacent_pairs_reference)

#: (name, tokens, heads): the self-attention of Wan 1.3B (480x832x81) and 14B (1280x720x81).
SHAPES = [("1.3b", 32760, 12), ("14b", 75600, 40)]
HEAD_DIM = 128


#: Launch configurations ``--sweep`` times: (rows a program, warps).
SWEEP = [(rows, warps) for rows in (16, 32, 64, 128) for warps in (2, 4, 8)]


def run_shape(name: str, tokens: int, heads: int, repeats: int, sweep: bool) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, tokens, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    angles = torch.rand(1, tokens, 1, HEAD_DIM // 2, device="cuda", dtype=torch.float64, generator=gen) * 100
    cos = angles.cos().repeat_interleave(2, -1).float()
    sin = angles.sin().repeat_interleave(2, -1).float()
    assert fused_rope_applies(x, cos, sin)
    versions = {"model's operations": lambda: rope_adjacent_pairs_reference(x, cos, sin),
                "Triton kernel": lambda: rope_adjacent_pairs(x, cos, sin)}
    expected = versions["model's operations"]()
    equal = torch.equal(versions["Triton kernel"](), expected)
    ms = {k: time_ms(fn, warmup=3, iters=repeats) for k, fn in versions.items()}  # warm-up: the kernel's compile
    queued = {k: time_ms_back_to_back(fn, iters=repeats) for k, fn in versions.items()}
    minimum_bytes = 2 * x.numel() * x.element_size() + 2 * cos.numel() * cos.element_size()
    model_ms, kernel_ms = queued["model's operations"], queued["Triton kernel"]
    row = dict(shape=name, x=list(x.shape), ms=ms, ms_queued=queued, equal=equal, minimum_gb=minimum_bytes / 1e9,
               speedup=model_ms / kernel_ms, kernel_tb_per_s=minimum_bytes / (kernel_ms * 1e-3) / 1e12)
    model_synced, kernel_synced = ms["model's operations"], ms["Triton kernel"]
    print(f"{name} {tuple(x.shape)}, queued (synced): model's operations {model_ms:.3f} ({model_synced:.3f}) ms, "
          f"Triton kernel {kernel_ms:.3f} ({kernel_synced:.3f}) ms "
          f"({row['speedup']:.1f}x; {row['kernel_tb_per_s']:.2f} TB/s of the minimum {row['minimum_gb']:.3f} GB), "
          f"equal bit for bit: {equal}")
    if sweep:
        row["sweep"] = []
        for rows, warps in SWEEP:
            fn = lambda: _rope_triton(x, cos, sin, rows_per_program=rows, num_warps=warps)  # noqa: E731
            same = torch.equal(fn(), expected)  # the first call compiles this configuration
            t = time_ms_back_to_back(fn, iters=repeats)
            row["sweep"].append(dict(rows_per_program=rows, num_warps=warps, ms_queued=t, equal=same,
                                     tb_per_s=minimum_bytes / (t * 1e-3) / 1e12))
            equal = equal and same
            print(f"  {rows:4d} rows a program, {warps} warps: {t:.4f} ms queued "
                  f"({row['sweep'][-1]['tb_per_s']:.2f} TB/s), equal: {same}")
        row["equal"] = equal
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--sweep", action="store_true", help="also time the kernel's launch configurations")
    parser.add_argument("--json", default=None, help="write the rows and the machine's facts here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_rope.py needs a CUDA GPU (and Triton)")
    rows = [run_shape(name, tokens, heads, args.repeats, args.sweep) for name, tokens, heads in SHAPES]
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
