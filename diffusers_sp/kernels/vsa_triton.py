"""Triton kernel of video sparse attention's (VSA) block-sparse fine stage, with the gated coarse output added
in its epilogue (the coarse stage's kernels are in :mod:`~diffusers_sp.kernels.vsa_coarse_triton`).

VSA is "VSA: Faster Video Diffusion with Trainable Sparse Attention" (P. Zhang et al., arXiv 2505.13389):
every query tile of up to ``V`` tokens attends, token by token, to the ``topk`` key tiles its coarse stage
selected, and to nothing else. FastVideo runs it with a ThunderKittens kernel; these are written for Triton
from the paper's description and the online-softmax recurrence of FlashAttention (T. Dao et al., arXiv
2205.14135 and 2307.08691).

Token layout ("packed tiles"): a ``[B, H, S, D]`` tensor, any strides with the last one 1, whose tokens are
the valid tokens of consecutive tiles, tile ``i`` occupying the ``sizes[i] <= V`` tokens from
``offsets[i]``. The tile-ordered token shards of the VSA processor are such tensors (``offsets`` the running
sum of the tile sizes), so an attention call needs no padded copy; the padded ``[B, H, N, V, D]`` tiles of
:func:`~diffusers_sp.kernels.vsa.video_sparse_attention` are the case ``offsets[i] = i * V``.

Fine stage: one program per (batch, head, query tile, row block of 64 tokens; 128 on request) loads its query
rows once, then walks the selected key tiles, each in column blocks of 64 (tiles of more than 64 slots: whole
128-slot key tiles per step ran the fine stage in 7.3 ms against 2.8 ms in blocks, H100,
benchmarks/RESULTS.md), keeping the running row maximum, row sum and accumulator in float32 registers. It
walks a block list (:mod:`~diffusers_sp.kernels.vsa_block_list`, one small kernel over the top-k indices): the
column blocks of the selected tiles that hold a key, so the blocks past a partial tile's end are not loaded or
multiplied, and programs past a partial query tile's end walk none (at the 256-slot tiling of the Wan 1.3B
latent, 3.08 of every 4 key blocks hold a key, and 3.08 of every 4 query blocks of 64 rows a query: three
fifths of the work remain; the fine stage ran 1.74x faster, H100). Key rows past a tile's size within a block
are masked to ``-inf``. The blocks of at most 32 or 16 keys (a partial tile's end) are walked in steps of that
many rows, after the others (``short_steps``): at the 64-slot tiling of the Wan 1.3B latent, where every tile
is one block and a quarter of them partial, the fine stage ran 1.18x faster (H100). On
Hopper and newer the query, key and value blocks are loaded by the tensor-memory accelerator (TMA) through
Triton's host tensor descriptors (2.45 ms against 3.07 ms with ordinary loads, H200, Wan 1.3B shape);
elsewhere by ordinary masked loads. With a gate, the epilogue adds ``coarse_out * gate`` to the normalised
output before the store, so no separate pass over the output is made. Forward only (inference).

Only importable where Triton is (CUDA builds of torch); :func:`triton_applies` says whether the kernels can
run on given tensors. Under ``torch.compile`` the launch is the custom operator
``torch.ops.diffusers_sp.vsa_fine_stage_triton`` (the host-side tensor descriptors do not trace), an opaque
node with a fake implementation for the output's shape; eager calls launch directly.
"""

from __future__ import annotations

from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship without Triton
    triton = None
    tl = None
try:  # host-side tensor descriptors (TMA loads on Hopper and newer): Triton 3.3+
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None

from .vsa_block_list import BLOCK as _BLOCK, key_block_list

_LOG2_E = 1.4426950408889634

