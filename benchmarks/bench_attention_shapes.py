#!/usr/bin/env python
"""cuDNN attention at the per-rank call shapes of Ulysses and K/V-gather on 2 ranks (same FLOPs).

Answers two questions about the local kernel (``torch.nn.functional.scaled_dot_product_attention``
with the cuDNN backend, bf16, one GPU per process, no communication):

* Is one strategy's call shape slower? Per rank and Wan shape (P = 2): Ulysses attends its H/2
  heads over all S query rows (head groups G = 1 or 2, Q/K/V read from token-major ``[S, B, h, D]``
  buffers as the copy engines leave them); K/V-gather attends all H heads over its S/2 query rows
  (G = 1 or 2; queries strided views of the model's ``[B, S/2, H, D]`` projection); and a Ulysses
  variant that splits each head group's query rows into this rank's own rows (read straight from
  the projection) and the peer's rows, two calls per group.
* Does splitting the query rows, or the heads, change any bit of the output? (``exact``: the rows
  of the split calls against the same rows of one call.)

    torchrun --nproc-per-node 2 benchmarks/bench_attention_shapes.py [--json PATH]

Each process times on its own GPU (the two GPUs' numbers side by side show how far their paces
differ). ms per variant: median of ``--repeats`` rounds, the variants interleaved within a round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = {"14b": (40, 75600), "1.3b": (12, 32760)}  # (heads, tokens) of the Wan cases in bench_transformer.py
D = 128


def _ms(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def run_shape(H: int, S: int, repeats: int) -> dict:
    h, S_r = H // 2, S // 2
    torch.manual_seed(0)
    # This rank's heads over all tokens, token-major as the copy-engine buffers hold them.
    buf_q, buf_k, buf_v = (torch.randn(S, 1, h, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    # The model's query projection of this rank's S/2 tokens (rank 0: the first half), all heads.
    proj_q = torch.randn(1, S_r, H, D, device="cuda", dtype=torch.bfloat16)
    proj_q[:, :, :h] = buf_q[:S_r].permute(1, 0, 2, 3)
    # K/V-gather's gathered K and V: all heads over all tokens, token-major.
    all_k, all_v = (torch.randn(S, 1, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    attend = F.scaled_dot_product_attention

    def view(buf, h0, h1, lo=0, hi=None):  # [1, h1 - h0, rows, D]
        return buf[lo:hi, :, h0:h1].permute(1, 2, 0, 3)

    def ulysses(G):
        n = h // G
        return [attend(*(view(b, g * n, (g + 1) * n) for b in (buf_q, buf_k, buf_v))) for g in range(G)]

    def kv_gather(G):  # every head, this rank's rows, over the gathered K/V of all heads
        n = H // G
        return [attend(proj_q[:, :, g * n:(g + 1) * n].permute(0, 2, 1, 3), view(all_k, g * n, (g + 1) * n),
                       view(all_v, g * n, (g + 1) * n)) for g in range(G)]

    def ulysses_row_split(G):
        n, outs = h // G, []
        for g in range(G):
            k, v = view(buf_k, g * n, (g + 1) * n), view(buf_v, g * n, (g + 1) * n)
            outs.append(attend(proj_q[:, :, g * n:(g + 1) * n].permute(0, 2, 1, 3), k, v))  # own rows
            outs.append(attend(view(buf_q, g * n, (g + 1) * n, S_r), k, v))  # the peer's rows
        return outs

    variants = {"ulysses G=1": lambda: ulysses(1), "ulysses G=2": lambda: ulysses(2),
                "kv_gather G=1": lambda: kv_gather(1), "kv_gather G=2": lambda: kv_gather(2),
                "ulysses, rows split own/peer, G=1": lambda: ulysses_row_split(1),
                "ulysses, rows split own/peer, G=2": lambda: ulysses_row_split(2)}
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        whole = ulysses(1)[0]
        split = ulysses_row_split(1)
        exact = {"heads split (G=2) == G=1": torch.equal(torch.cat(ulysses(2), 1), whole),
                 "own rows == the same rows of one call": torch.equal(split[0], whole[:, :, :S_r]),
                 "peer rows == the same rows of one call": torch.equal(split[1], whole[:, :, S_r:])}
        for fn in variants.values():  # warm-up (cuDNN plans)
            fn()
            fn()
        times = {name: [] for name in variants}
        for _ in range(repeats):
            for name, fn in variants.items():
                times[name].append(_ms(fn))
    return {"exact": exact, "ms": {name: statistics.median(t) for name, t in times.items()}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="14b,1.3b")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(rank)
    result = {name: run_shape(*SHAPES[name], args.repeats) for name in args.cases.split(",")}
    for name, r in result.items():
        print(f"GPU {rank} {name}: exact {r['exact']}", flush=True)
        for variant, ms in r["ms"].items():
            print(f"GPU {rank} {name:5s} {variant:36s} {ms:8.2f} ms", flush=True)
    if args.json:
        with open(f"{args.json}.gpu{rank}", "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
