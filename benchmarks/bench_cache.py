#!/usr/bin/env python
"""First Block Cache with sequence parallelism: time per 10-step call, with and without the cache,
one GPU against diffusers-sp, and the cost of the cache's decision collective.

Start it with torchrun (one process per GPU)::

    torchrun --nproc-per-node 2 benchmarks/bench_cache.py --json results/cache_2gpu.json

or, for an end-to-end check on CPU with a tiny shape (gloo)::

    torchrun --nproc-per-node 2 benchmarks/bench_cache.py --device cpu --quick

Model: the Wan2.1-1.3B configuration with random weights (``bench_transformer.build_model``, bf16 on
CUDA, float32 on CPU), latent 480x832x81 (32760 tokens), text [1, 512, 4096]; ``--quick``: the tiny
Wan of ``bench_transformer.py --quick`` (72 tokens). A *call* is a ``--steps`` (10) step
flow-matching Euler loop of the transformer alone, one transformer call per step (CFG off), each
inside ``cache_context("cond", step_index=i, sigma=..., num_inference_steps=...)``, as a pipeline
makes them (its text encoder and VAE, untouched by the cache, are left out). The cache's state is
reset before every call (``_reset_stateful_cache``, what a pipeline does after its call).

First Block Cache (``FirstBlockCacheConfig(threshold)``) skips the remaining blocks of a step when
the first block's residual changed little. ``--threshold auto`` (default) picks, on rank 0 alone
with the stock model, the threshold whose call skips the number of steps closest to half (bisection
over the residual ratios of a call that skips none); the threshold is then broadcast and used by
every row. Random weights give other ratios than a trained model: the threshold is chosen for the
skip count, not for quality.

Rows (``ms``: median per call over ``--repeats`` calls after ``--warmup``, max over ranks; CUDA
events, a barrier before each call):

* ``stock, no cache`` and ``stock, first block cache``: the unmodified model on rank 0's device alone.
* ``ours <mode>, no cache`` and ``ours <mode>, first block cache``: ``enable_sequence_parallel`` over
  all ranks (``--modes``, default ``kv_gather,ulysses``). ``rel_err`` compares the call's final
  latents with the stock call with the same cache (``||a - b|| / ||b||``).
* ``decision collective``: one First Block Cache decision's collective under sequence parallelism
  (an all-gather of two float64 per rank, :func:`diffusers_sp.caches._sum_over`), timed alone over
  ``--collective-repeats`` decisions; one decision per step, so ``--steps`` per call.

Every row reports ``steps_computed`` (steps in which the blocks after the first ran). Output: a
markdown table on rank 0's stdout, and ``--json PATH`` (rewritten after every row) with the rows
and the run's metadata (date, device, torch/diffusers versions, git commit, command).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

# The GPU machines forbid NVLink multicast (NVLS); NCCL reads this at communicator creation.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for path in (str(REPO), str(HERE)):
    if path not in sys.path:  # run from a checkout without `pip install -e .`
        sys.path.insert(0, path)

from bench_transformer import Ctx, build_cases, build_inputs, build_model, finish, metadata, tokens_of  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--quick", action="store_true", help="tiny shape (CPU smoke test)")
    p.add_argument("--steps", type=int, default=10, help="denoising steps per call")
    p.add_argument("--threshold", default="auto", help="First Block Cache threshold, or 'auto' (about half the steps skip)")
    p.add_argument("--modes", default="kv_gather,ulysses", help="diffusers-sp modes to time")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per row")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls per row")
    p.add_argument("--collective-repeats", type=int, default=50, help="decisions timed for the collective row")
    p.add_argument("--json", default=None, help="write all rows and metadata to this path (rank 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="collective timeout in seconds")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failing rows")
    p.add_argument("--layers14b", type=int, default=4, help=argparse.SUPPRESS)  # read by build_cases
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------ calls

class Loop:
    """The ``--steps`` step call of the module docstring on one model, counting computed steps."""

    def __init__(self, ctx: Ctx, model, inputs: dict, steps: int):
        self.ctx, self.model, self.inputs, self.steps = ctx, model, inputs, steps
        # Flow-matching sigmas from 1 towards 0 (the last step's target), as in Wan's scheduler.
        self.sigmas = torch.linspace(1.0, 0.0, steps + 1)
        self.computed = 0
        tail = model.blocks[-1]
        next(iter(tail.children())).register_forward_hook(lambda *a: self._count())

    def _count(self):
        self.computed += 1

    def __call__(self) -> torch.Tensor:
        model, x = self.model, self.inputs["hidden_states"]
        if getattr(model, "is_cache_enabled", False):
            model._reset_stateful_cache()
        self.computed = 0
        with torch.no_grad():
            for i in range(self.steps):
                sigma = self.sigmas[i]
                with model.cache_context("cond", step_index=i, sigma=float(sigma), num_inference_steps=self.steps):
                    v = model(hidden_states=x, timestep=(sigma * 1000).reshape(1).to(x.device),
                              encoder_hidden_states=self.inputs["encoder_hidden_states"], return_dict=False)[0]
                x = x + (self.sigmas[i + 1] - sigma).to(x.dtype) * v
        return x


def _time(ctx: Ctx, fn, *, collective: bool, warmup: int, repeats: int):
    """(median ms, all ms, last output) of ``fn`` (see bench_transformer.time_steps)."""
    out = None
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(repeats):
        if collective:
            ctx.barrier()
        elif ctx.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if ctx.cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), times, out


def _rel_err(out: torch.Tensor, ref: torch.Tensor | None) -> float | None:
    if ref is None:
        return None
    a, b = out.double(), ref.double().to(out.device)
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# --------------------------------------------------------------------------------- the threshold

def _ratios(loop: Loop) -> list[float]:
    """The residual ratios First Block Cache compares in one call that skips nothing (threshold 0),
    recorded through the head hook instance of this model."""
    from diffusers import FirstBlockCacheConfig

    model = loop.model
    model.enable_cache(FirstBlockCacheConfig(threshold=0.0))
    head = model.blocks[0]._diffusers_hook.hooks["fbc_leader_block_hook"]
    seen = []
    method = type(head)._should_compute_remaining_blocks.__get__(head)

    def record(residual):
        previous = head.state_manager.get_state().head_block_residual
        if previous is not None:
            seen.append(float((residual - previous).abs().float().mean() / previous.abs().float().mean()))
        return method(residual)

    head._should_compute_remaining_blocks = record
    try:
        loop()
    finally:
        model.disable_cache()
    return sorted(seen)


def auto_threshold(loop: Loop) -> tuple[float, int]:
    """(threshold, steps skipped) with the skip count closest to half the steps, by bisection over the
    midpoints of a non-skipping call's ratios (more threshold, more skipping, as a rule)."""
    from diffusers import FirstBlockCacheConfig

    ratios = _ratios(loop)
    candidates = [(a + b) / 2 for a, b in zip(ratios, ratios[1:])] or ratios
    target = loop.steps // 2
    best = None
    lo, hi = 0, len(candidates) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        loop.model.enable_cache(FirstBlockCacheConfig(threshold=candidates[mid]))
        try:
            loop()
        finally:
            loop.model.disable_cache()
        skipped = loop.steps - loop.computed
        if best is None or abs(skipped - target) < abs(best[1] - target):
            best = (candidates[mid], skipped)
        if skipped == target:
            break
        if skipped < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return best