#: Launch configuration measured fastest on Hopper (bf16, V = 64, D = 128, top-63 of 624 tiles;
#: benchmarks/RESULTS.md): four warps (one warpgroup), one key block per step, loaded by the tensor-memory
#: accelerator (``tma``) where :func:`tma_applies`, five pipeline stages deep (H200: 2.20 ms against 2.33-2.48
#: at four; H100: 2.44 against 2.76); ``num_stages=None`` means 5 with TMA and 2 with ordinary loads (eight
#: warps ran 5.4-7.0 ms against 3.1 ms). ``warp_specialize``: Triton's producer / consumer warp partitions
#: of the key loop (``tl.range(warp_specialize=True)``), for benchmarks: slower here (H200: 4.0-4.9 ms against
#: 2.35-2.45), as were two key blocks per step sharing one rescale of the accumulator (3.5-3.8 ms).
#: ``block_m``: query rows per program, None meaning ``min(V, 64)``. 128 rows share each key block between
#: twice the rows and were faster while every program walked every block (whole call queued 2.48 / 2.51 ms at
#: 4x8x8 / 4x4x8 against 2.55 / 2.64); with the block list, programs of 64 rows skip more of the empty query
#: rows of partial tiles (at 4x8x8, 3.08 of 4 query blocks of 64 hold a query, 1.71 of 2 of 128), and at 4x4x8
#: the call with the gate ran 1.72 / 1.52 ms synced / queued at 64 rows against 2.00-2.08 / 1.82-1.88 at 128
#: (H100, Wan 1.3B shape, same run; at 4x8x8 the 64-row call is not timed yet; benchmarks/RESULTS.md).
#: ``num_stages=None``: 3 at 128 rows with TMA (128 rows on four warps with the gate spill registers: 84 bytes
#: with TMA, sm90).
#: ``skip_empty_blocks``: walk only the key blocks that hold a key and skip programs without query rows (False:
#: every block of every selected tile and every program, as before the block list; for benchmarks).
#: ``short_steps``: row counts of shorter key steps: a block of at most that many keys (the end of a partial
#: tile) is walked in a step of that many rows after the full ones (the classes of
#: :func:`~diffusers_sp.kernels.vsa_block_list.key_block_list`) instead of in a step of 64 rows mostly masked;
#: empty: every block in steps of 64. Ignored without skip_empty_blocks and at 128 rows a program. Wan 1.3B
#: shape, H100, two runs: at 4x4x4 the fine stage 1.91-2.00 ms with (32, 16) against 1.86-2.05 with (32,) and
#: 2.26-2.36 without, the call with the gate queued 1.87 against 1.97-2.01 and 2.34-2.38; at 4x4x8 the fine
#: stage 1.37 / 1.47 / 1.56 ms. Launches of 16 or 32 query rows a program for the tiles of few queries were
#: slower (fine stage 2.30-2.65 ms at 4x4x4: the extra launches and mma.sync below 64 rows cost more than the
#: padded rows; benchmarks/RESULTS.md).
DEFAULT_CONFIG = {"num_warps": 4, "num_stages": None, "tma": True, "warp_specialize": False, "block_m": None,
                  "skip_empty_blocks": True, "short_steps": (32, 16)}


def triton_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tile_volume: int | None = None) -> bool:
    """Whether the Triton kernels can run on ``q``, ``k``, ``v`` (tiled ``[B, H, N, V, D]``, or packed
    ``[B, H, S, D]`` with ``tile_volume`` given).

    Needs Triton, CUDA tensors, bfloat16 or float16, a power-of-two tile volume ``V`` in [16, 256] and head
    dim ``D`` in {32, 64, 128} (register tile sizes), and no gradient (forward only).
    """
    if triton is None or not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    tile_volume = q.shape[-2] if tile_volume is None else tile_volume
    head_dim = q.shape[-1]
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    power_of_two = tile_volume & (tile_volume - 1) == 0
    return power_of_two and 16 <= tile_volume <= 256 and head_dim in (32, 64, 128) and not needs_grad


