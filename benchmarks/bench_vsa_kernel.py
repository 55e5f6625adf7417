"""Benchmark of the VSA kernel (diffusers_sp.kernels.vsa) against dense attention on one GPU.

Shape: the self-attention of Wan2.1-1.3B at 480x832, 81 frames: latent grid (T, H, W) =
(21, 30, 52) = 32760 tokens, 12 heads, head dim 128, batch 1, bfloat16. VSA tiles are (4, 4, 4).

Times (median of CUDA-event timings after warm-up):
  * dense ``F.scaled_dot_product_attention`` with the cuDNN and with the flash backend, and dense
    FlashAttention-4 (``flash_attn.cute``) where it is installed;
  * VSA (default backend: the Triton kernels, TMA loads on Hopper) at the given sparsity with a zero gate
    and with a random gate: ``packed`` on tile-ordered tokens without padding held as the model holds them
    (``[B, S, H, D]`` projections; the tokens travel in tile order through the transformer, so this is what
    one attention call costs), end to end from raster tokens (tiling q, k, v (and gate), VSA, untiling the
    output) and on pre-tiled tensors; the zero-gate case also with the flex backend; with
    FlashAttention-4 installed, the same with the FA4 block-sparse fine stage (``backend="fa4"``);
  * the fine stage alone (Triton default, Triton with ordinary loads, flex_attention with a prebuilt
    BlockMask, FA4 block-sparse; on Hopper also the warp-specialised Gluon kernel of
    ``kernels/vsa_gluon.py`` against Triton's on the call's packed tensors, and the whole call by backend), to
    separate the sparse kernel from the coarse stage and top-k;
  * ``--sweep``: the Triton kernels' launch configurations (``--sweep-coarse``: the coarse stage's only);
    ``--bound``: two stripped copies of the fine stage (loads only; loads and both matrix products without
    softmax), with ordinary and with TMA loads; ``--profile``: a ``torch.profiler`` summary of one packed
    call with a gate (time per kernel: tile means, tile scores, top-k, fine stage);
  * host time per call (Python and launches, the GPU kept busy) of the packed calls, the coarse stage and
    the fine stage, to tell a call on an idle GPU ("synced") waiting for its launches from the kernels' time.
Checks VSA at sparsity 0 with a zero gate against dense attention, and the backends against each
other (relative Frobenius error <= 1e-2 in bf16; the script exits 1 otherwise).

    python benchmarks/bench_vsa_kernel.py --json out.json [--quick] [--sweep | --sweep-coarse] [--bound] [--profile] [--only REGEX]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from diffusers_sp.kernels import fa4, vsa  # noqa: E402
from diffusers_sp.kernels import vsa_coarse_triton, vsa_flex, vsa_gluon, vsa_triton  # noqa: E402
from diffusers_sp.kernels.vsa import (  # noqa: E402
    make_tile_layout, tile_range_tokens, tile_tokens, untile_tokens, video_sparse_attention,
    video_sparse_attention_packed, vsa_topk)

FULL_GRID = (21, 30, 52)
QUICK_GRID = (9, 16, 24)
TILE = (4, 4, 4)
HEADS, HEAD_DIM, BATCH = 12, 128, 1
ACCURACY_LIMIT = 1e-2
#: Cases whose host time per call is also measured (:func:`time_host_ms`).
HOST_TIMED = ("vsa_zero_gate_packed", "vsa_random_gate_packed", "vsa_random_gate_packed_plan",
              "coarse_stage_and_topk_packed", "fine_stage_only_triton")


def time_ms(fn, warmup: int, iters: int) -> float:
    """Median wall time of ``fn`` on the GPU in milliseconds, one CUDA-event pair per call, the GPU idle
    before each call (so the host's launch latency of a call of many small kernels counts)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_ms_back_to_back(fn, iters: int) -> float:
    """Milliseconds per call of ``iters`` calls queued back to back between one CUDA-event pair: the cost
    inside a model, where the host queues the next kernels while the GPU runs earlier ones."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def time_host_ms(fn, iters: int) -> float:
    """Median host time of one call in milliseconds: its Python and kernel launches, timed while an earlier
    sleep kernel keeps the GPU busy, so that no launch waits for the device. Where a call's host time exceeds
    its device time, the GPU idles between its kernels unless earlier work is queued ahead of them."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        torch.cuda._sleep(50_000_000)  # GPU clock cycles: ~25 ms, far longer than one call's launches
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize()
    return statistics.median(times)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def _with_config(kernels, config: dict, fn):
    """``fn()`` with the launch configuration of ``kernels`` (:mod:`vsa_triton`, the fine stage, or
    :mod:`vsa_coarse_triton`, the coarse stage) overridden by ``config``."""
    from unittest import mock

    with mock.patch.object(kernels, "DEFAULT_CONFIG", dict(kernels.DEFAULT_CONFIG, **config)):
        return fn()


def _with_gluon_fine_stage(fn, **options):
    """``fn()`` with the packed VSA call's fine stage run by the warp-specialised Gluon kernel
    (:mod:`vsa_gluon`, launch ``options``) instead of the Triton one."""
    from unittest import mock

    def gluon_stage(q, k, v, selected, **kwargs):
        kwargs.pop("config", None)
        return vsa_gluon.fine_stage_gluon_packed(q, k, v, selected, **kwargs, **options)

    with mock.patch.object(vsa, "fine_stage_triton_packed", gluon_stage):
        return fn()


def _stripped_fine_stage(q, k, v, selected, part: str, stages: int):
    """The Triton fine stage with work removed, to bound it: ``part="loads"`` streams the same K and V
    tiles through the same grid and adds them up; ``"dots"`` also runs both matrix products (no
    softmax). Benchmark only: the result is not attention."""
    import triton
    import triton.language as tl

    if not hasattr(_stripped_fine_stage, "kernel"):
        @triton.jit
        def kernel(Q, K, V, Out, Sel, s_qh, s_qn, s_kh, s_kn, s_sh, s_sn, topk,
                   TILE: tl.constexpr, HEAD_DIM: tl.constexpr, DOTS: tl.constexpr):
            q_tile = tl.program_id(0).to(tl.int64)
            h = tl.program_id(1).to(tl.int64)
            rows = tl.arange(0, TILE)
            dims = tl.arange(0, HEAD_DIM)
            tile_offs = rows[:, None] * HEAD_DIM + dims[None, :]
            q = tl.load(Q + h * s_qh + q_tile * s_qn + tile_offs)
            acc = tl.zeros([TILE, HEAD_DIM], dtype=tl.float32)
            for i in range(0, topk):
                kv_tile = tl.load(Sel + h * s_sh + q_tile * s_sn + i).to(tl.int64)
                kk = tl.load(K + h * s_kh + kv_tile * s_kn + tile_offs)
                vv = tl.load(V + h * s_kh + kv_tile * s_kn + tile_offs)
                if DOTS:
                    s = tl.dot(q, tl.trans(kk))
                    acc += tl.dot(s.to(vv.dtype), vv)
                else:
                    acc += kk.to(tl.float32) + vv.to(tl.float32)
            tl.store(Out + h * s_qh + q_tile * s_qn + tile_offs, acc.to(Out.dtype.element_ty))

        _stripped_fine_stage.kernel = kernel
    q, k, v = (t.contiguous() for t in (q, k, v))
    out = torch.empty_like(q)
    _, heads, tiles, tile_volume, head_dim = q.shape
    sel = selected.contiguous()
    _stripped_fine_stage.kernel[(tiles, heads)](
        q, k, v, out, sel, q.stride(1), q.stride(2), k.stride(1), k.stride(2), sel.stride(1), sel.stride(2),
        sel.shape[-1], TILE=tile_volume, HEAD_DIM=head_dim, DOTS=part == "dots", num_warps=4, num_stages=stages)
    return out


def _stripped_fine_stage_tma(q, k, v, selected, part: str, stages: int):
    """As :func:`_stripped_fine_stage`, with the query and key/value tiles loaded by the tensor-memory
    accelerator (TMA, host tensor descriptors) as the fine stage loads them on Hopper, key loop pipelined
    ``stages`` deep. ``"loads"`` bounds what feeding the fine stage costs, ``"dots"`` what it would cost with
    the softmax hidden entirely under the matrix products (a warp-specialised kernel's best case).
    Benchmark only: the result is not attention."""
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    if not hasattr(_stripped_fine_stage_tma, "kernel"):
        @triton.jit
        def kernel(q_desc, k_desc, v_desc, o_desc, Sel, s_sh, s_sn, num_tiles, topk,
                   TILE: tl.constexpr, HEAD_DIM: tl.constexpr, DOTS: tl.constexpr, STAGES: tl.constexpr):
            q_tile = tl.program_id(0)
            h = tl.program_id(1)
            base = h * num_tiles * TILE  # batch 1: row of token 0 of head h in the [H * N * V, D] table
            q = q_desc.load([base + q_tile * TILE, 0])
            acc = tl.zeros([TILE, HEAD_DIM], dtype=tl.float32)
            for i in tl.range(0, topk, num_stages=STAGES):
                row = base + tl.load(Sel + h * s_sh + q_tile * s_sn + i) * TILE
                kk = k_desc.load([row, 0])
                vv = v_desc.load([row, 0])
                if DOTS:
                    s = tl.dot(q, tl.trans(kk))
                    acc = tl.dot(s.to(vv.dtype), vv, acc)
                else:
                    acc += kk.to(tl.float32) + vv.to(tl.float32)
            o_desc.store([base + q_tile * TILE, 0], acc.to(o_desc.dtype))

        _stripped_fine_stage_tma.kernel = kernel
    batch, heads, tiles, tile_volume, head_dim = q.shape
    assert batch == 1, "the stripped kernels index batch 1"
    out = torch.empty_like(q)
    descs = [TensorDescriptor.from_tensor(t.contiguous().view(-1, head_dim), [tile_volume, head_dim])
             for t in (q, k, v, out)]
    sel = selected.to(torch.int32).contiguous()
    _stripped_fine_stage_tma.kernel[(tiles, heads)](
        *descs, sel, sel.stride(1), sel.stride(2), tiles, sel.shape[-1], TILE=tile_volume, HEAD_DIM=head_dim,
        DOTS=part == "dots", STAGES=stages, num_warps=4)
    return out


def profile_call(fn, calls: int = 10) -> list[dict]:
    """CUDA time per kernel of ``fn`` (``torch.profiler``, ``calls`` calls after a warm-up), in ms per call,
    largest first."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = [{"kernel": e.key, "cuda_ms": e.device_time_total / 1e3 / calls, "calls": e.count // calls}
            for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r["cuda_ms"])[:12]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True, help="where to write the results")
    parser.add_argument("--quick", action="store_true", help=f"small grid {QUICK_GRID} instead of {FULL_GRID}")
    parser.add_argument("--tile", default=",".join(map(str, TILE)),
                        help="the VSA tile in latent patches, frames first (4,4,4: 64 tokens; 2,8,8 and 4,4,8: 128; "
                             "4,8,8: 256)")
    parser.add_argument("--sparsity", type=float, default=0.9)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--sweep", action="store_true",
                        help="also time the Triton fine stage under several launch configurations")
    parser.add_argument("--sweep-coarse", action="store_true",
                        help="also time the coarse-stage kernels under several launch configurations (in --sweep)")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one packed VSA call with a gate (CUDA time per kernel)")
    parser.add_argument("--bound", action="store_true",
                        help="also time two stripped copies of the fine stage (same grid, same gathers): "
                             "loads only, and loads with both matrix products but no softmax (ordinary and TMA "
                             "loads)")
    parser.add_argument("--no-gluon", action="store_true", help="leave out the Gluon fine stage")
    parser.add_argument("--only", default=None, metavar="REGEX",
                        help="time only the cases whose name matches this regular expression (the accuracy checks "
                             "run in full)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_vsa_kernel.py needs a CUDA GPU", file=sys.stderr)
        return 2

    grid = QUICK_GRID if args.quick else FULL_GRID
    device, dtype = torch.device("cuda"), torch.bfloat16
    tile = tuple(int(t) for t in args.tile.split(","))
    layout = make_tile_layout(grid, tile, device=device)
    seq = layout.num_tokens
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, gate = (torch.randn(BATCH, HEADS, seq, HEAD_DIM, device=device, dtype=dtype, generator=gen)
                     for _ in range(4))
    qt, kt, vt, gate_t = (tile_tokens(x, layout, dim=2) for x in (q, k, v, gate))
    block_sizes = layout.block_sizes
    topk = vsa_topk(layout.num_tiles, args.sparsity)
    timing = dict(warmup=args.warmup, iters=args.iters)

    def dense(backend):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v)

    def vsa_tiled(query, key, value, gate_tiled, sparsity, backend="triton"):
        return video_sparse_attention(query, key, value, q_block_sizes=block_sizes, kv_block_sizes=block_sizes,
                                      sparsity=sparsity, gate=gate_tiled, backend=backend)

    # Packed tile order as the processor holds it: [B, S, H, D] projections read as [B, H, S, D].
    order = tile_range_tokens(layout, 0, layout.num_tiles)
    packed = [x.index_select(2, order).transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v, gate)]

    def vsa_packed(with_gate, sparsity=args.sparsity, backend="auto"):
        return video_sparse_attention_packed(*packed[:3], tile_volume=layout.tile_volume, q_block_sizes=block_sizes,
                                             kv_block_sizes=block_sizes, sparsity=sparsity,
                                             gate=packed[3] if with_gate else None, backend=backend)

    # As the VSA processor calls it: int32 sizes and offsets made once (the tile plan's), not per call.
    plan_tiles = dict(q_block_sizes=block_sizes.to(torch.int32), kv_block_sizes=block_sizes.to(torch.int32),
                      q_block_offsets=vsa.packed_offsets(block_sizes), kv_block_offsets=vsa.packed_offsets(block_sizes))

    def vsa_packed_plan(with_gate):
        return video_sparse_attention_packed(*packed[:3], tile_volume=layout.tile_volume, sparsity=args.sparsity,
                                             gate=packed[3] if with_gate else None, **plan_tiles)

    def vsa_end_to_end(with_gate, backend="triton"):
        tiled = [tile_tokens(x, layout, dim=2) for x in (q, k, v)]
        gate_tiled = tile_tokens(gate, layout, dim=2) if with_gate else None
        return untile_tokens(vsa_tiled(*tiled, gate_tiled, args.sparsity, backend), layout, dim=2)

    # The fine stage alone: the selection and BlockMask are built once, outside the timing.
    scores = vsa._tile_means(qt, block_sizes) @ vsa._tile_means(kt, block_sizes).transpose(-1, -2)
    selected = scores.topk(topk, dim=-1).indices
    block_mask = vsa_flex.selection_block_mask(selected, block_sizes, layout.tile_volume)
    flat = [x.flatten(2, 3) for x in (qt, kt, vt)]
    kernel_options = vsa_flex.flex_kernel_options(layout.tile_volume, HEAD_DIM, qt.element_size())

    def fine_stage_only():
        return vsa_flex.compiled_flex_attention()(*flat, block_mask=block_mask, kernel_options=kernel_options)

    scale = HEAD_DIM ** -0.5

    def triton_fine_stage_only(config=None):
        return vsa_triton.fine_stage_triton(qt, kt, vt, selected, block_sizes, scale, config=config)

    def coarse_and_topk(sorted_topk=True):
        s = vsa._tile_means(qt, block_sizes) @ vsa._tile_means(kt, block_sizes).transpose(-1, -2)
        return s.topk(topk, dim=-1, sorted=sorted_topk).indices

    def fa4_fine_stage_only():
        return fa4.fa4_block_sparse_fine_stage(qt, kt, vt, selected, block_sizes, scale)

    def fa4_whole_tiles_bound():
        # Every selected key tile passed as a full block (padded slots attended: not VSA's result). Bounds
        # what the FA4 path would cost if the partial edge tiles needed no mask_mod.
        whole = torch.full_like(block_sizes, layout.tile_volume)
        return fa4.fa4_block_sparse_fine_stage(qt, kt, vt, selected, whole, scale)

    sizes32 = block_sizes.to(torch.int32)
    offsets32 = vsa.packed_offsets(sizes32)

    def coarse_packed(config=None, with_output=True):  # as the packed path runs it: the three coarse kernels
        return vsa_coarse_triton._launch_coarse(*packed[:3], offsets32, sizes32, offsets32, sizes32,
                                                layout.tile_volume, topk, scale, with_output, config)

    def coarse_packed_torch():  # the means kernel, then products, softmax, product and top-k in torch
        means = [vsa_coarse_triton.tile_means_triton(x, offsets32, sizes32, layout.tile_volume) for x in packed[:3]]
        products = means[0] @ means[1].transpose(-1, -2)
        coarse = torch.softmax(products * scale, dim=-1) @ means[2]
        return products.topk(topk, dim=-1, sorted=False).indices, coarse

    packed_stage_args = dict(q_offsets=offsets32, q_sizes=sizes32, kv_offsets=offsets32, kv_sizes=sizes32,
                             tile_volume=layout.tile_volume, scale=scale)

    def triton_packed_fine_stage_only():
        return vsa_triton.fine_stage_triton_packed(*packed[:3], selected, **packed_stage_args)

    def gluon_fine_stage_only(**options):
        return vsa_gluon.fine_stage_gluon_packed(*packed[:3], selected, **packed_stage_args, **options)

    cases = {
        "dense_sdpa_cudnn": lambda: dense(SDPBackend.CUDNN_ATTENTION),
        "dense_sdpa_flash": lambda: dense(SDPBackend.FLASH_ATTENTION),
        "vsa_zero_gate_packed": lambda: vsa_packed(with_gate=False),
        "vsa_random_gate_packed": lambda: vsa_packed(with_gate=True),
        "vsa_random_gate_packed_plan": lambda: vsa_packed_plan(with_gate=True),
        "coarse_stage_and_topk_packed": coarse_packed,
        "coarse_stage_and_topk_packed_no_output": lambda: coarse_packed(with_output=False),  # no gate: the step's
        "coarse_stage_and_topk_packed_torch": coarse_packed_torch,
        "vsa_zero_gate_end_to_end": lambda: vsa_end_to_end(with_gate=False),
        "vsa_random_gate_end_to_end": lambda: vsa_end_to_end(with_gate=True),
        "vsa_zero_gate_kernel": lambda: vsa_tiled(qt, kt, vt, None, args.sparsity),
        "vsa_random_gate_kernel": lambda: vsa_tiled(qt, kt, vt, gate_t, args.sparsity),
        "vsa_zero_gate_kernel_flex": lambda: vsa_tiled(qt, kt, vt, None, args.sparsity, "flex"),
        "coarse_stage_and_topk": coarse_and_topk,
        "fine_stage_only_triton": triton_fine_stage_only,
        "fine_stage_only_flex": fine_stage_only,
    }
    if layout.tile_volume > 64:  # the whole call on the Triton fine stage with query blocks of 128 rows, not 64
        cases["vsa_random_gate_packed_m128"] = lambda: _with_config(
            vsa_triton, {"block_m": 128}, lambda: vsa_packed(with_gate=True, backend="triton"))
    cases["coarse_stage_and_topk_unsorted"] = lambda: coarse_and_topk(sorted_topk=False)
    # The Triton fine stage on the block list against walking every key block and query block (empty included).
    cases["fine_stage_only_triton_packed_block_list"] = triton_packed_fine_stage_only
    cases["fine_stage_only_triton_packed_every_block"] = lambda: vsa_triton.fine_stage_triton_packed(
        *packed[:3], selected, **packed_stage_args, config={"skip_empty_blocks": False})
    # The short key steps for the ends of partial tiles: 32 / 16 rows after the 64-row steps (the default),
    # 32 alone, and none ("plain": every block in a step of 64 rows).
    step_variants = {"plain": {"short_steps": ()}, "short": {"short_steps": (32, 16)}, "short32": {"short_steps": (32,)}}
    for name, config in step_variants.items():
        cases[f"fine_stage_only_triton_packed_{name}"] = (lambda c=config: vsa_triton.fine_stage_triton_packed(
            *packed[:3], selected, **packed_stage_args, config=c))
        cases[f"vsa_random_gate_packed_{name}"] = lambda c=config: _with_config(
            vsa_triton, c, lambda: vsa_packed(with_gate=True, backend="triton"))
    cases["vsa_random_gate_packed_every_block"] = lambda: _with_config(
        vsa_triton, {"skip_empty_blocks": False}, lambda: vsa_packed(with_gate=True, backend="triton"))
    # The top-k kernel alone on this call's tile scores, with and without the common-prefix start and early exit.
    tile_scores = vsa._tile_means(qt, block_sizes) @ vsa._tile_means(kt, block_sizes).transpose(-1, -2)
    for early_exit in (True, False):
        cases[f"topk_only_{'early_exit' if early_exit else 'full_radix'}"] = (
            lambda e=early_exit: vsa_coarse_triton.topk_tiles_triton(tile_scores, topk, early_exit=e))
    has_fa4 = fa4.fa4_block_sparse_applies(qt, kt, vt) is None
    if fa4.fa4_installed():  # dense FA4 at every tiling: the block-sparse path takes 64-slot tiles only
        cases["dense_fa4"] = lambda: fa4.fa4_attention(q, k, v)
    if has_fa4:
        cases.update({
            "vsa_zero_gate_end_to_end_fa4": lambda: vsa_end_to_end(with_gate=False, backend="fa4"),
            "vsa_random_gate_end_to_end_fa4": lambda: vsa_end_to_end(with_gate=True, backend="fa4"),
            "vsa_zero_gate_kernel_fa4": lambda: vsa_tiled(qt, kt, vt, None, args.sparsity, "fa4"),
            "fine_stage_only_fa4": fa4_fine_stage_only,
            "bound_fa4_all_blocks_full": fa4_whole_tiles_bound,
        })
    cases["fine_stage_only_triton_plain_s2"] = lambda: triton_fine_stage_only({"tma": False, "num_stages": 2})
    has_gluon = not args.no_gluon and vsa_gluon.gluon_applies(*packed[:3], layout.tile_volume)
    if has_gluon:  # the warp-specialised Gluon fine stage against Triton's on the packed tensors of the call
        cases["fine_stage_only_triton_packed"] = triton_packed_fine_stage_only
        variants = (((2, 128, False), (3, 128, False), (3, 255, False), (4, 255, False), (2, 128, True),
                     (3, 128, True), (4, 255, True)) if layout.tile_volume == 64 else  # one consumer warpgroup
                    ((2, 168, False), (3, 168, False), (4, 168, False), (5, 168, False), (3, 168, True),
                     (4, 168, True)))  # two consumer warpgroups on 128 query rows, one program a multiprocessor
        for stages, regs, overlap in variants:
            cases[f"fine_stage_only_gluon_s{stages}_r{regs}{'_overlap' if overlap else ''}"] = (
                lambda st=stages, r=regs, o=overlap: gluon_fine_stage_only(stages=st, max_registers=r,
                                                                           overlap_values=o))
        cases["vsa_random_gate_packed_triton"] = lambda: vsa_packed(with_gate=True, backend="triton")
        cases["vsa_random_gate_packed_gluon"] = lambda: vsa_packed(with_gate=True, backend="gluon")
        cases["vsa_random_gate_packed_gluon_overlap"] = lambda: _with_gluon_fine_stage(
            lambda: vsa_packed(with_gate=True, backend="triton"), overlap_values=True)
    if args.sweep:
        for stages in (2, 3, 4, 5, 6):
            cfg = {"tma": True, "num_stages": stages}
            cases[f"triton_tma_s{stages}"] = (lambda c=cfg: triton_fine_stage_only(c))
        for warps, stages in ((4, 3), (8, 2), (8, 4)):
            cfg = {"tma": warps == 8, "num_warps": warps, "num_stages": stages}
            cases[f"triton_{'tma' if cfg['tma'] else 'plain'}_w{warps}_s{stages}"] = (
                lambda c=cfg: triton_fine_stage_only(c))
        for block_m, warps, stages in ((64, 4, 5), (128, 4, 2), (128, 4, 3), (128, 4, 4), (128, 8, 5)):
            if layout.tile_volume % block_m == 0:  # query rows per program (tiles of 128 slots and more)
                cfg = {"tma": True, "block_m": block_m, "num_warps": warps, "num_stages": stages}
                cases[f"triton_tma_m{block_m}_w{warps}_s{stages}"] = (lambda c=cfg: triton_fine_stage_only(c))
        for warps, stages in ((4, 2), (8, 3)):  # Triton's warp specialisation of the key loop
            cfg = {"tma": True, "num_warps": warps, "num_stages": stages, "warp_specialize": True}
            cases[f"triton_tma_ws_w{warps}_s{stages}"] = (lambda c=cfg: triton_fine_stage_only(c))
    coarse_configs = {}
    if args.sweep or args.sweep_coarse:  # the coarse stage's launch configurations, alone and in the packed call
        coarse_configs = {"means_w1": {"mean_warps": 1}, "means_w4": {"mean_warps": 4}, "means_w8": {"mean_warps": 8},
                          "means_h2": {"mean_heads": 2}, "means_h4_w4": {"mean_heads": 4, "mean_warps": 4},
                          "scores_w8": {"score_warps": 8}, "scores_c32": {"score_cols": 32},
                          "scores_c32_s3": {"score_cols": 32, "score_stages": 3}, "scores_r32_w8": {"score_rows": 32,
                                                                                               "score_warps": 8},
                          "scores_s1": {"score_stages": 1}, "output_tf32": {"output_precision": "tf32"},
                          "select2": {"select_rows": 2}, "select1_bits2": {"select_bits": 2},
                          "select_full_radix": {"select_early_exit": False}}
        for label, cfg in coarse_configs.items():
            cases[f"coarse_{label}"] = (lambda c=cfg: coarse_packed(c))
            cases[f"vsa_random_gate_packed_{label}"] = (lambda c=cfg: _with_config(
                vsa_coarse_triton, c, lambda: vsa_packed(with_gate=True)))
    if args.bound:
        for part in ("loads", "dots"):
            for stages in (2, 3, 4):
                cases[f"bound_{part}_only_s{stages}"] = (
                    lambda p=part, st=stages: _stripped_fine_stage(qt, kt, vt, selected, p, st))
            if layout.tile_volume == 64:  # TMA loads, as the fine stage loads on Hopper (one key block a tile)
                for stages in (3, 5):
                    cases[f"bound_tma_{part}_only_s{stages}"] = (
                        lambda p=part, st=stages: _stripped_fine_stage_tma(qt, kt, vt, selected, p, st))
    if args.only:
        cases = {name: fn for name, fn in cases.items() if re.search(args.only, name)}
    results = {}
    for name, fn in cases.items():
        try:
            results[name] = {"ms": time_ms(fn, **timing)}
            if name.startswith("vsa") or name.startswith("coarse"):
                results[name]["ms_back_to_back"] = time_ms_back_to_back(fn, args.iters)
            if name in HOST_TIMED:
                results[name]["host_ms"] = time_host_ms(fn, args.iters)
        except Exception as err:  # e.g. an SDPA backend or a launch configuration that does not fit
            results[name] = {"ms": None, "error": str(err).splitlines()[0]}

    dense_flops = 4 * BATCH * HEADS * seq * seq * HEAD_DIM
    sparse_flops = 4 * BATCH * HEADS * (layout.num_tiles * layout.tile_volume) * (topk * layout.tile_volume) * HEAD_DIM
    best_dense = min((r["ms"] for n, r in results.items() if n.startswith("dense") and r["ms"]), default=None)
    dense_refs = {name: results[name]["ms"] for name in ("dense_sdpa_cudnn", "dense_fa4")
                  if results.get(name, {}).get("ms")}
    for name, r in results.items():
        if r["ms"] is None:
            continue
        flops = dense_flops if name.startswith("dense") else 0 if name.startswith("coarse") else sparse_flops
        r["tflops"] = flops / (r["ms"] * 1e-3) / 1e12
        if best_dense is not None:
            r["speedup_vs_best_dense"] = best_dense / r["ms"]
        for ref_name, ref_ms in dense_refs.items():
            r[f"speedup_vs_{ref_name}"] = ref_ms / r["ms"]

    # Accuracy: VSA with sparsity 0 and a zero gate is dense attention.
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        dense_out = F.scaled_dot_product_attention(q, k, v)
    vsa_dense_out = untile_tokens(vsa_tiled(qt, kt, vt, None, 0.0), layout, dim=2)
    error = relative_error(vsa_dense_out, dense_out)
    # The Triton and flex fine stages on the same selection (sparsity as benchmarked).
    backends_error = relative_error(vsa_tiled(qt, kt, vt, None, args.sparsity, "triton"),
                                    vsa_tiled(qt, kt, vt, None, args.sparsity, "flex"))
    # The packed path (gate included) against the padded one, and at sparsity 0 against dense.
    packed_gate_out = vsa_packed(with_gate=True, backend="triton")
    packed_error = relative_error(packed_gate_out, vsa_end_to_end(with_gate=True).index_select(2, order))
    packed_dense_error = relative_error(vsa_packed(with_gate=False, sparsity=0.0), dense_out.index_select(2, order))
    # The block list (empty key blocks and query blocks skipped) against walking every block: the same bits.
    block_list_equal = torch.equal(_with_config(vsa_triton, {"skip_empty_blocks": False, "short_steps": ()},
                                                lambda: vsa_packed(with_gate=True, backend="triton")),
                                   _with_config(vsa_triton, {"short_steps": ()},
                                                lambda: vsa_packed(with_gate=True, backend="triton")))
    # The short-step variants against the default call (the same sums in another order).
    variant_errors = {name: relative_error(_with_config(vsa_triton, config, lambda: vsa_packed(
        with_gate=True, backend="triton")), packed_gate_out) for name, config in step_variants.items()}
    variants_error = max(variant_errors.values())
    # The TMA variant against the default kernel on the same selection.
    tma_error = relative_error(triton_fine_stage_only(), triton_fine_stage_only({"tma": False}))
    gluon_error = gluon_call_error = None
    if has_gluon:  # the Gluon fine stage against Triton's on the same selection, and the whole call with it
        gluon_error = relative_error(gluon_fine_stage_only(), triton_packed_fine_stage_only())
        gluon_call_error = relative_error(vsa_packed(with_gate=True, backend="gluon"), packed_gate_out)
    fa4_error = fa4_dense_error = fa4_sparse0_error = None
    if has_fa4:
        # The FA4 fine stage against Triton on the same selection, dense FA4 against SDPA, and FA4 VSA at
        # sparsity 0 (every tile selected, partial ones masked) against dense SDPA.
        fa4_error = relative_error(vsa_tiled(qt, kt, vt, None, args.sparsity, "fa4"),
                                   vsa_tiled(qt, kt, vt, None, args.sparsity, "triton"))
        fa4_dense_error = relative_error(fa4.fa4_attention(q, k, v), dense_out)
        fa4_sparse0_error = relative_error(untile_tokens(vsa_tiled(qt, kt, vt, None, 0.0, "fa4"), layout, dim=2),
                                           dense_out)
    # The coarse stage's kernels against torch on the same tile means: the same key tiles selected (rows whose
    # sets differ: near-ties at the k-th score, where tf32x3 and float32 products round apart), and the output.
    (selected_kernel, coarse_kernel), (selected_torch, coarse_torch) = coarse_packed(), coarse_packed_torch()
    same_rows = (selected_kernel.long().sort(-1).values == selected_torch.sort(-1).values).all(-1)
    selection_mismatch = 1.0 - same_rows.float().mean().item()
    coarse_error = relative_error(coarse_kernel, coarse_torch)
    accuracy_ok = block_list_equal and all(e <= ACCURACY_LIMIT for e in (error, backends_error, tma_error, packed_error, packed_dense_error,
                                                     fa4_error, fa4_dense_error, coarse_error,
                                                     fa4_sparse0_error, gluon_error, gluon_call_error,
                                                     variants_error)
                       if e is not None)

    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": {"grid": grid, "tile": tile, "tokens": seq, "tiles": layout.num_tiles, "batch": BATCH,
                  "heads": HEADS, "head_dim": HEAD_DIM, "dtype": str(dtype)},
        "sparsity": args.sparsity,
        "topk_tiles": topk,
        "timing": timing | {"statistic": "median", "clock": "cuda events"},
        "tflops_note": "dense: 4*B*H*S^2*D; vsa: fine-stage FLOPs 4*B*H*(N*V)*(topk*V)*D",
        "results": results,
        "profile_packed_random_gate": profile_call(lambda: vsa_packed(with_gate=True)) if args.profile else None,
        # Device time per coarse-stage kernel at each swept launch configuration (with --profile).
        "profile_coarse_configs": {label: profile_call(lambda c=cfg, o=out: coarse_packed(c, o))
                                   for label, (cfg, out) in {"default": ({}, True),
                                                             **{k: (c, True) for k, c in coarse_configs.items()},
                                                             "no_output": ({}, False)}.items()}
        if args.profile and coarse_configs else None,
        "accuracy": {"check": "vsa(sparsity=0, gate=None) vs dense SDPA, relative Frobenius error",
                     "relative_error": error, "triton_vs_flex_relative_error": backends_error,
                     "triton_tma_vs_triton_relative_error": tma_error,
                     "packed_vs_padded_with_gate_relative_error": packed_error,
                     "block_list_equals_every_block": block_list_equal,
                     "short_steps_variants_vs_call_relative_error": variant_errors,
                     "packed_sparsity0_vs_dense_relative_error": packed_dense_error,
                     "coarse_kernels_vs_torch_relative_error": coarse_error,
                     "coarse_kernels_vs_torch_selection_rows_differing": selection_mismatch,
                     "gluon_vs_triton_fine_stage_relative_error": gluon_error,
                     "gluon_call_vs_triton_call_relative_error": gluon_call_error,
                     "fa4_vs_triton_relative_error": fa4_error, "fa4_dense_vs_sdpa_relative_error": fa4_dense_error,
                     "fa4_vsa_sparsity0_vs_dense_relative_error": fa4_sparse0_error,
                     "limit": ACCURACY_LIMIT, "ok": accuracy_ok},
    }
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)

    print(f"{report['device']}, torch {report['torch']}: grid {grid} = {seq} tokens, {layout.num_tiles} tiles of "
          f"{layout.tile_volume}, B={BATCH} H={HEADS} D={HEAD_DIM} bf16; sparsity {args.sparsity} -> top-{topk}")
    print(f"{'case':32s} {'ms':>9s} {'TFLOP/s':>9s} {'vs best':>8s} {'vs cuDNN':>8s} {'vs FA4':>8s}")
    for name, r in results.items():
        if r["ms"] is None:
            print(f"{name:30s} {'failed':>9s}  {r['error']}")
            continue
        ratios = " ".join(f"{r[key]:8.2f}" if key in r else f"{'-':>8s}" for key in
                          ("speedup_vs_best_dense", "speedup_vs_dense_sdpa_cudnn", "speedup_vs_dense_fa4"))
        queued = f"  back to back {r['ms_back_to_back']:.3f} ms" if "ms_back_to_back" in r else ""
        queued += f"  host {r['host_ms']:.3f} ms" if "host_ms" in r else ""
        print(f"{name:32s} {r['ms']:9.3f} {r['tflops']:9.1f} {ratios}{queued}")
    for row in report["profile_packed_random_gate"] or []:
        print(f"  profile: {row['cuda_ms']:8.3f} ms x{row['calls']:<3d} {row['kernel'][:90]}")
    for label, rows in (report["profile_coarse_configs"] or {}).items():
        print(f"  coarse {label:18s} " + ", ".join(f"{r['kernel'][:20]} {r['cuda_ms']:.4f}" for r in rows))
    print(f"packed vs padded (gate) {packed_error:.2e}, packed sparsity 0 vs dense {packed_dense_error:.2e}, coarse "
          f"kernels vs torch {coarse_error:.2e} (rows selecting other tiles: {selection_mismatch:.2e})")
    print(f"Gluon fine stage vs Triton {gluon_error}, whole call with it vs Triton {gluon_call_error}; block list "
          f"equals walking every block: {block_list_equal}; short-step variants vs the call: "
          + ", ".join(f"{n} {e:.2e}" for n, e in variant_errors.items()))
    print(f"accuracy: sparsity 0 vs dense relative error {error:.2e}, triton vs flex at sparsity "
          f"{args.sparsity} {backends_error:.2e}, TMA vs plain Triton {tma_error:.2e}, FA4 vs Triton {fa4_error}, "
          f"dense FA4 vs SDPA {fa4_dense_error}, FA4 VSA sparsity 0 vs dense {fa4_sparse0_error} (limit {ACCURACY_LIMIT:g}): "
          f"{'ok' if accuracy_ok else 'FAILED'}")
    print(f"wrote {args.json}")
    return 0 if accuracy_ok else 1


if __name__ == "__main__":
    sys.exit(main())
