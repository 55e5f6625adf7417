"""Weight sharding on GPUs: one transformer step and the peak GPU memory per rank with the weights
sharded (``shard_weights=True``, FSDP2) against replicated, same mode, same run, Wan shapes.

    torchrun --nproc-per-node N benchmarks/bench_shard_weights.py --cases 1.3b,14b --layers14b 40 \\
        --json outputs/shard_weights.json
    python benchmarks/bench_shard_weights.py --device cpu --quick      # a smoke run on the CPU

Each case builds the random-weight transformer of ``bench_transformer.py`` (identical on every
rank), times ``--repeats`` steps after ``--warmup`` with the weights replicated, then with them
sharded, and reports per rank: the step (median ms), the peak GPU memory of the step (GiB) and the
bytes of parameters the rank holds between steps (``handle.local_weight_bytes()``), and the largest
difference between the two outputs (they must be equal).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_transformer import (GIB, Ctx, build_cases, build_inputs, build_model, finish, free_memory,  # noqa: E402
                               time_steps, tokens_of)


def measure(ctx: Ctx, model, inputs, *, shard: bool, mode: str) -> tuple[dict, torch.Tensor]:
    """One row: enable (sharded or not), time the steps, read the memory, disable."""
    from diffusers_sp import enable_sequence_parallel

    handle = enable_sequence_parallel(model, mode=mode, shard_weights=shard)
    try:
        held = sum(handle.local_weight_bytes().values())
        if ctx.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        median, times, out = time_steps(ctx, lambda: _step(model, inputs), collective=True)
        peak = torch.cuda.max_memory_allocated() / GIB if ctx.cuda else float("nan")
        out = out.detach().clone()
    finally:
        handle.disable()
    row = dict(shard_weights=shard, mode=mode, step_ms=round(median, 2), steps_ms=[round(t, 2) for t in times],
               peak_gib=round(peak, 3), weights_held_gib=round(held / GIB, 3))
    return row, out


def _step(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    return out[0] if isinstance(out, (tuple, list)) else out.sample


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="1.3b,14b", help="comma-separated: 1.3b, 14b")
    p.add_argument("--layers14b", type=int, default=40, help="blocks of the 14B-shaped stack (of 40)")
    p.add_argument("--mode", default="kv_gather", help="sequence-parallel mode of both rows")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run)")
    p.add_argument("--timeout", type=int, default=1200, help="collective timeout, seconds")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    ctx = Ctx(args)
    cases = build_cases(args)
    report = dict(world_size=ctx.world, device=torch.cuda.get_device_name() if ctx.cuda else "cpu",
                  torch=torch.__version__, rows=[])
    for name in args.cases.split(","):
        case = cases[name]
        model = build_model(ctx, case)
        inputs = build_inputs(ctx, case)
        replicated, ref = measure(ctx, model, inputs, shard=False, mode=args.mode)
        sharded, out = measure(ctx, model, inputs, shard=True, mode=args.mode)
        diff = (out.float() - ref.float()).abs().max().item()
        for row in (replicated, sharded):
            row.update(case=name, tokens=tokens_of(case), max_abs_diff=diff,
                       peak_gib_per_rank=ctx.gather_floats(row["peak_gib"]),
                       step_ms_per_rank=ctx.gather_floats(row["step_ms"]))
            report["rows"].append(row)
            ctx.log(f"{name} P={ctx.world} {args.mode} shard_weights={row['shard_weights']!s:5}: step "
                    f"{row['step_ms']} ms, peak {row['peak_gib']} GiB, weights held {row['weights_held_gib']} GiB"
                    f" per rank, max |sharded - replicated| {diff:.3g}")
        del model, inputs, ref, out
        free_memory(ctx)
    finish(ctx, args.json, report)


if __name__ == "__main__":
    main()