def triton_requirements(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tile_volume: int | None = None) -> str:
    """The message of the error raised where :func:`triton_applies` is false: what the kernels need and what
    these tensors are."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    tile_volume = q.shape[-2] if tile_volume is None else tile_volume
    return ("the Triton VSA kernel needs Triton, CUDA bfloat16/float16 tensors without gradient, a "
            "power-of-two tile volume V in [16, 256] and head dim D of 32, 64 or 128; got "
            f"Triton {'importable' if triton is not None else 'not installed'}, device {q.device}, {q.dtype}, "
            f"V={tile_volume}, D={q.shape[-1]}, requires_grad={grad}")


def _row_view(t: torch.Tensor):
    """How a ``[B, H, S, D]`` tensor reads as a 2-D table of rows ``s * stride(2)`` apart, for a TMA descriptor.

    Returns ``(rows, cols, (row_b, row_h, col_b, col_h))``: element ``[b, h, s, :]`` is row
    ``b * row_b + h * row_h + s``, columns from ``b * col_b + h * col_h``, of a ``[rows, cols]`` table with row
    stride ``stride(2)`` starting at ``t``'s first element; or None where the strides do not allow it (a
    batch or head stride that is neither a multiple of the token stride nor inside one token row).
    """
    B, H, S, D = t.shape
    s_row = t.stride(2)
    coeffs, rows, cols = [], S, D
    for size, stride in ((B, t.stride(0)), (H, t.stride(1))):
        if size == 1:
            coeffs += [0, 0]
        elif stride % s_row == 0:
            coeffs += [stride // s_row, 0]
            rows += (size - 1) * stride // s_row
        else:
            coeffs += [0, stride]
            cols += (size - 1) * stride
    if cols > s_row:  # rows would overlap (a one-token shard whose stride says nothing): ordinary loads
        return None
    return rows, cols, (coeffs[0], coeffs[2], coeffs[1], coeffs[3])


def row_table(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int, int]]:
    """``t`` (``[B, H, S, D]``, :func:`_row_view` not None) as the 2-D ``[rows, cols]`` table a TMA descriptor
    reads (row stride ``t.stride(2)``), with the ``(row_b, row_h, col_b, col_h)`` coefficients of its rows."""
    rows, cols, coeffs = _row_view(t)
    return t.as_strided((rows, cols), (t.stride(2), 1)), coeffs


def epilogue_args(gate: torch.Tensor | None, coarse: torch.Tensor | None, out: torch.Tensor) -> tuple:
    """The fine-stage kernels' gate and coarse-output arguments: each tensor and its first three strides, or
    ``out`` with zero strides where there is no gate (the kernels read neither then)."""
    if gate is None:
        return (out, 0, 0, 0) * 2
    return (gate, *gate.stride()[:3], coarse, *coarse.stride()[:3])


def tma_applies(*tensors: torch.Tensor) -> bool:
    """Whether the tensor-descriptor (TMA) loads can serve these packed ``[B, H, S, D]`` tensors: Triton's
    host tensor descriptors, a GPU of compute capability 9.0 or newer, and for each tensor a 2-D row view
    (:func:`_row_view`) with 16-byte aligned start and row stride and fewer than 2**31 rows."""
    if TensorDescriptor is None or torch.cuda.get_device_capability(tensors[0].device)[0] < 9:
        return False
    for t in tensors:
        view = _row_view(t)
        if view is None or view[0] >= 2 ** 31 or (t.stride(2) * t.element_size()) % 16 or t.data_ptr() % 16:
            return False
    return True


def fine_stage_triton_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selected: torch.Tensor, *,
                             q_offsets: torch.Tensor, q_sizes: torch.Tensor, kv_offsets: torch.Tensor,
                             kv_sizes: torch.Tensor, tile_volume: int, scale: float,
                             gate: torch.Tensor | None = None, coarse: torch.Tensor | None = None,
                             config: dict | None = None) -> torch.Tensor:
    """VSA's fine stage on packed tiles, with the gated coarse output added in the epilogue.

    Args:
        q: ``[B, H, Sq, D]`` queries of ``Nq`` packed tiles (module docstring), bfloat16/float16, CUDA,
            last stride 1.
        k, v: ``[B, H, Sk, D]`` keys and values of ``Nk`` packed tiles, same dtype and device.
        selected: Integer tensor ``[B, H, Nq, topk]`` of key-tile indices in ``[0, Nk)`` (distinct per query
            tile; order does not matter).
        q_offsets, q_sizes: int32 ``[Nq]``: where each query tile starts in ``Sq`` and how many of its rows
            are computed and stored (``[1, V]``); rows past them are left as they are in the output.
        kv_offsets, kv_sizes: int32 ``[Nk]``, the same for the key tiles; key rows past a size are masked.
        tile_volume: ``V``.
        scale: Softmax scale.
        gate: None or ``[B, H, Sq, D]`` in q's dtype (any strides, last 1): with ``coarse``, the output is
            ``fine + coarse * gate`` (each factor rounded to q's dtype first, as the reference's ``addcmul``).
        coarse: ``[B, H, Nq, D]`` float32, the coarse stage's output per query tile; given with ``gate``.
        config: Launch options overriding :data:`DEFAULT_CONFIG`, for benchmarks and tests.

    Returns:
        ``[B, H, Sq, D]`` in q's dtype: contiguous where q is, else a view of a token-major ``[Sq, B, H, D]``
        buffer (Ulysses' second all-to-all and the model's ``[B, S, H * D]`` output read it without a copy at
        batch 1).

    Raises:
        ValueError: :func:`triton_applies` is false for these tensors, only one of ``gate`` and ``coarse``
            is given, ``config["block_m"]`` is not 16, 32, 64 or 128 or does not divide ``V``, or
            ``config["short_steps"]`` is not a descending choice from (32, 16).
    """
    if not triton_applies(q, k, v, tile_volume):
        raise ValueError(triton_requirements(q, k, v, tile_volume))
    if (gate is None) != (coarse is None):
        raise ValueError("fine_stage_triton_packed: give gate and coarse together, or neither")
    if config is None and torch.compiler.is_compiling():
        return torch.ops.diffusers_sp.vsa_fine_stage_triton(q, k, v, selected, q_offsets, q_sizes, kv_offsets,
                                                            kv_sizes, tile_volume, scale, gate, coarse)
    return _launch(q, k, v, selected, q_offsets, q_sizes, kv_offsets, kv_sizes, tile_volume, scale, gate, coarse,
                   config)


def fine_stage_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selected: torch.Tensor,
                      kv_block_sizes: torch.Tensor, scale: float, *, config: dict | None = None) -> torch.Tensor:
    """VSA's fine stage on padded tiles (:func:`fine_stage_triton_packed` with ``offsets[i] = i * V``).

    Args:
        q: Tiled queries ``[B, H, Nq, V, D]``, bfloat16/float16, CUDA.
        k, v: Tiled keys and values ``[B, H, Nk, V, D]``; padded key slots are masked.
        selected: ``[B, H, Nq, topk]`` key-tile indices; kv_block_sizes: integer ``[Nk]``; scale: softmax scale.
        config: Launch options overriding :data:`DEFAULT_CONFIG`.

    Returns:
        ``[B, H, Nq, V, D]`` in q's dtype; rows of padded query slots hold the attention of whatever the slot
        holds (the caller zeroes them).

    Raises:
        ValueError: :func:`triton_applies` is false for these tensors, or ``config["block_m"]`` does not fit
            (see :func:`fine_stage_triton_packed`).
    """
    if not triton_applies(q, k, v):
        raise ValueError(triton_requirements(q, k, v))
    num_q_tiles, tile_volume = q.shape[2], q.shape[3]
    q_offsets, q_sizes = padded_tiles(num_q_tiles, tile_volume, q.device)
    kv_offsets, _ = padded_tiles(k.shape[2], tile_volume, q.device)
    out = fine_stage_triton_packed(
        q.flatten(2, 3), k.flatten(2, 3), v.flatten(2, 3), selected, q_offsets=q_offsets, q_sizes=q_sizes,
        kv_offsets=kv_offsets, kv_sizes=kv_block_sizes.to(device=q.device, dtype=torch.int32),
        tile_volume=tile_volume, scale=scale, config=config)
    return out.unflatten(2, (num_q_tiles, tile_volume))


def padded_tiles(num_tiles: int, tile_volume: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 ``(offsets, sizes)`` of ``num_tiles`` padded tiles read as packed ones: ``i * V`` and ``V``."""
    offsets = torch.arange(num_tiles, device=device, dtype=torch.int32) * tile_volume
    return offsets, torch.full_like(offsets, tile_volume)