# ------------------------------------------------------------------------------------------- rows

class Report:
    def __init__(self, ctx: Ctx, args):
        self.ctx, self.args = ctx, args
        self.meta = metadata(ctx, args)
        self.rows: list[dict] = []
        self.threshold = None

    def add(self, **row):
        self.rows.append(row)
        if self.ctx.is0:
            self.ctx.log(f"  {row['label']:<40} {self._ms(row):>12}  computed {row.get('steps_computed')}"
                         f"  {row.get('note') or ''}")
            if self.args.json:
                with open(self.args.json, "w") as f:
                    json.dump(self.json(), f, indent=1)

    @staticmethod
    def _ms(row) -> str:
        return "failed" if row.get("ms") is None else f"{row['ms']:.2f} ms"

    def json(self) -> dict:
        return dict(meta=self.meta, threshold=self.threshold, rows=self.rows)

    def table(self) -> str:
        lines = ["| row | ms per call | steps computed | rel. error vs stock (same cache) | note |",
                 "|---|---:|---:|---:|---|"]
        for r in self.rows:
            err = "" if r.get("rel_err") is None else f"{r['rel_err']:.2e}"
            lines.append(f"| {r['label']} | {self._ms(r)} | {r.get('steps_computed', '')} | {err} | {r.get('note') or ''} |")
        return "\n".join(lines)


def _agreed(ctx: Ctx, ok: bool) -> bool:
    """Whether every rank succeeded (one small all-reduce), so that all ranks skip a failed row alike."""
    return ctx.min(1.0 if ok else 0.0) == 1.0


