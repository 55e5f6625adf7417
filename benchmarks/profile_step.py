#!/usr/bin/env python
"""Where a transformer step's GPU time goes: kernel time per category, stock against diffusers-sp.

Profiles one step (after warm-up) of the Wan-shaped models of ``bench_transformer.py`` with
``torch.profiler`` and sums the CUDA kernel time of rank 0 per category: attention (cuDNN / flash /
flex / Triton VSA kernels), GEMM, NCCL, copies (``copy_``/cat/index kernels) and the rest
(elementwise, norms, reductions). Kernels on different streams may overlap, so the categories can
add up to more than the step; the ``step`` column is the step's wall time (CUDA events).

    torchrun --nproc-per-node 2 benchmarks/profile_step.py --cases 1.3b --modes kv_gather,ulysses

Rows: ``stock`` (rank 0 alone) and ``ours <mode>`` (all ranks). The top kernels of every row are
printed too. Results go to stdout and ``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_transformer as bt  # noqa: E402  (same models, inputs and process setup)

CATEGORIES = (
    ("nccl", ("nccl",)),
    ("attention", ("fmha", "flash", "cudnn", "attention", "flex", "vsa_fine", "triton_tem")),
    ("gemm", ("gemm", "cutlass", "nvjet", "xmma", "sm90_", "cublas")),
    ("copy", ("copy", "cat", "index", "gather", "scatter", "elementwise_kernel_with_index")),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def kernel_ms(fn, steps: int = 1) -> dict:
    """CUDA kernel (and copy) time of this rank per kernel name, ms per call, over ``steps`` calls of ``fn``.

    Kernels on different streams are summed even where they overlap.
    """
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    per_kernel = defaultdict(float)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[evt.name] += evt.device_time / 1e3 / steps  # device_time is in microseconds
    return dict(per_kernel)


def profile_one(ctx, fn, steps: int):
    """Kernel times of rank 0 for ``steps`` calls of ``fn``: (per-category ms per step, top kernels)."""
    per_kernel = kernel_ms(fn, steps)
    per_cat = defaultdict(float)
    for name, ms in per_kernel.items():
        per_cat[category(name)] += ms
    top = [(name[:90], ms) for name, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:12]]
    return dict(per_cat), top


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="1.3b")
    p.add_argument("--modes", default="kv_gather,ulysses")
    p.add_argument("--layers14b", type=int, default=4)
    p.add_argument("--steps", type=int, default=2, help="profiled steps per row")
    p.add_argument("--vsa-options", default='{"vsa_sparsity": 0.9}')
    p.add_argument("--json", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-stock", action="store_true")
    p.add_argument("--no-top", action="store_true", help="do not print the top kernels")
    args = p.parse_args(argv)
    args.device, args.quick, args.timeout, args.warmup, args.repeats = "cuda", False, 600.0, 2, 3
    ctx = bt.Ctx(args)
    cases = bt.build_cases(args)
    report = []
    for case_name in args.cases.split(","):
        case = cases[case_name]
        model = bt.build_model(ctx, case)
        inputs = bt.build_inputs(ctx, case)
        rows = [] if args.no_stock else [("stock", None)]
        rows += [(f"ours {m}", m) for m in args.modes.split(",") if m]
        for label, mode in rows:
            handle = None
            if mode is not None:
                from diffusers_sp import enable_sequence_parallel
                opts = json.loads(args.vsa_options) if mode == "vsa" else {}
                handle = enable_sequence_parallel(model, mode=mode, **opts)
            elif not ctx.is0:
                ctx.barrier()
                continue

            def step():
                return bt._step(model, inputs)

            ms, _, _ = bt.time_steps(ctx, step, collective=mode is not None)
            cats, top = profile_one(ctx, step, args.steps)
            if handle is not None:
                handle.disable()
            else:
                ctx.barrier()
            if ctx.is0:
                report.append(dict(case=case_name, row=label, ranks=1 if mode is None else ctx.world, step_ms=ms,
                                   categories=cats, top=top))
                cat_text = "  ".join(f"{k} {cats.get(k, 0.0):7.1f}" for k in
                                     ("attention", "gemm", "nccl", "copy", "other"))
                print(f"{case_name:5s} {label:28s} step {ms:7.1f} ms | kernel ms/step: {cat_text}", flush=True)
                for name, kms in ([] if args.no_top else top):
                    print(f"      {kms:7.2f}  {name}")
        del model, inputs
        bt.free_memory(ctx)
    if ctx.is0 and args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if ctx.dist:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