def _output_like(q: torch.Tensor) -> torch.Tensor:
    """The fine stage's output buffer: contiguous where q is (padded tiles), else token-major ``[S, B, H, D]``
    seen as ``[B, H, S, D]`` (the layout the model and Ulysses' second all-to-all read without a copy)."""
    if q.is_contiguous():
        return torch.empty_like(q)
    B, H, S, D = q.shape
    return q.new_empty((S, B, H, D)).permute(1, 2, 0, 3)


def _unit_last_stride(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` itself where its last stride is 1 (what the kernels index), else a contiguous copy."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def launch_blocks(tile_volume: int, use_tma: bool, config: dict | None = None) -> tuple[int, int, int]:
    """The fine stage's ``(query rows per program, key columns per step, pipeline stages)`` for tiles of
    ``tile_volume`` slots, with or without TMA loads, under ``config`` (overriding :data:`DEFAULT_CONFIG`).

    Raises:
        ValueError: ``config["block_m"]`` is not 16, 32, 64 or 128, or does not divide ``tile_volume``.
    """
    cfg = dict(DEFAULT_CONFIG, **(config or {}))
    block_m = cfg["block_m"] or min(tile_volume, _BLOCK)
    if block_m not in (16, 32, 64, 128) or tile_volume % block_m:
        raise ValueError(f"block_m must be 16, 32, 64 or 128 and divide the tile volume {tile_volume}, got {block_m}")
    stages = cfg["num_stages"] or ((3 if block_m > _BLOCK else 5) if use_tma else 2)
    return block_m, min(tile_volume, _BLOCK), stages


def _launch(q, k, v, selected, q_offsets, q_sizes, kv_offsets, kv_sizes, tile_volume, scale, gate, coarse, config):
    """Launches the fine-stage kernel (see :func:`fine_stage_triton_packed`)."""
    cfg = dict(DEFAULT_CONFIG, **(config or {}))
    q, k, v, gate = (_unit_last_stride(t) for t in (q, k, v, gate))
    B, H, _, D = q.shape
    num_q_tiles = q_offsets.shape[0]
    out = _output_like(q)
    use_tma = cfg["tma"] and tma_applies(q, k, v)
    block_m, block_n, stages = launch_blocks(tile_volume, use_tma, cfg)
    skip = cfg["skip_empty_blocks"]
    # Programs of 128 query rows keep one step size: with the short steps' loops they spill 1.2 KB of registers
    # (sm_90a, offline compile).
    short = tuple(r for r in cfg["short_steps"] if r < block_n) if skip and block_m <= _BLOCK else ()
    blocks, counts = key_block_list(selected, kv_offsets, kv_sizes, tile_volume, skip_empty=skip, short_steps=short)
    shorts = short + (0,) * (2 - len(short))
    (k_ops, k_short), (v_ops, v_short) = (_operands(t, block_n, use_tma, short) for t in (k, v))
    # K and V again for each short step (KA, VA, KB, VB); a class that is not there gets the 64-row ones, unread.
    short_ops = [x for pair in zip(k_short, v_short) for x in pair] + [k_ops[0], v_ops[0]] * (2 - len(short))
    _vsa_fine_kernel[(num_q_tiles * (tile_volume // block_m), B * H)](
        *_operands(q, block_m, use_tma)[0], *k_ops, *v_ops, *short_ops, out, *out.stride()[:3],
        *epilogue_args(gate, coarse, out), blocks, counts, blocks.shape[-2], q_offsets, q_sizes, H, num_q_tiles,
        scale * _LOG2_E,  # the kernel uses exp2
        TILE=tile_volume, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, SHORT_A=shorts[0], SHORT_B=shorts[1],
        TMA=use_tma, HAS_GATE=gate is not None, SKIP_EMPTY=skip, WARP_SPECIALIZE=cfg["warp_specialize"],
        num_warps=cfg["num_warps"], num_stages=stages)
    return out


def _operands(t: torch.Tensor, block: int, use_tma: bool, more_blocks: tuple[int, ...] = ()) -> tuple[list, list]:
    """The fine-stage kernel's six arguments for one of q, k, v: a TMA descriptor of ``block`` rows with the
    row coefficients of :func:`row_table` and the row stride, or the tensor with its strides (ordinary loads:
    element ``[b, h, s]`` at row ``s`` from column ``b * stride(0) + h * stride(1)``); and for each of
    ``more_blocks`` a descriptor of that many rows of the same table (the tensor itself with ordinary loads)."""
    if not use_tma:
        return [t, 0, 0, t.stride(0), t.stride(1), t.stride(2)], [t] * len(more_blocks)
    table, coeffs = row_table(t)
    descs = [TensorDescriptor(table, list(table.shape), list(table.stride()), [rows, t.shape[-1]])
             for rows in (block, *more_blocks)]
    return [descs[0], *coeffs, t.stride(2)], descs[1:]


@torch.library.custom_op("diffusers_sp::vsa_fine_stage_triton", mutates_args=())
def _fine_stage_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selected: torch.Tensor,
                   q_offsets: torch.Tensor, q_sizes: torch.Tensor, kv_offsets: torch.Tensor, kv_sizes: torch.Tensor,
                   tile_volume: int, scale: float, gate: Optional[torch.Tensor],
                   coarse: Optional[torch.Tensor]) -> torch.Tensor:
    return _launch(q, k, v, selected, q_offsets, q_sizes, kv_offsets, kv_sizes, tile_volume, scale, gate, coarse,
                   None)


@_fine_stage_op.register_fake
def _(q, k, v, selected, q_offsets, q_sizes, kv_offsets, kv_sizes, tile_volume, scale, gate, coarse):
    return _output_like(q)


if triton is not None:

    @triton.jit
    def _key_block(K, V, block_base, entry, k_row0, k_col, v_row0, v_col, s_k, s_v, rows, dims, TMA: tl.constexpr):
        # Key and value rows of entry `entry` of the query tile's block list, and which of them count.
        kv_start = tl.load(block_base + entry * 2)
        key_ok = rows < tl.load(block_base + entry * 2 + 1)
        if TMA:
            k = K.load([k_row0 + kv_start, k_col.to(tl.int32)])
            vals = V.load([v_row0 + kv_start, v_col.to(tl.int32)])
        else:
            k = tl.load(K + (k_row0 + kv_start + rows).to(tl.int64)[:, None] * s_k + k_col + dims[None, :],
                        mask=key_ok[:, None], other=0.0)
            vals = tl.load(V + (v_row0 + kv_start + rows).to(tl.int64)[:, None] * s_v + v_col + dims[None, :],
                           mask=key_ok[:, None], other=0.0)
        return k, vals, key_ok

    @triton.jit
    def _walk(q, m_i, l_i, acc, K, V, block_base, first, last, k_row0, k_col, v_row0, v_col, s_k, s_v, dims,
              scale_log2, BLOCK_N: tl.constexpr, TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
        # Entries [first, last) of the block list in steps of BLOCK_N key rows: the online-softmax recurrence
        # on the running row maximum m_i, row sum l_i and accumulator acc (float32), which it returns.
        key_rows = tl.arange(0, BLOCK_N)
        for entry in tl.range(first, last, warp_specialize=WARP_SPECIALIZE):
            k, vals, key_ok = _key_block(K, V, block_base, entry, k_row0, k_col, v_row0, v_col, s_k, s_v, key_rows,
                                         dims, TMA)
            # Scores stay unscaled: the scale goes into exp2's argument as one fused multiply-add per score.
            s = tl.where(key_ok[None, :], tl.dot(q, tl.trans(k)), float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
            p = tl.math.exp2(s * scale_log2 - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(vals.dtype), vals)
            m_i = m_new
        return m_i, l_i, acc

    @triton.jit
    def _vsa_fine_kernel(Q, q_rb, q_rh, q_cb, q_ch, s_q, K, k_rb, k_rh, k_cb, k_ch, s_k,
                         V, v_rb, v_rh, v_cb, v_ch, s_v, KA, VA, KB, VB, Out, s_ob, s_oh, s_os,
                         Gate, s_gb, s_gh, s_gs, Coarse, s_cb, s_ch, s_cn,
                         Blocks, Counts, max_entries, QOff, QSizes, num_heads, num_q_tiles, scale_log2,
                         TILE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         SHORT_A: tl.constexpr, SHORT_B: tl.constexpr, TMA: tl.constexpr, HAS_GATE: tl.constexpr,
                         SKIP_EMPTY: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
        # Q, K, V: TMA descriptors of 2-D row views (TMA) or base pointers; element [b, h, s, :] of each is
        # row (b * rb + h * rh + s), columns from (b * cb + h * ch), rows s_* elements apart. KA, VA and KB, VB:
        # K and V again, as descriptors of SHORT_A and SHORT_B rows (the short steps; 0: none).
        Q_PARTS: tl.constexpr = TILE // BLOCK_M
        CLASSES: tl.constexpr = 1 + (SHORT_A > 0) + (SHORT_B > 0)
        q_tile = tl.program_id(0) // Q_PARTS
        q_row = tl.program_id(0) % Q_PARTS * BLOCK_M
        bh = tl.program_id(1)
        b = bh // num_heads
        h = bh % num_heads
        rows = tl.arange(0, BLOCK_M)
        dims = tl.arange(0, HEAD_DIM)
        q_start = tl.load(QOff + q_tile)
        q_count = tl.load(QSizes + q_tile)
        q_first = b * q_rb + h * q_rh + q_start + q_row
        if TMA:
            q = Q.load([q_first, b * q_cb + h * q_ch])
        else:
            q = tl.load(Q + (q_first + rows).to(tl.int64)[:, None] * s_q + (b * q_cb + h * q_ch).to(tl.int64)
                        + dims[None, :], mask=(q_row + rows < q_count)[:, None], other=0.0)
        k_row0 = b * k_rb + h * k_rh
        k_col = (b * k_cb + h * k_ch).to(tl.int64)
        v_row0 = b * v_rb + h * v_rh
        v_col = (b * v_cb + h * v_ch).to(tl.int64)
        list_row = bh.to(tl.int64) * num_q_tiles + q_tile
        block_base = Blocks + list_row * max_entries * 2
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        # One loop a step class over the block list (key_block_list: the blocks holding a key, tile after tile
        # within a class), so that the pipeliner keeps one entry's loads per stage. A program without query rows
        # (past a partial tile's end) walks none. Skipping changes no bit of the output: an empty block's scores
        # are -inf, so its step rescales by exactly 1 and adds 0 (the running maximum is finite from the first
        # entry on, every tile's first block holding a key). The short steps change the order of the sums, not
        # what is summed.
        walks = q_row < q_count
        if not SKIP_EMPTY:
            walks = q_row >= 0
        ends = Counts + list_row * CLASSES
        end = tl.where(walks, tl.load(ends), 0)
        m_i, l_i, acc = _walk(q, m_i, l_i, acc, K, V, block_base, 0, end, k_row0, k_col, v_row0, v_col, s_k, s_v,
                              dims, scale_log2, BLOCK_N, TMA, WARP_SPECIALIZE)
        if SHORT_A > 0:
            first = end
            end = tl.where(walks, tl.load(ends + 1), 0)
            m_i, l_i, acc = _walk(q, m_i, l_i, acc, KA, VA, block_base, first, end, k_row0, k_col, v_row0, v_col,
                                  s_k, s_v, dims, scale_log2, SHORT_A, TMA, WARP_SPECIALIZE)
        if SHORT_B > 0:
            first = end
            end = tl.where(walks, tl.load(ends + 2), 0)
            m_i, l_i, acc = _walk(q, m_i, l_i, acc, KB, VB, block_base, first, end, k_row0, k_col, v_row0, v_col,
                                  s_k, s_v, dims, scale_log2, SHORT_B, TMA, WARP_SPECIALIZE)
        out = (acc / l_i[:, None]).to(Out.dtype.element_ty)
        tokens = (q_start + q_row + rows).to(tl.int64)
        row_ok = (q_row + rows < q_count)[:, None]
        if HAS_GATE:  # the reference's addcmul(fine, coarse, gate), each operand in the output dtype
            g = tl.load(Gate + b.to(tl.int64) * s_gb + h.to(tl.int64) * s_gh + tokens[:, None] * s_gs + dims[None, :],
                        mask=row_ok, other=0.0)
            c = tl.load(Coarse + b.to(tl.int64) * s_cb + h.to(tl.int64) * s_ch + q_tile.to(tl.int64) * s_cn + dims)
            c = c.to(Out.dtype.element_ty).to(tl.float32)
            out = (out.to(tl.float32) + c[None, :] * g.to(tl.float32)).to(Out.dtype.element_ty)
        tl.store(Out + b.to(tl.int64) * s_ob + h.to(tl.int64) * s_oh + tokens[:, None] * s_os + dims[None, :], out,
                 mask=row_ok)
