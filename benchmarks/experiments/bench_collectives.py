#!/usr/bin/env python
"""Bandwidth of the two collectives diffusers-sp uses, alone: all-gather (K/V-gather) and all-to-all
(Ulysses), bf16 on NCCL, at the per-layer payloads of the Wan2.1 1.3B and 14B shapes on 2 GPUs.

    torchrun --nproc-per-node 2 benchmarks/experiments/bench_collectives.py
    NCCL_PROTO=Simple torchrun --nproc-per-node 2 benchmarks/experiments/bench_collectives.py   # NCCL variants

Prints, on rank 0, the median over 10 calls (CUDA events, 3 warm-up calls) of
``dist.all_gather_into_tensor`` and ``dist.all_to_all_single`` for 50 MB and 387 MB per rank (one
of K or V of a rank's shard at 1.3B and 14B), and the resulting bytes sent per rank per second.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
from bench_vsa_kernel import time_ms  # noqa: E402  (median of CUDA-event timings after warm-up)

PAYLOADS_MB = (50, 387)


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # the GPU machines forbid NVLink multicast
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    world = dist.get_world_size()
    for mb in PAYLOADS_MB:
        n = mb * 2 ** 20 // 2  # bf16 elements per rank
        x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        gathered = torch.empty(n * world, device="cuda", dtype=torch.bfloat16)
        exchanged = torch.empty_like(x)
        ag = time_ms(lambda: dist.all_gather_into_tensor(gathered, x), warmup=3, iters=10)
        a2a = time_ms(lambda: dist.all_to_all_single(exchanged, x), warmup=3, iters=10)
        if dist.get_rank() == 0:
            sent = mb * (world - 1)  # all-gather: this rank's payload to every other rank
            sent_a2a = mb * (world - 1) / world
            print(f"{os.environ.get('NCCL_PROTO', 'default protocol')}: {mb} MB per rank on {world} GPUs: "
                  f"all-gather {ag:.3f} ms ({sent / 1024 / ag * 1e3:.0f} GB/s sent per rank), "
                  f"all-to-all {a2a:.3f} ms ({sent_a2a / 1024 / a2a * 1e3:.0f} GB/s sent per rank)", flush=True)
    from diffusers_sp.groups import destroy_process_groups

    destroy_process_groups(barrier=True)  # the group's threads end before Python exits


if __name__ == "__main__":
    main()