def run(ctx: Ctx, args, report: Report) -> None:
    from diffusers import FirstBlockCacheConfig

    from diffusers_sp import enable_sequence_parallel
    from diffusers_sp.caches import _sum_over

    case = build_cases(args)["1.3b"]
    ctx.log(f"== {case['title']}, {args.steps} steps per call, world size {ctx.world}, {ctx.dtype} ==")
    model = build_model(ctx, case)
    inputs = build_inputs(ctx, case)
    loop = Loop(ctx, model, inputs, args.steps)

    # Threshold: chosen by rank 0 alone on the stock model, then shared.
    threshold = skipped = None
    if ctx.is0:
        if args.threshold == "auto":
            threshold, skipped = auto_threshold(loop)
        else:
            threshold = float(args.threshold)
    threshold = ctx.broadcast_object(threshold)
    report.threshold = dict(value=threshold, chosen="auto" if args.threshold == "auto" else "given",
                            steps_skipped_when_chosen=ctx.broadcast_object(skipped), tokens=tokens_of(case))
    ctx.log(f"  First Block Cache threshold {threshold:.6g} ({report.threshold['chosen']})")

    # Stock rows: rank 0 alone.
    refs = {}
    for cache in (False, True):
        label = f"stock, {'first block cache' if cache else 'no cache'}"
        ms = computed = note = None
        if ctx.is0:
            try:
                if cache:
                    model.enable_cache(FirstBlockCacheConfig(threshold=threshold))
                ms, _, out = _time(ctx, loop, collective=False, warmup=args.warmup, repeats=args.repeats)
                refs[cache], computed = out, loop.computed
            except Exception as exc:  # noqa: BLE001 - reported in the row
                note = f"{type(exc).__name__}: {exc}"
            finally:
                if cache and model.is_cache_enabled:
                    model.disable_cache()
        ctx.barrier()
        report.add(label=label, mode="stock", cache=cache, ranks=1, ms=ms, steps_computed=computed, rel_err=None,
                   note=note)

    # diffusers-sp rows: every rank.
    for mode in [m for m in args.modes.split(",") if m]:
        for cache in (False, True):
            label = f"ours {mode}, {'first block cache' if cache else 'no cache'}"
            ms = computed = note = err = None
            handle = None
            try:
                if cache:
                    model.enable_cache(FirstBlockCacheConfig(threshold=threshold))
                handle = enable_sequence_parallel(model, mode=mode)
                ms, _, out = _time(ctx, loop, collective=True, warmup=args.warmup, repeats=args.repeats)
                computed, err = loop.computed, _rel_err(out, refs.get(cache)) if ctx.is0 else None
                ok = True
            except Exception as exc:  # noqa: BLE001 - reported in the row, agreed on by all ranks
                note, ok = f"{type(exc).__name__}: {exc}", False
                if args.verbose:
                    traceback.print_exc()
            finally:
                if handle is not None:
                    handle.disable()
                if cache and model.is_cache_enabled:
                    model.disable_cache()
            if not _agreed(ctx, ok):
                ms, note = None, note or "failed on another rank"
            report.add(label=label, mode=mode, cache=cache, ranks=ctx.world, ms=None if ms is None else ctx.max(ms),
                       steps_computed=computed, rel_err=err, note=note)

    # The decision's collective alone.
    note = ms = None
    if ctx.world > 1:
        handle = enable_sequence_parallel(model, mode="kv_gather")
        try:
            group = handle.group
            values = [torch.tensor(1.0, device=ctx.device, dtype=torch.float64),
                      torch.tensor(2.0, device=ctx.device, dtype=torch.float64)]
            for _ in range(5):
                _sum_over(group, values)
            times = []
            for _ in range(args.collective_repeats):
                ctx.barrier()
                t0 = time.perf_counter()
                _sum_over(group, values)  # ends in .tolist(): the host has the totals
                times.append((time.perf_counter() - t0) * 1e3)
            ms = ctx.max(statistics.median(times))
        finally:
            handle.disable()
    else:
        note = "one rank: no collective (Diffusers' own decision runs)"
    report.add(label="decision collective (one per step)", mode="collective", cache=True, ranks=ctx.world,
               ms=ms, steps_computed=None, rel_err=None, note=note if note else f"{args.steps} decisions per call: "
               f"{args.steps * ms:.3f} ms per call")


def main(argv=None):
    args = parse_args(argv)
    ctx = Ctx(args)
    report = Report(ctx, args)
    ctx.log(f"{report.meta['date_utc']}, {report.meta['device']}, torch {report.meta['torch']}, "
            f"diffusers {report.meta['diffusers']}, commit {report.meta['git_commit']}")
    try:
        run(ctx, args, report)
    finally:
        if ctx.is0:
            print(report.table())
        finish(ctx, args.json, report.json())


if __name__ == "__main__":
    main()
