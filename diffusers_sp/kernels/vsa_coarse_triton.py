"""Triton kernels of video sparse attention's (VSA) coarse stage: tile means, tile scores with the coarse
output, and the top-k key tiles of each query tile.

VSA is "VSA: Faster Video Diffusion with Trainable Sparse Attention" (P. Zhang et al., arXiv 2505.13389). Its
coarse stage pools every tile of up to ``V`` tokens to its mean, scores query-tile means against key-tile
means, keeps the top-k key tiles of each query tile for the fine stage
(:mod:`~diffusers_sp.kernels.vsa_triton`) and, where the model gates it in, attends at tile level
(softmax over all key tiles, times the value-tile means). Done as a means kernel per tensor, two float32
cuBLAS products, a softmax and ``torch.topk``, that was about 0.4 ms of a 2.7 ms attention call at the Wan
1.3B shape on an H100, most of it in the means and the top-k (benchmarks/RESULTS.md). Here it is three
launches:

1. ``_tile_means_kernel``: the float32 mean of every tile of q, k and v in one launch;
2. ``_tile_scores_kernel``: per block of query tiles, the scores against every key tile (written out for the
   selection) and, with an output wanted, the online softmax (FlashAttention's recurrence, T. Dao et al.,
   arXiv 2205.14135) over them times the value means. The products run on tensor cores as three TF32
   products (``tf32x3``: float32 split into a high and a low TF32 part), close to float32;
3. ``_topk_tiles_kernel``: per row of scores held in registers, the k-th largest score by a radix select on
   the scores' order-preserving integer keys (digits of one bit by default, MSB first: the classic selection
   by digits, as in ``torch.topk``'s CUDA radix select), then every score above it and as many equal to it as are still
   wanted, written as a list of key-tile indices in column order. The select starts at the highest bit in
   which the row's keys differ (the bits above are every key's) and stops once exactly k keys reach the
   prefix (they are then the k largest): about 16 of the 32 one-bit steps on normal scores of 624 tiles.

Selection runs on the unscaled products (a positive scale keeps their order). Ties at the k-th score go to
the lower tile index (``torch.topk`` leaves their choice open). Rows longer than :data:`MAX_SELECT_TILES`
key tiles are selected by ``torch.topk`` instead (the row would not fit in registers).

Packed tile layout as in :mod:`~diffusers_sp.kernels.vsa_triton`: a ``[B, H, S, D]`` tensor (last stride 1)
whose tile ``i`` is the ``sizes[i]`` tokens from ``offsets[i]``. Only importable where Triton is; under
``torch.compile`` the launches are the custom operator ``torch.ops.diffusers_sp.vsa_coarse_stage_triton``.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship without Triton
    triton = None
    tl = None

from .vsa_triton import _LOG2_E, _unit_last_stride

#: Launch configuration: heads per program of the means kernel (``mean_heads``, rounded up to a power of two: the
#: group's heads are one load per row block) and its warps (``mean_warps``); query tiles per program of the scores
#: kernel (``score_rows``), key tiles per step (``score_cols``), its pipeline stages (``score_stages``) and warps
#: (``score_warps``); rows of scores per program of the top-k kernel (``select_rows``; its warps follow from the row
#: length, one per 1024 scores, at most 8) and the bits of its radix digit (``select_bits``). The top-k kernel is bound
#: by issuing its compares and row reductions, so one row on one warp (shuffles only, no barriers) with one-bit digits
#: (32 steps of one count: the fewest compares) ran fastest: at 624 key tiles on an H100 the coarse stage took 0.35 /
#: 0.30 ms synced / queued, against 0.46 / 0.38 at four rows and two bits, 0.64 / 0.54 at eight rows, 0.50 / 0.45 at one
#: row and four bits (the torch path: 0.56 / 0.48; benchmarks/RESULTS.md).
DEFAULT_CONFIG = {"mean_heads": 1, "mean_warps": 2, "score_rows": 16, "score_cols": 64, "score_stages": 2,
                  "score_warps": 4, "output_precision": "tf32x3",
                  "select_rows": 1, "select_bits": 1, "select_early_exit": True}
#: The longest row (key tiles) the top-k kernel selects from; longer rows go to ``torch.topk``.
MAX_SELECT_TILES = 8192


def coarse_stage_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_offsets: torch.Tensor,
                        q_sizes: torch.Tensor, kv_offsets: torch.Tensor, kv_sizes: torch.Tensor, tile_volume: int,
                        topk: int, scale: float, with_output: bool = True
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """VSA's coarse stage on packed tiles: the top-k key tiles of each query tile and, with ``with_output``,
    the tile-level attention output.

    Args:
        q: ``[B, H, Sq, D]`` queries of ``Nq`` packed tiles, bfloat16/float16 CUDA, any strides (one whose
            last stride is not 1 is copied first).
        k, v: ``[B, H, Sk, D]`` keys and values of ``Nk`` packed tiles, same dtype and device.
        q_offsets, q_sizes: int32 ``[Nq]`` on the device: where each query tile starts and its token count
            (``[1, V]``). kv_offsets, kv_sizes: int32 ``[Nk]``, the same for the key tiles.
        tile_volume: ``V``, a power of two in [16, 256]; D in {32, 64, 128}.
        topk: Key tiles kept per query tile, in ``[1, Nk]``.
        scale: Softmax scale of the tile scores (> 0).
        with_output: Whether to compute the coarse output (VSA gates it into the result); v is not read
            without it.

    Returns:
        ``(selected, coarse)``: int32 ``[B, H, Nq, topk]`` distinct key-tile indices (in increasing order where
        the Triton selection runs, as ``torch.topk`` leaves them otherwise), and float32 ``[B, H, Nq, D]``
        ``softmax(scale * q_mean @ k_mean^T) @ v_mean`` or None.

    Raises nothing of its own: the shapes, sizes and ``topk`` are the caller's to check
    (:func:`~diffusers_sp.kernels.vsa.video_sparse_attention_packed` does, before any launch).
    """
    # Under torch.compile the launches are one opaque custom operator; eager calls launch directly.
    launch = torch.ops.diffusers_sp.vsa_coarse_stage_triton if torch.compiler.is_compiling() else _launch_coarse
    selected, coarse = launch(q, k, v, q_offsets, q_sizes, kv_offsets, kv_sizes, tile_volume, topk, scale,
                              with_output)
    return selected, coarse if with_output else None


def tile_means_triton(x: torch.Tensor, offsets: torch.Tensor, sizes: torch.Tensor, tile_volume: int) -> torch.Tensor:
    """Mean of each tile's tokens (VSA's coarse-stage pooling) over packed tiles.

    Args:
        x: ``[B, H, S, D]`` bfloat16/float16 CUDA tensor, the last stride 1: tile ``i``'s tokens are
            ``x[:, :, offsets[i]:offsets[i] + sizes[i]]``.
        offsets, sizes: int32 tensors ``[N]`` on x's device, each size in ``[1, tile_volume]``.
        tile_volume: ``V``, a power of two in [16, 256].

    Returns:
        ``[B, H, N, D]`` float32 (sums in float32, divided by the size).
    """
    return _launch_means((x,), (offsets, sizes), (offsets, sizes), tile_volume)[0]


def _launch_means(tensors, q_tiles, kv_tiles, tile_volume, config=None):
    """The float32 tile means ``[B, H, N, D]`` of one to three packed tensors (q by ``q_tiles``, the others by
    ``kv_tiles``, each an int32 ``(offsets, sizes)`` pair), in one launch."""
    cfg = dict(DEFAULT_CONFIG, **(config or {}))
    tensors = [_unit_last_stride(t) for t in tensors]
    B, H, _, D = tensors[0].shape
    counts = [q_tiles[0].shape[0]] + [kv_tiles[0].shape[0]] * (len(tensors) - 1)
    outs = [torch.empty((B, H, n, D), device=t.device, dtype=torch.float32) for t, n in zip(tensors, counts)]
    padded = (tensors + tensors[-1:] * 2)[:3]  # unused slots repeat the last tensor; no program reads them
    strides = [s for t in padded for s in t.stride()[:3]]
    heads = min(triton.next_power_of_2(cfg["mean_heads"]), triton.next_power_of_2(H))
    # Rows a load: 64 for one head, fewer for a group of heads (at most 8192 elements in flight a load).
    block = min(tile_volume, max(16, 8192 // (heads * D)))
    _tile_means_kernel[(max(counts), B * triton.cdiv(H, heads), len(tensors))](
        *padded, *strides, *(outs + outs[-1:] * 2)[:3], *q_tiles, *kv_tiles, counts[0], counts[-1], H,
        TILE=tile_volume, HEAD_DIM=D, BLOCK=block, HEADS=heads, num_warps=cfg["mean_warps"])
    return outs


def _launch_coarse(q, k, v, q_offsets, q_sizes, kv_offsets, kv_sizes, tile_volume, topk, scale, with_output,
                   config=None):
    """Launches the three coarse-stage kernels (see :func:`coarse_stage_triton`); returns ``(selected, coarse)``
    with ``coarse`` a ``[0]`` placeholder where no output is wanted. ``config`` overrides
    :data:`DEFAULT_CONFIG` (benchmarks)."""
    cfg = dict(DEFAULT_CONFIG, **(config or {}))
    q_tiles, kv_tiles = (q_offsets, q_sizes), (kv_offsets, kv_sizes)
    means = _launch_means((q, k, v) if with_output else (q, k), q_tiles, kv_tiles, tile_volume, cfg)
    B, H, num_q, D = means[0].shape
    num_kv = means[1].shape[2]
    scores = torch.empty((B, H, num_q, num_kv), device=q.device, dtype=torch.float32)
    coarse = torch.empty((B, H, num_q, D) if with_output else (0,), device=q.device, dtype=torch.float32)
    _tile_scores_kernel[(triton.cdiv(num_q, cfg["score_rows"]), B * H)](
        means[0], means[1], means[-1], scores, coarse, num_q, num_kv, scale * _LOG2_E, HEAD_DIM=D,
        ROWS=cfg["score_rows"], COLS=cfg["score_cols"], HAS_OUT=with_output, OUT_PRECISION=cfg["output_precision"],
        num_warps=cfg["score_warps"], num_stages=cfg["score_stages"])
    return topk_tiles_triton(scores, topk, rows_per_program=cfg["select_rows"], bits_per_step=cfg["select_bits"],
                             early_exit=cfg["select_early_exit"]), coarse


def topk_tiles_triton(scores: torch.Tensor, topk: int, *, rows_per_program: int = 1, bits_per_step: int = 1,
                      early_exit: bool = True) -> torch.Tensor:
    """The ``topk`` largest entries of each row of ``scores``, as column indices (VSA's tile selection).

    Args:
        scores: float32 CUDA tensor ``[..., Nk]``, contiguous; NaN counts as the largest value.
        topk: Entries kept per row, in ``[1, Nk]``.
        rows_per_program: Rows one program selects in (its warps: one per 1024 of the rows' scores, padded to
            a power of two each, at most 8).
        bits_per_step: Radix digits of 1, 2 or 4 bits: 32 / bits steps of ``2**bits - 1`` counts each (fewer
            counts in all at one bit, fewer steps at four).
        early_exit: Whether to start each row at the highest bit in which its keys differ and to stop once
            exactly ``topk`` keys reach the prefix (the same selection in fewer steps); False runs all the
            digits (the benchmarks' comparison).

    Returns:
        int32 ``[..., topk]``: distinct column indices per row, increasing, of the ``topk`` largest scores;
        ties at the ``topk``-th value go to the lower index. Rows of more than :data:`MAX_SELECT_TILES` entries
        go to ``torch.topk`` (their order and tie choice are then its).

    Raises:
        ValueError: ``bits_per_step`` not 1, 2 or 4.
    """
    if bits_per_step not in (1, 2, 4):
        raise ValueError(f"bits_per_step must be 1, 2 or 4 (a divisor of the 32-bit keys), got {bits_per_step}")
    num_kv = scores.shape[-1]
    if num_kv > MAX_SELECT_TILES:
        return scores.topk(topk, dim=-1, sorted=False).indices.to(torch.int32)
    selected = torch.empty(scores.shape[:-1] + (topk,), device=scores.device, dtype=torch.int32)
    row_len = triton.next_power_of_2(num_kv)
    rows = triton.next_power_of_2(rows_per_program)
    num_rows = scores.numel() // num_kv
    warps = min(8, max(1, rows * row_len // 1024))
    _topk_tiles_kernel[(triton.cdiv(num_rows, rows),)](scores, selected, num_rows, num_kv, topk, ROWS=rows,
                                                       ROW_LEN=row_len, BITS=bits_per_step, EARLY_EXIT=early_exit,
                                                       num_warps=warps)
    return selected


@torch.library.custom_op("diffusers_sp::vsa_coarse_stage_triton", mutates_args=())
def _coarse_stage_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor,
                     q_sizes: torch.Tensor, kv_offsets: torch.Tensor, kv_sizes: torch.Tensor, tile_volume: int,
                     topk: int, scale: float, with_output: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch_coarse(q, k, v, q_offsets, q_sizes, kv_offsets, kv_sizes, tile_volume, topk, scale, with_output)


@_coarse_stage_op.register_fake
def _(q, k, v, q_offsets, q_sizes, kv_offsets, kv_sizes, tile_volume, topk, scale, with_output):
    B, H, _, D = q.shape
    num_q = q_offsets.shape[0]
    selected = q.new_empty((B, H, num_q, topk), dtype=torch.int32)
    return selected, q.new_empty((B, H, num_q, D) if with_output else (0,), dtype=torch.float32)


if triton is not None:

    @triton.jit
    def _tile_mean(X, s_xb, s_xh, s_xs, Out, Off, Sizes, tile, b, group, num_heads, num_tiles,
                   TILE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, HEADS: tl.constexpr):
        # The float32 sums of tile `tile`'s rows of (b, heads group*HEADS ... + HEADS - 1), divided by its size,
        # into Out[b, h, tile]. The group's heads are one load of [BLOCK, HEADS * HEAD_DIM]: in the model's
        # [B, S, H, D] layout (s_xh == HEAD_DIM) that is HEADS * HEAD_DIM contiguous elements a token.
        start = tl.load(Off + tile)
        count = tl.load(Sizes + tile)
        rows = tl.arange(0, BLOCK)
        cols = tl.arange(0, HEADS * HEAD_DIM)
        h = group * HEADS + cols // HEAD_DIM
        dims = cols % HEAD_DIM
        head_ok = h < num_heads
        base = X + b.to(tl.int64) * s_xb + h.to(tl.int64) * s_xh + dims
        acc = tl.zeros([HEADS * HEAD_DIM], dtype=tl.float32)
        for first in tl.static_range(0, TILE, BLOCK):
            x = tl.load(base[None, :] + (start + first + rows).to(tl.int64)[:, None] * s_xs,
                        mask=(first + rows < count)[:, None] & head_ok[None, :], other=0.0)
            acc += tl.sum(x.to(tl.float32), 0)
        row = (b * num_heads + h).to(tl.int64) * num_tiles + tile
        tl.store(Out + row * HEAD_DIM + dims, acc / count.to(tl.float32), mask=head_ok)

    @triton.jit
    def _tile_means_kernel(Q, K, V, s_qb, s_qh, s_qs, s_kb, s_kh, s_ks, s_vb, s_vh, s_vs, QMean, KMean, VMean,
                           QOff, QSizes, KOff, KSizes, num_q, num_kv, num_heads,
                           TILE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, HEADS: tl.constexpr):
        # One program per (tile, batch and group of HEADS heads, tensor): tensor 0 is q (num_q tiles), 1 and
        # 2 are k and v.
        tile = tl.program_id(0)
        groups = tl.cdiv(num_heads, HEADS)
        b = tl.program_id(1) // groups
        group = tl.program_id(1) % groups
        which = tl.program_id(2)
        if which == 0:
            if tile < num_q:
                _tile_mean(Q, s_qb, s_qh, s_qs, QMean, QOff, QSizes, tile, b, group, num_heads, num_q,
                           TILE, HEAD_DIM, BLOCK, HEADS)
        elif tile < num_kv:
            if which == 1:
                _tile_mean(K, s_kb, s_kh, s_ks, KMean, KOff, KSizes, tile, b, group, num_heads, num_kv,
                           TILE, HEAD_DIM, BLOCK, HEADS)
            else:
                _tile_mean(V, s_vb, s_vh, s_vs, VMean, KOff, KSizes, tile, b, group, num_heads, num_kv,
                           TILE, HEAD_DIM, BLOCK, HEADS)

    @triton.jit
    def _tile_scores_kernel(QMean, KMean, VMean, Scores, Coarse, num_q, num_kv, scale_log2,
                            HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, HAS_OUT: tl.constexpr,
                            OUT_PRECISION: tl.constexpr):
        # One program per (block of ROWS query tiles, batch * head); means are contiguous [B, H, N, D].
        bh = tl.program_id(1).to(tl.int64)
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        dims = tl.arange(0, HEAD_DIM)
        row_ok = rows < num_q
        q_rows = bh * num_q + rows
        qm = tl.load(QMean + q_rows[:, None] * HEAD_DIM + dims[None, :], mask=row_ok[:, None], other=0.0)
        m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
        for first in range(0, num_kv, COLS):
            cols = first + tl.arange(0, COLS)
            col_ok = cols < num_kv
            kv_rows = bh * num_kv + cols
            km = tl.load(KMean + kv_rows[:, None] * HEAD_DIM + dims[None, :], mask=col_ok[:, None], other=0.0)
            s = tl.dot(qm, tl.trans(km), input_precision="tf32x3")
            tl.store(Scores + q_rows[:, None] * num_kv + cols[None, :], s, mask=row_ok[:, None] & col_ok[None, :])
            if HAS_OUT:
                t = tl.where(col_ok[None, :], s * scale_log2, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(t, 1))
                p = tl.math.exp2(t - m_new[:, None])
                alpha = tl.math.exp2(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, 1)
                vm = tl.load(VMean + kv_rows[:, None] * HEAD_DIM + dims[None, :], mask=col_ok[:, None], other=0.0)
                acc = acc * alpha[:, None] + tl.dot(p, vm, input_precision=OUT_PRECISION)
                m_i = m_new
        if HAS_OUT:
            tl.store(Coarse + q_rows[:, None] * HEAD_DIM + dims[None, :], acc / l_i[:, None], mask=row_ok[:, None])

    @triton.jit
    def _topk_tiles_kernel(Scores, Sel, num_rows, num_kv, topk, ROWS: tl.constexpr, ROW_LEN: tl.constexpr,
                           BITS: tl.constexpr, EARLY_EXIT: tl.constexpr):
        # One program per ROWS rows of scores [num_rows, num_kv]; writes Sel [num_rows, topk] (int32).
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, ROW_LEN)
        ok = (rows < num_rows)[:, None] & (cols < num_kv)[None, :]
        s = tl.load(Scores + rows.to(tl.int64)[:, None] * num_kv + cols[None, :], mask=ok, other=float("-inf"))
        # Order-preserving uint32 keys of the float32 scores: negative ones bit-inverted, others sign bit set.
        bits = s.to(tl.uint32, bitcast=True)
        key = tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)
        # Radix select of the k-th largest key, BITS bits per step from the top: the largest prefix that at
        # least topk keys reach (count(key >= prefix) >= topk holds throughout). The counts fall as the digit
        # rises, so the last digit that still reaches topk wins. Padding keys are 0, below every candidate.
        key = tl.where(ok, key, tl.zeros_like(key))
        count = tl.sum(ok.to(tl.int32), 1)  # keys reaching the prefix: all valid ones at first
        prefix = tl.zeros([ROWS], dtype=tl.uint32)
        shift = tl.program_id(0) * 0 + (32 - BITS)  # a tensor: the loop below carries it
        if EARLY_EXIT:
            # Every valid key of a row shares the bits above the highest one in which its largest and
            # smallest key differ, so those are the prefix's from the start, and the select begins at the
            # digit holding that bit (``top``, found by halving).
            hi = tl.max(key, 1)
            diff = hi ^ tl.min(tl.where(ok, key, tl.full(key.shape, 0xFFFFFFFF, tl.uint32)), 1)
            top = tl.zeros([ROWS], dtype=tl.int32)
            for half in tl.static_range(4, -1, -1):
                upper = diff >> (1 << half)
                top += tl.where(upper != 0, 1 << half, 0)
                diff = tl.where(upper != 0, upper, diff)
            low = top // BITS * BITS
            kept = low + BITS  # bits from here up are common to the row's keys
            prefix = tl.where(kept >= 32, prefix, hi & (tl.full([ROWS], 0xFFFFFFFF, tl.uint32)
                                                        << tl.minimum(kept, 31).to(tl.uint32)))
            shift = tl.max(tl.where(rows < num_rows, low, 0), 0)
        # A row is done once exactly topk keys reach its prefix: they are the topk largest (a larger prefix
        # keeps the same keys), so the loop ends when every row is; without EARLY_EXIT it runs all 32 bits.
        done = (rows >= num_rows) | ((count == topk) & EARLY_EXIT)
        while (shift >= 0) & (tl.min(done.to(tl.int32), 0) == 0):
            reached, reached_count = prefix, count
            for digit in tl.static_range(1, 1 << BITS):
                candidate = prefix | (tl.full([ROWS], digit, tl.uint32) << shift.to(tl.uint32))
                hits = tl.sum((key >= candidate[:, None]).to(tl.int32), 1)
                reached = tl.where(hits >= topk, candidate, reached)
                reached_count = tl.where(hits >= topk, hits, reached_count)
            prefix, count = reached, reached_count
            if EARLY_EXIT:
                done = done | (count == topk)
            shift -= BITS
        above = key > prefix[:, None]
        tied = (key == prefix[:, None]) & ok
        wanted = topk - tl.sum(above.to(tl.int32), 1)
        take = (above | (tied & (tl.cumsum(tied.to(tl.int32), 1) <= wanted[:, None]))) & ok
        slot = tl.cumsum(take.to(tl.int32), 1) - 1
        tl.store(Sel + rows.to(tl.int64)[:, None] * topk + slot, cols[None, :] + tl.zeros_like(slot), mask=take)
