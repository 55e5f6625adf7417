#!/usr/bin/env python
"""Do kernels read a symmetric-memory buffer as fast as an ordinary allocation? (2 x H200)

The copy-engine transports leave the gathered K/V (and Ulysses' Q and output) in a buffer from
``torch.distributed._symmetric_memory.empty`` (outside PyTorch's caching allocator). This times the
local kernels that read it, on the same data layout, from such a buffer and from ``torch.empty``:
cuDNN attention over token-major ``[S, B, H, D]`` views (one K/V-gather head group of the Wan 14B
shape: 20 heads, 37800 queries over 75600 keys) and a ``[37800, 5120] x [5120, 5120]`` GEMM.

    torchrun --nproc-per-node 2 benchmarks/experiments/bench_symm_read.py

Prints, per rank, the best of three rounds in ms per call (CUDA events around back-to-back calls).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

H, SQ, SK, D, C = 20, 37800, 75600, 128, 5120


def _views(flat: torch.Tensor):
    t = flat[:3 * SK * H * D].view(3, SK, 1, H, D)  # token-major, as the copy engines lay out K/V
    return t[0, :SQ].permute(1, 2, 0, 3), t[1].permute(1, 2, 0, 3), t[2].permute(1, 2, 0, 3)


def _ms(fn, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    rank = int(os.environ["RANK"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    n = 3 * SK * H * D
    symm = symm_mem.empty(n, dtype=torch.bfloat16, device=device)
    symm_mem.rendezvous(symm, dist.group.WORLD)
    plain = torch.empty(n, dtype=torch.bfloat16, device=device)
    for buf in (symm, plain):
        buf.normal_()
    weight = torch.randn(C, C, device=device, dtype=torch.bfloat16)

    def attention(buf):
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(*_views(buf))

    def gemm(buf):
        return buf[:SQ * C].view(SQ, C) @ weight

    for buf in (symm, plain):
        attention(buf)
    best: dict[str, float] = {}
    for _ in range(3):
        for name, fn, reps in (("attention, symmetric", lambda: attention(symm), 6),
                               ("attention, ordinary", lambda: attention(plain), 6),
                               ("GEMM, symmetric", lambda: gemm(symm), 50),
                               ("GEMM, ordinary", lambda: gemm(plain), 50)):
            best[name] = min(best.get(name, float("inf")), _ms(fn, reps))
    print(f"rank {rank}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in best.items()), flush=True)
    from diffusers_sp.groups import destroy_process_groups

    destroy_process_groups(barrier=True)  # the group's threads end before Python exits


if __name__ == "__main__":
    main()
