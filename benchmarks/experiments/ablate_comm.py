#!/usr/bin/env python
"""What the two-GPU step would cost without communication: per-GPU speed and a no-transfer ablation.

Separates the three things between "half of one GPU" and the measured two-GPU step of
``bench_transformer.py`` (same Wan-shaped models and inputs), each timed on every rank:

* ``stock, rank r alone``: the unsplit model on GPU r while the other GPU idles: how fast each GPU is;
* ``stock, all ranks at once``: every GPU runs the unsplit model at the same time (shared host, power);
* ``ours kv_gather, no transfer``: the K/V-gather step with the all-gather replaced by a local
  concatenation of this rank's own K/V shard with itself (same shapes, no K/V communication, no
  waiting for the other rank inside the layers; the output is wrong and not checked; the final
  output all-gather at ``proj_out`` still runs): the compute of a split step;
* ``ours kv_gather`` with each transport: the real step.

    torchrun --nproc-per-node 2 benchmarks/experiments/ablate_comm.py --cases 1.3b

Times are medians of CUDA events per rank (ms per step); stdout and ``--json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
import bench_transformer as bt  # noqa: E402  (same models, inputs and process setup)
from profile_step import kernel_ms  # noqa: E402


def _no_transfer_gather(key, value, sizes, group):
    """Stand-in for ``start_gather_kv`` (which ``gather_kv`` and the K/V-first path both call): the
    full-length K/V built from this rank's shard, no collective."""
    reps = -(-sum(sizes) // key.shape[2])
    full = [torch.cat([t] * reps, dim=2)[:, :, :sum(sizes)] for t in (key, value)]
    return lambda: (full[0], full[1])


def host_ms(fn, repeats: int = 3) -> float:
    """Median host (CPU) time to issue one call of ``fn``, from a synchronized start to its return,
    without waiting for the GPU at the end: close to the GPU time when the host cannot run ahead
    (a synchronizing op inside, or launches slower than the kernels)."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def synchronizing_ops(fn) -> list[str]:
    """Where ``fn`` makes the host wait for the GPU (torch's CUDA sync debug mode), one line per site."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    sites = {}
    for w in caught:
        if "synchroniz" in str(w.message):
            key = f"{w.filename}:{w.lineno}: {str(w.message)[:80]}"
            sites[key] = sites.get(key, 0) + 1
    return [f"{n} x {k}" for k, n in sites.items()]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="1.3b")
    p.add_argument("--layers14b", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.device, args.quick, args.timeout, args.warmup = "cuda", False, 600.0, 2
    ctx = bt.Ctx(args)
    from diffusers_sp import enable_sequence_parallel
    from diffusers_sp.processors import kv_gather

    report = []

    def record(case_name, label, ms):
        per_rank = ctx.gather_floats(ms)
        if ctx.is0:
            report.append(dict(case=case_name, row=label, ms_per_rank=per_rank))
            print(f"{case_name:5s} {label:40s} " + "  ".join(f"rank {r}: {t:7.1f} ms" for r, t in enumerate(per_rank)),
                  flush=True)

    for case_name in args.cases.split(","):
        case = bt.build_cases(args)[case_name]
        model = bt.build_model(ctx, case)
        inputs = bt.build_inputs(ctx, case)

        def step():
            return bt._step(model, inputs)

        for r in range(ctx.world):  # one GPU at a time
            ctx.barrier()
            ms = bt.time_steps(ctx, step, collective=False)[0] if ctx.rank == r else 0.0
            ctx.barrier()
            per_rank = ctx.gather_floats(ms)
            if ctx.is0:
                report.append(dict(case=case_name, row=f"stock, rank {r} alone", ms=per_rank[r]))
                print(f"{case_name:5s} {f'stock, rank {r} alone':40s} {per_rank[r]:7.1f} ms", flush=True)
        ctx.barrier()
        record(case_name, "stock, all ranks at once", bt.time_steps(ctx, step, collective=False)[0])
        record(case_name, "stock, host time to issue a step", host_ms(step))
        if ctx.is0:
            print("  stock synchronizing ops:", synchronizing_ops(step) or "none", flush=True)
        else:
            synchronizing_ops(step)
        stock_kernels = kernel_ms(step)
        stock_busy = sum(stock_kernels.values())

        original = kv_gather.start_gather_kv
        kv_gather.start_gather_kv = _no_transfer_gather
        try:
            handle = enable_sequence_parallel(model, mode="kv_gather", sp_transport="nccl")
            ctx.barrier()
            record(case_name, "ours kv_gather, no transfer", bt.time_steps(ctx, step, collective=False)[0])
            record(case_name, "ours kv_gather, no transfer, host time", host_ms(step))
            sites = synchronizing_ops(step)
            if ctx.is0:
                print("  ours synchronizing ops:", sites or "none", flush=True)
            kernels = kernel_ms(step)
            busy = sum(kernels.values())
            if ctx.is0:
                print(f"  busy GPU ms per step: stock {stock_busy:.1f} (half {stock_busy / 2:.1f}), "
                      f"ours no transfer {busy:.1f}; kernels furthest above half of stock (ms):", flush=True)
                excess = {n: kernels.get(n, 0.0) - stock_kernels.get(n, 0.0) / 2
                          for n in set(kernels) | set(stock_kernels)}
                for n, x in sorted(excess.items(), key=lambda kv: -kv[1])[:12]:
                    print(f"    {x:+7.2f}  ours {kernels.get(n, 0.0):7.2f}  "
                          f"stock/2 {stock_kernels.get(n, 0.0) / 2:7.2f}  {n[:100]}")
                report.append(dict(case=case_name, row="busy", stock_busy=stock_busy, ours_no_transfer_busy=busy,
                                   excess=sorted(excess.items(), key=lambda kv: -kv[1])[:20]))
            handle.disable()
        finally:
            kv_gather.start_gather_kv = original
        for label, opts in (("ours kv_gather nccl", {"sp_transport": "nccl"}),
                            ("ours kv_gather copy engine G=1", {"sp_transport": "copy_engine", "overlap_head_groups": 1}),
                            ("ours kv_gather copy engine G=4", {"sp_transport": "copy_engine", "overlap_head_groups": 4})):
            handle = enable_sequence_parallel(model, mode="kv_gather", **opts)
            record(case_name, label, bt.time_steps(ctx, step, collective=True)[0])
            handle.disable()
        model = inputs = None
        bt.free_memory(ctx)
    bt.finish(ctx, args.json, report)


if __name__ == "__main__":
    main()
