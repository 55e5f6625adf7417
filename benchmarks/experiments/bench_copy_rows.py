#!/usr/bin/env python
"""What the copy-engine transport's 2-D copies cost (``diffusers_sp.copy_engine.copy_rows``), one
process driving two GPUs of one machine (peer access over NVLink).

For a head slice of h heads of a token-major ``[16380, 12, 128]`` bf16 tensor (one rank's Q, K or V
shard at the Wan 1.3B shape over 2 ranks; rows of h x 256 bytes at a pitch of 3072 bytes), times:
a 2-D copy-engine copy within GPU 0, the same copy by ``Tensor.copy_`` (an SM kernel), a 2-D
copy-engine push to GPU 1, a 1-D (contiguous) copy-engine push of the same bytes, and a 2-D pull
from GPU 1. Then what a concurrent transfer costs the compute it overlaps: a bf16 GEMM alone, with
two 2-D copy-engine pushes on a side stream, and with the same pushes as SM copies; an attention
call ``[1, 6, 32760, 128]`` alone and with four pushes. Last, the host time of one ``copy_rows``
call. Times are CUDA-event means (µs); GB/s counts the bytes moved once.

    python benchmarks/experiments/bench_copy_rows.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
from diffusers_sp.copy_engine import copy_rows  # noqa: E402

S, H, D = 16380, 12, 128
DTYPE = torch.bfloat16


def timeit(fn, device, n=50) -> float:
    """Mean ms per call of ``fn`` on ``device``'s current stream (5 warm-up calls)."""
    stream = torch.cuda.current_stream(device)
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    for _ in range(n):
        fn()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / n


def main() -> None:
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs two CUDA GPUs")
    d0, d1 = torch.device("cuda:0"), torch.device("cuda:1")
    torch.cuda.set_device(d0)
    x = torch.randn(S, H, D, device=d0, dtype=DTYPE)
    x_peer = torch.randn(S, H, D, device=d1, dtype=DTYPE)
    _ = x[:1].to(d1)  # peer access on
    for h in (3, 6, 12):
        local = torch.empty(S, h, D, device=d0, dtype=DTYPE)
        remote = torch.empty(S, h, D, device=d1, dtype=DTYPE)
        contiguous = torch.empty(S, h, D, device=d0, dtype=DTYPE)
        assert copy_rows(local, x[:, :h]) and copy_rows(remote, x[:, :h])
        torch.cuda.synchronize()
        assert torch.equal(local, x[:, :h]) and torch.equal(remote.to(d0), x[:, :h])
        nbytes = local.numel() * local.element_size()
        rows = {
            "local 2-D copy engine": lambda: copy_rows(local, x[:, :h]),
            "local Tensor.copy_ (SM)": lambda: local.copy_(x[:, :h]),
            "push 2-D copy engine": lambda: copy_rows(remote, x[:, :h]),
            "push 1-D copy engine": lambda: remote.copy_(contiguous),
            "pull 2-D copy engine": lambda: copy_rows(local, x_peer[:, :h]),
        }
        print(f"h={h} (rows of {h * D * 2} B, pitch {H * D * 2} B, {nbytes / 1e6:.1f} MB)")
        for name, fn in rows.items():
            ms = timeit(fn, d0)
            print(f"  {name:26s} {ms * 1000:7.1f} us  {nbytes / ms / 1e6:6.0f} GB/s")

    side = torch.cuda.Stream(d0)
    remote = torch.empty(S, 6, D, device=d1, dtype=DTYPE)
    compute = torch.cuda.current_stream(d0)

    def overlapped(work, pushes, engine):
        def run():
            side.wait_stream(compute)
            with torch.cuda.stream(side):
                for _ in range(pushes):
                    copy_rows(remote, x[:, :6]) if engine else remote.copy_(x[:, :6])
            work()
            compute.wait_stream(side)
        return run

    a = torch.randn(S, 1536, device=d0, dtype=DTYPE)
    w = torch.randn(1536, 6144, device=d0, dtype=DTYPE)
    gemm = lambda: a @ w  # noqa: E731
    q = torch.randn(1, 6, 2 * S, D, device=d0, dtype=DTYPE)
    attention = lambda: F.scaled_dot_product_attention(q, q, q)  # noqa: E731
    print(f"push of h=6 alone            {timeit(lambda: copy_rows(remote, x[:, :6]), d0, 20) * 1000:7.1f} us")
    print(f"GEMM alone                   {timeit(gemm, d0, 30) * 1000:7.1f} us")
    print(f"GEMM + 2 copy-engine pushes  {timeit(overlapped(gemm, 2, True), d0, 30) * 1000:7.1f} us")
    print(f"GEMM + 2 SM-copy pushes      {timeit(overlapped(gemm, 2, False), d0, 30) * 1000:7.1f} us")
    print(f"attention alone              {timeit(attention, d0, 10) * 1000:7.1f} us")
    print(f"attention + 4 pushes         {timeit(overlapped(attention, 4, True), d0, 10) * 1000:7.1f} us")
    local = torch.empty(S, 3, D, device=d0, dtype=DTYPE)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(1000):
        copy_rows(local, x[:, :3])
    print(f"host time per copy_rows call {(time.perf_counter() - start) * 1000:7.1f} us")
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
