#!/usr/bin/env python
"""Where a transformer step's GPU time goes: kernel time per category, stock against diffusers-sp.

Profiles one step (after warm-up) of the Wan-shaped models of ``bench_transformer.py`` with
``torch.profiler`` and sums the CUDA kernel time of rank 0 per category: attention (cuDNN / flash /
flex / Triton VSA kernels), GEMM, NCCL, copies (``copy_``/cat/index kernels) and the rest
(elementwise, norms, reductions). Kernels on different streams may overlap, so the categories can
add up to more than the step; the ``step`` column is the step's wall time (CUDA events).

    torchrun --nproc-per-node 2 benchmarks/profile_step.py --cases 1.3b --modes kv_gather,ulysses

Rows: ``stock`` (rank 0 alone; with ``--stock-all-ranks`` every GPU runs it at the same time),
``ours <mode>`` (all ranks) and ``ours <label>`` for each ``--variants`` entry (a JSON object
``{"label": [mode, {options}]}``, as in ``bench_transformer.py``). The top kernels of every row are
printed too. Rows that all ranks ran also print every rank's categories (``rank 0 / rank 1 / ...``),
which shows how far the GPUs' paces differ. Results go to stdout and ``--json``.

    torchrun --nproc-per-node 2 benchmarks/profile_step.py --cases 1.3b,14b --modes ulysses,kv_gather \
        --stock-all-ranks --no-top --variants '{"ulysses nccl": ["ulysses", {"sp_transport": "nccl"}],
        "kv_gather nccl": ["kv_gather", {"sp_transport": "nccl"}]}'
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
    p.add_argument("--variants", default="{}", help='JSON {"label": [mode, {options}]}: more rows of ours')
    p.add_argument("--stock-all-ranks", action="store_true", help="stock row on every GPU at once")
    args = p.parse_args(argv)
    args.device, args.quick, args.timeout, args.warmup, args.repeats = "cuda", False, 600.0, 2, 3
    ctx = bt.Ctx(args)
    cases = bt.build_cases(args)
    report = []
    for case_name in args.cases.split(","):
        case = cases[case_name]
        model = bt.build_model(ctx, case)
        inputs = bt.build_inputs(ctx, case)
        rows = [] if args.no_stock else [("stock" + (", all ranks at once" if args.stock_all_ranks else ""), None, {})]
        rows += [(f"ours {m}", m, json.loads(args.vsa_options) if m == "vsa" else {})
                 for m in args.modes.split(",") if m]
        rows += [(f"ours {label}", mode, opts) for label, (mode, opts) in json.loads(args.variants).items()]
        for label, mode, opts in rows:
            handle = None
            everyone = mode is not None or args.stock_all_ranks
            if mode is not None:
                from diffusers_sp import enable_sequence_parallel
                handle = enable_sequence_parallel(model, mode=mode, **opts)
            elif not everyone and not ctx.is0:
                ctx.barrier()
                continue

            def step():
                return bt._step(model, inputs)

            if mode is None and everyone:
                ctx.barrier()
            ms, _, _ = bt.time_steps(ctx, step, collective=mode is not None)
            cats, top = profile_one(ctx, step, args.steps)
            if handle is not None:
                handle.disable()
            elif not everyone:
                ctx.barrier()
            names = ("attention", "gemm", "nccl", "copy", "other")
            per_rank = {k: ctx.gather_floats(cats.get(k, 0.0)) for k in names} if everyone else None
            step_per_rank = ctx.gather_floats(ms) if everyone else [ms]
            if ctx.is0:
                report.append(dict(case=case_name, row=label, ranks=ctx.world if everyone else 1, step_ms=ms,
                                   step_ms_per_rank=step_per_rank, categories=cats, categories_per_rank=per_rank,
                                   top=top))
                if per_rank is None:
                    cat_text = "  ".join(f"{k} {cats.get(k, 0.0):7.1f}" for k in names)
                    step_text = f"{ms:7.1f}"
                else:
                    cat_text = "  ".join(f"{k} " + " / ".join(f"{v:.1f}" for v in per_rank[k]) for k in names)
                    step_text = " / ".join(f"{v:.1f}" for v in step_per_rank)
                print(f"{case_name:5s} {label:28s} step {step_text} ms | kernel ms/step: {cat_text}", flush=True)
                for name, kms in ([] if args.no_top else top):
                    print(f"      {kms:7.2f}  {name}")
        del model, inputs
        bt.free_memory(ctx)
    bt.finish(ctx, args.json, report)


if __name__ == "__main__":
    main()
