#!/usr/bin/env python
"""Would token shards weighted by each GPU's pace beat even shards? A what-if experiment.

With even shards the two-GPU step runs at the slower GPU's pace (every layer waits for it), and the
lent H200 pairs differ by 0.2-2.7 % in stock speed (``experiments/ablate_comm.py``). This measures, on the
Wan-shaped models of ``bench_transformer.py``:

* ``stock, rank r alone``: each GPU's pace (the unsplit model, the other GPU idle);
* ``calibration, cold/warm``: a short fixed loop (cuDNN attention and a GEMM, ~0.25 s) on every GPU
  at once, before and after the stock rows: could a quick test at start-up predict the paces?
* ``ours <mode> even`` / ``weighted``: the real step with balanced shards, and with rank r holding
  tokens in proportion to 1 / (its stock time), in two interleaved rounds.

The weighted split is made by replacing ``diffusers_sp.sharding.balanced_sizes`` (the token split
of the sharding hooks and the processors; Ulysses' head split has its own reference and stays even)
for the weighted rows only. Every split gives the same output; this only times.

    torchrun --nproc-per-node 2 benchmarks/experiments/bench_weighted_split.py --cases 1.3b [--json PATH]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
import bench_transformer as bt  # noqa: E402  (same models, inputs and process setup)


def calibration_ms() -> float:
    """ms for 100 rounds of three cuDNN-sized attention calls ([1, 12, 8192, 128] bf16) and one
    [8192, 4096] x [4096, 4096] GEMM, after 10 rounds of warm-up."""
    q = torch.randn(1, 12, 8192, 128, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def body():
        for _ in range(3):
            F.scaled_dot_product_attention(q, q, q)
        return a @ b

    for _ in range(10):
        body()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(100):
        body()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def weighted_sizes(total: int, weights: list[float]) -> list[int]:
    """``total`` items split in proportion to ``weights`` (largest remainders get the leftovers)."""
    raw = [total * w / sum(weights) for w in weights]
    sizes = [int(x) for x in raw]
    for i in sorted(range(len(raw)), key=lambda i: sizes[i] - raw[i])[:total - sum(sizes)]:
        sizes[i] += 1
    return sizes


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="1.3b")
    p.add_argument("--modes", default="kv_gather,ulysses")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--layers14b", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.device, args.quick, args.timeout, args.warmup = "cuda", False, 600.0, 2
    ctx = bt.Ctx(args)
    from diffusers_sp import enable_sequence_parallel, sharding

    even = sharding.balanced_sizes
    report = []

    def record(case_name, row, values):
        if ctx.is0:
            report.append(dict(case=case_name, row=row, ms_per_rank=values))
            print(f"{case_name:5s} {row:36s} " + " / ".join(f"{v:.1f}" for v in values) + " ms", flush=True)

    for case_name in args.cases.split(","):
        case = bt.build_cases(args)[case_name]
        model = bt.build_model(ctx, case)
        inputs = bt.build_inputs(ctx, case)
        tokens = bt.tokens_of(case)

        def step():
            return bt._step(model, inputs)

        ctx.barrier()
        record(case_name, "calibration, cold (all GPUs at once)", ctx.gather_floats(calibration_ms()))
        alone = []
        for r in range(ctx.world):
            ctx.barrier()
            ms = bt.time_steps(ctx, step, collective=False)[0] if ctx.rank == r else 0.0
            ctx.barrier()
            alone.append(ctx.gather_floats(ms)[r])
        record(case_name, "stock, each rank alone", alone)
        ctx.barrier()
        record(case_name, "calibration, warm (all GPUs at once)", ctx.gather_floats(calibration_ms()))
        split = weighted_sizes(tokens, [1.0 / t for t in alone])  # same on every rank (gathered times)

        def token_split(total, parts):
            return split if total == tokens and parts == ctx.world else even(total, parts)

        for _ in range(args.rounds):
            for mode in [m for m in args.modes.split(",") if m]:
                for label, fn in (("even", even), (f"weighted {split}", token_split)):
                    sharding.balanced_sizes = fn
                    try:
                        handle = enable_sequence_parallel(model, mode=mode)
                        ms = bt.time_steps(ctx, step, collective=True)[0]
                        handle.disable()
                    finally:
                        sharding.balanced_sizes = even
                    record(case_name, f"ours {mode} {label}", ctx.gather_floats(ms))
        model = inputs = None
        bt.free_memory(ctx)
    bt.finish(ctx, args.json, report)


if __name__ == "__main__":
    main()
