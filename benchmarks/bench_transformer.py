#!/usr/bin/env python
"""Times one transformer step of Wan-shaped models: stock Diffusers, diffusers-sp in every mode, and
Diffusers' own context parallelism, in one run, on 1..N GPUs of one machine.

Start it with torchrun (one process per GPU)::

    torchrun --nproc-per-node 1 benchmarks/bench_transformer.py --json results_1gpu.json
    torchrun --nproc-per-node 2 benchmarks/bench_transformer.py --json results_2gpu.json

or, for an end-to-end check on CPU with tiny shapes (gloo)::

    torchrun --nproc-per-node 2 benchmarks/bench_transformer.py --device cpu --quick

Cases (random weights, bf16 on CUDA, float32 on CPU):

* ``1.3b``: Wan2.1-1.3B config (12 heads x 128, 30 blocks), 480x832, 81 frames: latent
  [1, 16, 21, 60, 104] -> 32760 tokens, text [1, 512, 4096].
* ``14b``: Wan2.1-14B-shaped stack (40 heads x 128, ffn 13824, ``--layers14b`` blocks), 1280x720,
  81 frames: latent [1, 16, 21, 90, 160] -> 75600 tokens.

Rows per case:

* ``stock (native|cudnn|flash)``: the unmodified model alone on rank 0's GPU (the other ranks wait),
  with Diffusers' default attention backend, then forced to cuDNN / flash SDPA. ``stock (native)``
  is the reference for the speedup and the relative error (float32, ||out - ref|| / ||ref||).
* ``stock (native), every GPU at once`` (more than one rank): the unmodified model on every GPU at
  the same time; its note lists each GPU's time, its ``ms`` is the slowest. A split step waits for
  the slower GPU at every layer, so this row shows how much of a ratio below 2x (or above) is the
  GPUs' own pace difference (the lent H200 pairs differed by 0.1-2.7 %, ``experiments/ablate_comm.py``).
* ``stock (fa4)``: the same with Diffusers' ``flash_4_hub`` attention backend served by the
  FlashAttention-4 installed here (every attention call, self and cross; only where FA4 is installed).
* ``stock (native) + compile``: the same under ``torch.compile``.
* ``ours <mode>``: ``enable_sequence_parallel(model, mode)`` over all ranks (at world size 1 this is
  the processor overhead), ``ours <mode> + compile`` the same under ``torch.compile``. With
  FlashAttention-4 installed, ``attention_kernel="auto"`` runs the split self-attention on FA4 (the
  cross-attention stays on Diffusers' native backend); ``ours <mode> (fa4)`` also sets the model's
  backend to FA4 like ``stock (fa4)``, so every attention call runs the same kernel as that row.
  ``ours <mode> (cudnn ctx)`` (one GPU): ``attention_kernel="sdpa"`` under ``sdpa_kernel([cuDNN])``, the
  same kernels as ``stock (cudnn)``.
* ``diffusers ulysses (native|cudnn)``, ``diffusers ring (cudnn)``: ``model.enable_parallelism(
  config=ContextParallelConfig(...))`` on a fresh model, only when more than one rank runs.

Each time is the median of ``--repeats`` steps after ``--warmup`` steps (CUDA events; a barrier
before every step), the maximum over ranks of each rank's median. Peak memory is
``torch.cuda.max_memory_allocated`` (reset before each row) plus the symmetric memory held by the
copy-engine transport (outside PyTorch's allocator), the maximum over ranks. Every row runs
in try/except; a row's success is agreed on by all ranks, so a failing row is reported (note column)
and skipped alike everywhere.

Output: a markdown table on rank 0's stdout, and ``--json PATH`` (rewritten after every row, so a
run cut short keeps what it measured) with every row and the run's metadata.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

# The GPU machines forbid NVLink multicast (NVLS); NCCL reads this at communicator creation.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO))

from diffusers_sp.groups import destroy_process_groups  # noqa: E402

GIB = 1024 ** 3

# --------------------------------------------------------------------------------------------- cases

WAN_13B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
               text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
               qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
WAN_14B = dict(WAN_13B, num_attention_heads=40, ffn_dim=13824)


def build_cases(args) -> dict:
    """Case name -> dict(title, config, latent shape, text shape)."""
    if args.quick:
        tiny = dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=16,
                    out_channels=16, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True,
                    qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=64)
        layers = max(1, min(args.layers14b, 2))
        return {
            # 3*4*6 = 72 tokens: even over 2, 3, 4 ranks; 4 heads.
            "1.3b": dict(title="quick: tiny Wan (4 heads x 16, 2 blocks), 72 tokens", config=tiny,
                         latent=(1, 16, 3, 8, 12), text=(1, 16, 32)),
            # 3*3*5 = 45 tokens: uneven over 2 and 4 ranks (Diffusers' CP rows are expected to fail there).
            "14b": dict(title=f"quick: tiny Wan (6 heads x 16, {layers} blocks), 45 tokens",
                        config=dict(tiny, num_attention_heads=6, num_layers=layers),
                        latent=(1, 16, 3, 6, 10), text=(1, 16, 32)),
        }
    return {
        "1.3b": dict(title="Wan2.1-1.3B shape (12 heads x 128, 30 blocks), 480x832x81f, 32760 tokens",
                     config=WAN_13B, latent=(1, 16, 21, 60, 104), text=(1, 512, 4096)),
        "14b": dict(title=f"Wan2.1-14B shape (40 heads x 128, {args.layers14b} of 40 blocks), 1280x720x81f, "
                          f"75600 tokens", config=dict(WAN_14B, num_layers=args.layers14b),
                    latent=(1, 16, 21, 90, 160), text=(1, 512, 4096)),
    }


def tokens_of(case) -> int:
    p = case["config"]["patch_size"]
    _, _, f, h, w = case["latent"]
    return (f // p[0]) * (h // p[1]) * (w // p[2])


# ------------------------------------------------------------------------------------ distributed


class Ctx:
    """Rank, world size, device and small collective helpers (work without torch.distributed too)."""

    def __init__(self, args):
        self.args = args
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.cuda = args.device == "cuda"
        if self.cuda:
            if not torch.cuda.is_available():
                raise SystemExit("--device cuda but CUDA is not available (use --device cpu --quick)")
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
        else:
            self.device = torch.device("cpu")
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        if "WORLD_SIZE" in os.environ and not dist.is_initialized():
            kwargs = dict(backend="nccl" if self.cuda else "gloo",
                          timeout=datetime.timedelta(seconds=args.timeout))
            if self.cuda:
                kwargs["device_id"] = self.device
            dist.init_process_group(**kwargs)
        self.dist = dist.is_initialized()

    @property
    def is0(self) -> bool:
        return self.rank == 0

    def barrier(self):
        if self.dist:
            if self.cuda:
                dist.barrier(device_ids=[self.local_rank])
            else:
                dist.barrier()
        if self.cuda:
            torch.cuda.synchronize()

    def _reduce(self, value: float, op) -> float:
        if not self.dist:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return float(t.item())

    def max(self, value: float) -> float:
        return self._reduce(value, dist.ReduceOp.MAX if self.dist else None)

    def min(self, value: float) -> float:
        return self._reduce(value, dist.ReduceOp.MIN if self.dist else None)

    def gather_floats(self, value: float) -> list[float]:
        if not self.dist:
            return [value]
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        out = [torch.zeros_like(t) for _ in range(self.world)]
        dist.all_gather(out, t)
        return [float(x.item()) for x in out]

    def broadcast_object(self, obj):
        if not self.dist:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def log(self, *a):
        if self.is0:
            print(*a, flush=True)


# -------------------------------------------------------------------------------- model and inputs


def build_model(ctx: Ctx, case) -> torch.nn.Module:
    """A WanTransformer3DModel of the case's config with random weights, identical on every rank.

    Built directly on the device (fast default init there), cast like ``from_pretrained(torch_dtype=...)``
    (the model's ``_keep_in_fp32_modules`` stay float32), then every tensor is broadcast from rank 0 and
    a checksum is compared across ranks.
    """
    from diffusers import WanTransformer3DModel

    torch.manual_seed(ctx.args.seed)
    with torch.device(ctx.device):
        model = WanTransformer3DModel(**case["config"])
    model = model.to(ctx.device).eval().requires_grad_(False)
    keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    for mod_name, module in model.named_modules():
        for tensors in (module._parameters, module._buffers):
            for name, t in tensors.items():
                if t is None or not t.is_floating_point():
                    continue
                full = f"{mod_name}.{name}" if mod_name else name
                if not any(k in full for k in keep):
                    t.data = t.data.to(ctx.dtype)
    if ctx.dist:
        with torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(t.data, src=0)
    checksum = sum(float(t.detach().double().abs().sum()) for t in model.parameters())
    lo, hi = ctx.min(checksum), ctx.max(checksum)
    if lo != hi:
        raise RuntimeError(f"weights differ across ranks after the broadcast (checksums {lo} .. {hi})")
    return model


def build_inputs(ctx: Ctx, case) -> dict:
    g = torch.Generator().manual_seed(ctx.args.seed + 1)
    x = torch.randn(case["latent"], generator=g)
    e = torch.randn(case["text"], generator=g)
    inputs = dict(hidden_states=x.to(ctx.device, ctx.dtype), timestep=torch.tensor([500.0], device=ctx.device),
                  encoder_hidden_states=e.to(ctx.device, ctx.dtype), return_dict=False)
    if ctx.dist:
        for k in ("hidden_states", "timestep", "encoder_hidden_states"):
            dist.broadcast(inputs[k], src=0)
    return inputs


def free_memory(ctx: Ctx):
    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------ timing


def _symmetric_bytes() -> int:
    """Symmetric memory of diffusers-sp's copy-engine transport (0 for versions without it)."""
    try:
        from diffusers_sp.copy_engine import symmetric_memory_bytes
    except ImportError:
        return 0
    return symmetric_memory_bytes()


def finish(ctx: Ctx, path: str | None, report) -> None:
    """End of a benchmark script built on this one: rank 0 writes ``report`` as JSON to ``path``
    (if given), then every rank leaves the process group."""
    if ctx.is0 and path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
    destroy_process_groups(barrier=ctx.dist)


def _step(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    return out[0] if isinstance(out, (tuple, list)) else out.sample


def time_steps(ctx: Ctx, fn, *, collective: bool):
    """Runs ``fn`` warmup + repeats times; returns (median ms, list of ms, last output).

    ``collective``: all ranks run ``fn`` (barrier before each timed step); else only this rank does.
    """
    out = None
    for _ in range(ctx.args.warmup):
        out = fn()
    times = []
    for _ in range(ctx.args.repeats):
        if collective:
            ctx.barrier()
        elif ctx.cuda:
            torch.cuda.synchronize()
        if ctx.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            out = fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), times, out


_SDPA_OPS = {
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash_cpu",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable",
}


def attention_kernels(fn, text_len: int) -> str:
    """Profiles one call of ``fn`` (CPU activity: aten ops and their shapes) and names the SDPA backend
    ops that ran, split into self-attention and cross-attention (keys of the text's length),
    e.g. ``"self: cudnn x30; cross: flash x30"``. flash-attn package calls are counted as ``flash_attn``.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    counts = {"self": Counter(), "cross": Counter()}
    for evt in prof.events():
        name = evt.name
        kind = _SDPA_OPS.get(name)
        if kind is None and ("flash_attn" in name and "::" in name and "backward" not in name):
            kind = "flash_attn"
        if kind is None:
            continue
        shapes = getattr(evt, "input_shapes", None) or []
        key_len = None
        if len(shapes) > 1 and shapes[1] and len(shapes[1]) == 4:
            # aten SDPA ops: [B, H, S, D]; flash-attn: [B, S, H, D].
            key_len = shapes[1][1] if kind == "flash_attn" else shapes[1][2]
        counts["cross" if key_len == text_len else "self"][kind] += 1
    parts = []
    for which in ("self", "cross"):
        if counts[which]:
            parts.append(f"{which}: " + ", ".join(f"{k} x{v}" for k, v in sorted(counts[which].items())))
    return "; ".join(parts) or "no SDPA op seen"


def rel_error(out: torch.Tensor, ref: torch.Tensor | None) -> float | None:
    if ref is None or out is None:
        return None
    o = out.detach().float().cpu()
    if o.shape != ref.shape:
        return float("nan")
    return float((o - ref).norm() / ref.norm().clamp_min(1e-30))


def _sdpa_ctx(backend: str | None):
    if backend is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, backend)])


def _dynamo_stats() -> str:
    try:
        from torch._dynamo.utils import counters

        graphs = counters["stats"].get("unique_graphs", 0)
        breaks = sum(counters["graph_break"].values())
        return f"graphs={graphs}, graph breaks={breaks}"
    except Exception:  # pragma: no cover - private API
        return ""


def _dynamo_reset():
    try:
        torch._dynamo.reset()
        from torch._dynamo.utils import counters

        counters.clear()
    except Exception:  # pragma: no cover
        pass


# -------------------------------------------------------------------------------------------- rows


class Bench:
    def __init__(self, ctx: Ctx, args):
        self.ctx, self.args = ctx, args
        self.rows: list[dict] = []
        self.notes: list[str] = []
        self.meta = metadata(ctx, args)

    # rows ------------------------------------------------------------------------------------
    def row(self, case_name, label, fn, *, ranks: int, ref=None, base_ms=None, text_len=None, compile_row=False):
        """Runs one row. ``fn()`` -> (callable step, optional setup note, optional cleanup callable).

        ``ranks == 1``: only rank 0 runs it (others wait at a barrier); else every rank runs it.
        Success is agreed on by all ranks before the timing starts and after it.
        """
        ctx = self.ctx
        participate = ranks > 1 or ctx.is0
        collective = ranks > 1
        entry = dict(case=case_name, mode=label, ranks=ranks, status="ok", ms=None, ms_per_rank=None, speedup=None,
                     rel_err=None, peak_gib=None, compile_warmup_s=None, kernels=None, note="")
        out = None
        cleanup = None
        error = None
        free_memory(ctx)
        if ctx.cuda:
            torch.cuda.reset_peak_memory_stats()
        # Phase 1: set up (enable, compile wrapper...); agree on success.
        step = None
        if participate:
            try:
                step, note, cleanup = fn()
                entry["note"] = note or ""
            except Exception as exc:  # noqa: BLE001 - reported in the table
                error = exc
        status = self._agree(error, participate, collective, entry, "setup")
        # Phase 2: first call (compile warm-up when compiling) + timing + kernels; agree again.
        median = None
        if status and participate:
            try:
                if compile_row:
                    if collective:
                        ctx.barrier()
                    t0 = time.perf_counter()
                    step()
                    if ctx.cuda:
                        torch.cuda.synchronize()
                    entry["compile_warmup_s"] = time.perf_counter() - t0
                    entry["note"] = ", ".join(x for x in (entry["note"], _dynamo_stats()) if x)
                median, _, out = time_steps(ctx, step, collective=collective)
                if text_len is not None and not self.args.no_profile:
                    if collective:
                        ctx.barrier()
                    entry["kernels"] = attention_kernels(step, text_len)
            except Exception as exc:  # noqa: BLE001
                error = exc
            status = self._agree(error, participate, collective, entry, "run")
        if not collective:
            ctx.barrier()  # the other ranks waited here for rank 0
            if ctx.dist:  # share rank 0's verdict with everyone
                entry = ctx.broadcast_object(entry)
        if entry["status"] == "ok":
            per_rank = ctx.gather_floats(median if median is not None else float("nan")) if collective else [median]
            if collective:
                entry["ms_per_rank"] = per_rank
                entry["ms"] = max(per_rank)
            else:
                entry["ms"] = entry["ms_per_rank"] = None
                if ctx.is0:
                    entry["ms"] = median
                    entry["ms_per_rank"] = [median]
            if ctx.cuda:
                peak = (torch.cuda.max_memory_allocated() + _symmetric_bytes()) / GIB if participate else 0.0
                entry["peak_gib"] = ctx.max(peak) if collective else (peak if ctx.is0 else None)
            if ctx.is0:
                entry["rel_err"] = rel_error(out, ref)
                if base_ms:
                    entry["speedup"] = base_ms / entry["ms"]
        if cleanup is not None:
            try:
                cleanup()
            except Exception as exc:  # noqa: BLE001
                entry["note"] += f" (cleanup failed: {type(exc).__name__}: {exc})"
        if ctx.is0:
            self.rows.append(entry)
            print(f"  {label:<34} {fmt_row_brief(entry)}", flush=True)
            self.write_json()
        del out, step
        free_memory(ctx)
        return entry

    def _agree(self, error, participate, collective, entry, phase) -> bool:
        """All participating ranks agree whether the row may go on; records the error in the entry."""
        failed = 1.0 if error is not None else 0.0
        if collective:
            failed = self.ctx.max(failed)
        if failed:
            entry["status"] = "skipped" if _is_unavailable(error) else "failed"
            if error is not None:
                msg = f"{type(error).__name__}: {error}".replace("\n", " ")
                entry["note"] = (entry["note"] + "; " if entry["note"] else "") + f"{phase}: {msg[:400]}"
                if self.args.verbose:
                    traceback.print_exception(error)
            elif not entry["note"]:
                entry["note"] = f"{phase}: failed on another rank"
            return False
        return True

    def skip(self, case_name, label, note, ranks):
        entry = dict(case=case_name, mode=label, ranks=ranks, status="skipped", ms=None, ms_per_rank=None,
                     speedup=None, rel_err=None, peak_gib=None, compile_warmup_s=None, kernels=None, note=note)
        if self.ctx.is0:
            self.rows.append(entry)
            print(f"  {label:<34} skipped: {note}", flush=True)
            self.write_json()

    # output ----------------------------------------------------------------------------------
    def write_json(self):
        if not (self.ctx.is0 and self.args.json):
            return
        path = Path(self.args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(dict(meta=self.meta, notes=self.notes, rows=self.rows), indent=2, default=str))
        os.replace(tmp, path)


def _is_unavailable(error) -> bool:
    if error is None:
        return False
    try:
        from diffusers_sp import SequenceParallelConfigError
    except Exception:  # pragma: no cover
        return False
    # Raised before any work, identically on every rank: the combination does not run here (e.g. mode
    # "vsa" before it lands, Ulysses with fewer heads than ranks).
    return isinstance(error, SequenceParallelConfigError)


def fmt(x, spec):
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def fmt_row_brief(e) -> str:
    if e["status"] != "ok":
        return f"{e['status']}: {e['note']}"
    s = f"{fmt(e['ms'], '.1f')} ms, x{fmt(e['speedup'], '.2f')}, rel err {fmt(e['rel_err'], '.2e')}"
    if e["peak_gib"] is not None:
        s += f", peak {e['peak_gib']:.2f} GiB"
    if e["compile_warmup_s"] is not None:
        s += f", compile warm-up {e['compile_warmup_s']:.1f} s"
    if e["kernels"]:
        s += f" [{e['kernels']}]"
    return s


def markdown_table(rows: list[dict], cases: dict) -> str:
    lines = []
    for case_name in dict.fromkeys(r["case"] for r in rows):
        lines.append(f"\n### {case_name}: {cases[case_name]['title']}\n")
        lines.append("| mode | ranks | ms / step | speedup vs stock 1 GPU | rel. error | peak GiB / rank | "
                     "compile warm-up s | attention kernels | note |")
        lines.append("|---|---:|---:|---:|---:|---:|---:|---|---|")
        for r in rows:
            if r["case"] != case_name:
                continue
            note = r["note"] if r["status"] == "ok" else f"**{r['status']}**: {r['note']}"
            lines.append(
                f"| {r['mode']} | {r['ranks']} | {fmt(r['ms'], '.1f')} | {fmt(r['speedup'], '.2f')} | "
                f"{fmt(r['rel_err'], '.2e')} | {fmt(r['peak_gib'], '.2f')} | {fmt(r['compile_warmup_s'], '.1f')} | "
                f"{r['kernels'] or ''} | {note.replace('|', '/')} |")
    return "\n".join(lines)


def metadata(ctx: Ctx, args) -> dict:
    import diffusers

    commit = dirty = None
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True,
                                    timeout=10).stdout.strip()) if commit else None
    except Exception:  # noqa: BLE001 - no git on the machine
        pass
    try:
        import accelerate

        accel = accelerate.__version__
    except Exception:  # noqa: BLE001
        accel = None
    device_name = torch.cuda.get_device_name(ctx.device) if ctx.cuda else (platform.processor() or "cpu")
    return dict(
        date_utc=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        device=device_name, device_type=ctx.device.type, world_size=ctx.world,
        gpus_visible=torch.cuda.device_count() if ctx.cuda else 0,
        torch=torch.__version__, cuda=torch.version.cuda, cudnn=(torch.backends.cudnn.version() if ctx.cuda else None),
        diffusers=diffusers.__version__, accelerate=accel, python=platform.python_version(),
        git_commit=commit, git_dirty=dirty, command=" ".join(shlex.quote(a) for a in [sys.executable] + sys.argv),
        launcher_env={k: os.environ.get(k) for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "NCCL_NVLS_ENABLE")},
        dtype=str(ctx.dtype), args=vars(args),
    )


# --------------------------------------------------------------------------------- row factories


def stock_row(model, inputs, backend=None, compile_=False):
    def setup():
        m = torch.compile(model) if compile_ else model

        def step():
            with _sdpa_ctx(backend):
                return _step(m, inputs)

        return step, None, (_dynamo_reset if compile_ else None)

    return setup


def local_fa4_backend() -> str | None:
    """Diffusers' ``flash_4_hub`` attention backend, served by the FlashAttention-4 installed here.

    Diffusers loads that backend's function from the Hugging Face Hub through the ``kernels`` package;
    the GPU machines reach no Hub, so the function of the local ``flash_attn.cute`` is put in the
    backend's registry entry and the ``kernels`` requirement check is bypassed (benchmark only).
    Returns the backend name, or None where FA4 is not installed.
    """
    from diffusers_sp.kernels import fa4

    functions = fa4.fa4_functions()
    if functions is None:
        return None
    from diffusers.models import attention_dispatch as dispatch

    dispatch._HUB_KERNELS_REGISTRY[dispatch.AttentionBackendName.FLASH_4_HUB].kernel_fn = functions[0]
    dispatch.is_kernels_available = lambda: True
    dispatch.is_kernels_version = lambda *args, **kwargs: True
    return dispatch.AttentionBackendName.FLASH_4_HUB.value


def with_model_backend(model, backend, setup):
    """Row setup ``setup`` with ``model.set_attention_backend(backend)`` around it (reset at cleanup)."""

    def wrapped():
        model.set_attention_backend(backend)
        try:
            step, note, cleanup = setup()
        except Exception:
            model.reset_attention_backend()
            restore_attention_backend()
            raise

        def done():
            if cleanup is not None:
                cleanup()
            model.reset_attention_backend()
            restore_attention_backend()

        return step, note, done

    return wrapped


def ours_row(model, inputs, mode, options, compile_=False, backend=None):
    """``backend``: run the whole step under ``sdpa_kernel([backend])`` like ``stock (cudnn)``, so that the
    model's other attention calls (cross-attention) use the same kernel as the stock row: the difference
    is then the processors' own cost (our local kernel sets its own priority inside)."""

    def setup():
        from diffusers_sp import enable_sequence_parallel

        from diffusers_sp import SequenceParallelConfigError

        note = ""
        try:
            handle = enable_sequence_parallel(model, mode=mode, **options)
        except SequenceParallelConfigError as exc:
            extra = sorted(set(options) - {"attention_kernel"})
            if not (extra and "unknown option" in str(exc)):
                raise
            # Mode-specific options this version does not know (e.g. VSA's): try the mode with its defaults.
            handle = enable_sequence_parallel(model, mode=mode, attention_kernel=options["attention_kernel"])
            note = f"options {extra} not known to this version, ran with defaults"
        try:
            m = torch.compile(model) if compile_ else model
        except Exception:
            handle.disable()
            raise

        def step():
            with _sdpa_ctx(backend):
                return _step(m, inputs)

        def cleanup():
            handle.disable()
            if compile_:
                _dynamo_reset()

        if handle.mode != mode:
            note = ", ".join(x for x in (note, f"resolved mode {handle.mode}") if x)
        if getattr(handle, "transport", "nccl") != "nccl":
            note = ", ".join(x for x in (note, f"transfers by {handle.transport}") if x)
        return step, note, cleanup

    return setup


def diffusers_cp_row(ctx, case, inputs, holder, *, ulysses=1, ring=1, backend="native"):
    """Diffusers' own context parallelism on a fresh model (enable_parallelism is not reversible)."""

    def setup():
        from diffusers import ContextParallelConfig

        holder["model"] = None
        free_memory(ctx)
        model = build_model(ctx, case)
        holder["model"] = model
        model.set_attention_backend(backend)
        heads = case["config"]["num_attention_heads"]
        note = ""
        kwargs = dict(ulysses_degree=ulysses) if ulysses > 1 else dict(ring_degree=ring)
        if ulysses > 1 and (heads % ulysses or tokens_of(case) % ulysses):
            kwargs["ulysses_anything"] = True
            note = f"ulysses_anything=True ({heads} heads, {tokens_of(case)} tokens over {ulysses})"
        config = ContextParallelConfig(**kwargs)
        with _cpu_accelerator_shim(ctx):
            model.enable_parallelism(config=config)

        def step():
            return _step(model, inputs)

        def cleanup():
            holder["model"] = None
            restore_attention_backend()

        return step, note, cleanup

    return setup


_DEFAULT_BACKEND = []


def restore_attention_backend():
    """``ModelMixin.set_attention_backend`` also sets Diffusers' *global* active backend, which every model
    built afterwards inherits; put back the one that was active when the benchmark started."""
    try:
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry

        if not _DEFAULT_BACKEND:
            _DEFAULT_BACKEND.append(_AttentionBackendRegistry.get_active_backend()[0])
        else:
            _AttentionBackendRegistry.set_active_backend(_DEFAULT_BACKEND[0])
        return str(getattr(_DEFAULT_BACKEND[0], "value", _DEFAULT_BACKEND[0]))
    except Exception as exc:  # noqa: BLE001 - private API
        return f"unknown ({type(exc).__name__}: {exc})"


@contextlib.contextmanager
def _cpu_accelerator_shim(ctx):
    """On CPU, Diffusers' ``_resolve_parallel_config`` divides by ``torch.accelerator.device_count()`` (0);
    report 1 while it runs so that the CPU smoke run reaches Diffusers' CP code (gloo). No effect on CUDA."""
    if ctx.cuda or not hasattr(torch, "accelerator"):
        yield
        return
    original = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = original


# ---------------------------------------------------------------------------- standalone SDPA


def sdpa_report(ctx: Ctx, bench: Bench, case_name, case):
    """Rank 0 alone: which SDPA backend each path picks at the self-attention shape, and the achieved
    TFLOP/s (4*B*H*S^2*D flops) of each backend for one standalone call."""
    from torch.nn.attention import SDPBackend

    heads, hd = case["config"]["num_attention_heads"], case["config"]["attention_head_dim"]
    S = tokens_of(case)
    B = case["latent"][0]
    result = dict(case=case_name, shape=[B, heads, S, hd], dtype=str(ctx.dtype), picks={}, tflops={}, ms={},
                  errors={})
    if not ctx.is0:
        ctx.barrier()
        return None
    try:
        from diffusers_sp.kernels import sdpa as ours_sdpa

        g = torch.Generator(device=ctx.device).manual_seed(0)
        q, k, v = (torch.randn(B, heads, S, hd, device=ctx.device, dtype=ctx.dtype, generator=g) for _ in range(3))
        names = {int(v_): n for n, v_ in SDPBackend.__members__.items()}
        try:
            result["picks"]["stock (native, default priority)"] = names.get(int(torch._fused_sdp_choice(q, k, v)))
        except Exception as exc:  # noqa: BLE001
            result["errors"]["pick default"] = repr(exc)
        try:
            prio = getattr(ours_sdpa, "_CUDA_PRIORITY", None)
            if ctx.cuda and prio is not None:
                from torch.nn.attention import sdpa_kernel

                with sdpa_kernel(prio, set_priority=True):
                    result["picks"]["ours (local_attention auto)"] = names.get(int(torch._fused_sdp_choice(q, k, v)))
            use_fa = getattr(ours_sdpa, "_use_flash_attn", None)
            if use_fa is not None and use_fa(q, None, bench.args.attention_kernel):
                result["picks"]["ours (local_attention auto)"] = "flash-attn package"
            if "ours (local_attention auto)" not in result["picks"]:
                result["picks"]["ours (local_attention auto)"] = result["picks"].get("stock (native, default priority)")
        except Exception as exc:  # noqa: BLE001
            result["errors"]["pick ours"] = repr(exc)
        flops = 4.0 * B * heads * S * S * hd
        variants = [("default", lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))]
        if ctx.cuda:
            for b in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
                variants.append((b.lower(), (lambda b=b: _with(b, q, k, v))))
        variants.append(("ours", lambda: ours_sdpa.local_attention(q, k, v, kernel=bench.args.attention_kernel)))
        for name, fn in variants:
            try:
                with torch.no_grad():
                    ms, _, _ = time_steps(ctx, fn, collective=False)
                result["ms"][name] = ms
                result["tflops"][name] = flops / (ms * 1e-3) / 1e12
            except Exception as exc:  # noqa: BLE001
                result["errors"][name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        del q, k, v
    except Exception as exc:  # noqa: BLE001
        result["errors"]["setup"] = f"{type(exc).__name__}: {exc}"
    free_memory(ctx)
    ctx.barrier()
    return result


def _with(backend, q, k, v):
    with _sdpa_ctx(backend):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


# ---------------------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="1.3b,14b", help="comma-separated: 1.3b, 14b")
    p.add_argument("--modes", default="ulysses,kv_gather,vsa",
                   help="diffusers-sp modes to time (vsa is skipped with a note when not available)")
    p.add_argument("--compile-modes", default="ulysses,kv_gather",
                   help="diffusers-sp modes also timed under torch.compile ('' for none)")
    p.add_argument("--no-compile", action="store_true", help="no torch.compile rows (stock or ours)")
    p.add_argument("--no-diffusers-cp", action="store_true", help="no Diffusers context-parallel rows")
    p.add_argument("--no-stock-variants", action="store_true", help="skip stock (cudnn) / stock (flash)")
    p.add_argument("--no-stock-every-gpu", action="store_true",
                   help="skip the row timing the stock model on every GPU at once (each GPU's pace)")
    p.add_argument("--no-sdpa-report", action="store_true", help="skip the standalone SDPA TFLOP/s report")
    p.add_argument("--no-profile", action="store_true", help="do not profile one step per row for kernel names")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layers14b", type=int, default=4, help="blocks of the 14B-shaped stack (of 40)")
    p.add_argument("--attention-kernel", default="auto", help="diffusers-sp attention_kernel option")
    p.add_argument("--vsa-options", default='{"vsa_sparsity": 0.9}',
                   help="JSON dict of extra enable_sequence_parallel options for mode vsa")
    p.add_argument("--variants", default="{}",
                   help='JSON {label: [mode, {options}]}: extra rows "ours <label>", e.g. '
                        '\'{"kv_gather nccl": ["kv_gather", {"sp_transport": "nccl"}]}\'')
    p.add_argument("--json", default=None, help="write all rows and metadata to this path (rank 0)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="collective timeout in seconds")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failing rows")
    args = p.parse_args(argv)
    args.warmup = max(args.warmup, 1 if args.quick else 2)
    return args


def run_case(ctx: Ctx, bench: Bench, case_name: str, case: dict):
    args = bench.args
    S = tokens_of(case)
    text_len = case["text"][1]
    ctx.log(f"\n== {case_name}: {case['title']} (world size {ctx.world}, {ctx.dtype}) ==")
    restore_attention_backend()
    t0 = time.perf_counter()
    model = build_model(ctx, case)
    inputs = build_inputs(ctx, case)
    ctx.log(f"  model built in {time.perf_counter() - t0:.1f} s, "
            f"{sum(p.numel() for p in model.parameters()) / 1e9:.3f} B parameters, {S} tokens")

    # Reference and stock rows: rank 0 alone on its device.
    ref_holder = {}

    def stock_native():
        step, _, _ = stock_row(model, inputs)()

        def run():
            out = step()
            ref_holder["ref"] = out
            return out

        return run, None, None

    base = bench.row(case_name, "stock (native)", stock_native, ranks=1, text_len=text_len)
    ref = None
    if ctx.is0 and "ref" in ref_holder:
        ref = ref_holder.pop("ref").detach().float().cpu()
        if not torch.isfinite(ref).all():
            bench.notes.append(f"{case_name}: the stock output has non-finite values; relative errors are moot")
    ref_holder.clear()
    base_ms = base["ms"] if base["status"] == "ok" else None
    if ctx.is0 and base["status"] == "ok":
        bench.rows[-1]["rel_err"] = 0.0
        bench.rows[-1]["speedup"] = 1.0
    if ctx.world > 1 and not args.no_stock_every_gpu:
        # Every GPU runs the unsplit model at once: each GPU's own pace. A split step waits for the
        # slower GPU at every layer, and lent GPU pairs differ by up to a few percent.
        every = bench.row(case_name, "stock (native), every GPU at once", stock_row(model, inputs), ranks=ctx.world,
                          ref=ref, base_ms=base_ms)
        if ctx.is0 and every["status"] == "ok":
            every["note"] = "per GPU: " + " / ".join(f"{t:.1f}" for t in every["ms_per_rank"]) + " ms"
            bench.write_json()
    common = dict(ref=ref, base_ms=base_ms, text_len=text_len)
    if not args.no_stock_variants:
        for label, backend in (("stock (cudnn)", "CUDNN_ATTENTION"), ("stock (flash)", "FLASH_ATTENTION")):
            if ctx.cuda:
                bench.row(case_name, label, stock_row(model, inputs, backend), ranks=1, **common)
            else:
                bench.skip(case_name, label, "CUDA only", 1)
    fa4_backend = local_fa4_backend() if ctx.cuda else None
    if fa4_backend is not None:
        bench.row(case_name, "stock (fa4)", with_model_backend(model, fa4_backend, stock_row(model, inputs)),
                  ranks=1, **common)
    if not args.no_compile:
        bench.row(case_name, "stock (native) + compile", stock_row(model, inputs, compile_=True), ranks=1,
                  compile_row=True, **common)

    # Ours, every mode, all ranks.
    modes = [m for m in args.modes.split(",") if m]
    for mode in modes:
        options = dict(attention_kernel=args.attention_kernel)
        if mode == "vsa":
            options.update(json.loads(args.vsa_options))
        bench.row(case_name, f"ours {mode}", ours_row(model, inputs, mode, options), ranks=ctx.world, **common)
        if fa4_backend is not None:
            bench.row(case_name, f"ours {mode} (fa4)",
                      with_model_backend(model, fa4_backend, ours_row(model, inputs, mode, options)),
                      ranks=ctx.world, **common)
    for label, (mode, options) in json.loads(args.variants).items():
        options = dict(attention_kernel=args.attention_kernel, **options)
        bench.row(case_name, f"ours {label}", ours_row(model, inputs, mode, options), ranks=ctx.world, **common)
    if ctx.world == 1 and ctx.cuda and not args.no_stock_variants:
        # Processor overhead with the same kernels everywhere as `stock (cudnn)`.
        for mode in [m for m in modes if m in ("ulysses", "kv_gather")]:
            bench.row(case_name, f"ours {mode} (cudnn ctx)",
                      ours_row(model, inputs, mode, dict(attention_kernel="sdpa"),
                               backend="CUDNN_ATTENTION"), ranks=1, **common)
    if not args.no_compile:
        for mode in [m for m in args.compile_modes.split(",") if m]:
            options = dict(attention_kernel=args.attention_kernel)
            if mode == "vsa":
                options.update(json.loads(args.vsa_options))
            bench.row(case_name, f"ours {mode} + compile", ours_row(model, inputs, mode, options, compile_=True),
                      ranks=ctx.world, compile_row=True, **common)

    if not args.no_sdpa_report:
        rep = sdpa_report(ctx, bench, case_name, case)
        if rep is not None:
            bench.meta.setdefault("sdpa", []).append(rep)
            ctx.log(f"  standalone SDPA at {rep['shape']} ({rep['dtype']}): picks {rep['picks']}")
            ctx.log("    " + ", ".join(f"{k}: {rep['ms'][k]:.2f} ms = {rep['tflops'][k]:.1f} TFLOP/s"
                                       for k in rep["ms"]) + (f"; errors {rep['errors']}" if rep["errors"] else ""))
            bench.write_json()

    # Diffusers' context parallelism: fresh models, last (not reversible).
    del model
    free_memory(ctx)
    if ctx.world > 1 and not args.no_diffusers_cp:
        holder = {}
        N = ctx.world
        for label, kw in (("diffusers ulysses (native)", dict(ulysses=N, backend="native")),
                          ("diffusers ulysses (cudnn)", dict(ulysses=N, backend="_native_cudnn")),
                          ("diffusers ring (cudnn)", dict(ring=N, backend="_native_cudnn"))):
            bench.row(case_name, label, diffusers_cp_row(ctx, case, inputs, holder, **kw), ranks=N, **common)
            holder.clear()
            restore_attention_backend()
            free_memory(ctx)
    elif ctx.world == 1:
        bench.skip(case_name, "diffusers CP", "needs more than one rank", 1)
    del inputs
    free_memory(ctx)


def summary_lines(bench: Bench) -> list[str]:
    """'stock picks X, ours picks Y' per case, from the profiled rows, with their times."""
    lines = []
    for case_name in dict.fromkeys(r["case"] for r in bench.rows):
        rows = {r["mode"]: r for r in bench.rows if r["case"] == case_name}
        stock, picks = rows.get("stock (native)"), []
        if stock and stock["status"] == "ok":
            picks.append(f"stock (native) picks [{stock['kernels']}] at {fmt(stock['ms'], '.1f')} ms")
        for label in ("ours ulysses", "ours kv_gather"):
            r = rows.get(label)
            if r and r["status"] == "ok":
                over = ""
                if stock and stock["status"] == "ok" and r["ranks"] == 1:
                    over = f" ({(r['ms'] / stock['ms'] - 1) * 100:+.1f}% vs stock native"
                    cud, same = rows.get("stock (cudnn)"), rows.get(f"{label} (cudnn ctx)")
                    if cud and cud["status"] == "ok":
                        over += f", {(r['ms'] / cud['ms'] - 1) * 100:+.1f}% vs stock cudnn"
                        if same and same["status"] == "ok":
                            over += (f"; processor overhead with cuDNN everywhere: "
                                     f"{(same['ms'] / cud['ms'] - 1) * 100:+.1f}%")
                    over += ")"
                picks.append(f"{label} picks [{r['kernels']}] at {fmt(r['ms'], '.1f')} ms{over}")
        rep = next((x for x in bench.meta.get("sdpa", []) if x["case"] == case_name), None)
        if rep and rep["ms"]:
            fastest = min((k for k in rep["ms"] if k != "ours"), key=rep["ms"].get, default=None)
            if fastest is not None:
                picks.append(f"standalone SDPA fastest backend: {fastest} ({rep['tflops'][fastest]:.1f} TFLOP/s)"
                             + (f", ours {rep['tflops']['ours']:.1f} TFLOP/s" if "ours" in rep["tflops"] else ""))
        if picks:
            lines.append(f"{case_name}: " + "; ".join(picks))
    return lines


def main(argv=None):
    args = parse_args(argv)
    ctx = Ctx(args)
    cases = build_cases(args)
    wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in wanted if c not in cases]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; choose from {sorted(cases)}")
    bench = Bench(ctx, args)
    bench.meta["diffusers_active_backend"] = restore_attention_backend()
    ctx.log(f"bench_transformer: world size {ctx.world}, device {bench.meta['device']}, torch {torch.__version__}, "
            f"diffusers {bench.meta['diffusers']}, commit {bench.meta['git_commit']}")
    for name in wanted:
        try:
            run_case(ctx, bench, name, cases[name])
        except Exception as exc:  # noqa: BLE001 - e.g. the model does not fit: every rank fails alike
            msg = f"{name}: case aborted: {type(exc).__name__}: {exc}"
            ctx.log("  " + msg)
            if args.verbose:
                traceback.print_exc()
            bench.notes.append(msg)
        free_memory(ctx)
    if ctx.is0:
        bench.meta["summary"] = summary_lines(bench)
        bench.write_json()
        print("\n## Results\n")
        print(f"{bench.meta['date_utc']}, {bench.meta['device']} x{ctx.world}, torch {torch.__version__}, "
              f"diffusers {bench.meta['diffusers']}, commit {bench.meta['git_commit']}"
              f"{' (dirty)' if bench.meta['git_dirty'] else ''}")
        print(f"command: {bench.meta['command']}")
        print(markdown_table(bench.rows, cases))
        if bench.meta["summary"] or bench.notes:
            print()
        for line in bench.meta["summary"] + bench.notes:
            print(f"- {line}")
        for rep in bench.meta.get("sdpa", []):
            print(f"- standalone SDPA {rep['case']} {rep['shape']}: picks {rep['picks']}; "
                  + ", ".join(f"{k} {rep['tflops'][k]:.1f} TFLOP/s" for k in rep["tflops"]))
        if args.json:
            print(f"\nJSON: {args.json}")
    ctx.barrier()
    destroy_process_groups()


if __name__ == "__main__":
    main()
