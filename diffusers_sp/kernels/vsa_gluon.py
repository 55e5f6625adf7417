"""Warp-specialised Hopper kernel of video sparse attention's (VSA) fine stage, in Triton's Gluon dialect.

VSA is "VSA: Faster Video Diffusion with Trainable Sparse Attention" (P. Zhang et al., arXiv 2505.13389); the
fine stage is FlashAttention's online softmax (T. Dao et al., arXiv 2205.14135) over the key tiles each query
tile selected. :mod:`~diffusers_sp.kernels.vsa_triton` runs it as a Triton kernel whose pipelining the compiler
chooses; here the schedule is written out, as FlashAttention-3 does on Hopper (J. Shah et al., arXiv
2407.08608):

* one producer warp walks the query tile's block list (:func:`~diffusers_sp.kernels.vsa_block_list.key_block_list`:
  the key blocks of 64 rows of its selected tiles that hold a key; a program past a partial query tile's end
  walks one block only) and loads each key and value block into a ring of shared-memory stages with the
  tensor-memory accelerator (TMA), signalling an mbarrier per block; each consumer frees a stage by arriving on
  its "empty" barrier;
* a consumer warpgroup per 64 query rows issues the scores product of the next key block (``wgmma``,
  asynchronous) before it runs the softmax of the current block, so the exponentials overlap the tensor cores,
  then issues the value product with the probabilities taken from registers, and stores its rows with the
  gated coarse output added.

Tiles of 64 slots take one consumer (64 query rows a program, two programs a multiprocessor); tiles of 128 and
256 slots take two, FlashAttention-3's 128-row program, so that every key and value block loaded from L2 serves
128 query rows. Same layout, arguments and result as
:func:`~diffusers_sp.kernels.vsa_triton.fine_stage_triton_packed` (packed tiles, read through 2-D row views);
its output equals the Triton kernel's bit for bit. At the Wan 1.3B shape and sparsity 0.9 on an H100
(benchmarks/RESULTS.md) it takes as long as Triton's at 64 slots (2.34-2.44 ms against 2.37-2.40) and runs
3-4 % faster at 128 and 256 (2.33 / 2.54 ms against 2.41 / 2.62 at the best stage count): halving the bytes
read from L2 per product bought little, so the 64 x 64 block loop of each warpgroup, not the feed, bounds
it. ``backend="gluon"`` of :mod:`~diffusers_sp.kernels.vsa` runs it; ``"auto"`` does at
:data:`PREFERRED_TILE_VOLUMES`.
Needs Triton with Gluon (3.5+) and a GPU of compute capability 9.x.
"""

from __future__ import annotations

from typing import Optional

import torch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma, warpgroup_mma_init,
                                                                   warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # no Triton, or one without Gluon
    gluon = None

from .fa4 import device_capability  # a constant under torch.compile
from .vsa_block_list import key_block_list
from .vsa_triton import (_LOG2_E, _output_like, _unit_last_stride, epilogue_args, row_table,
                         tma_applies)
from .vsa_triton import _launch as _launch_triton

#: Key rows of a block (the ring's stage) and query rows of one consumer warpgroup (``wgmma``'s 64-row tile).
BLOCK = 64
#: Tile volumes ``V`` the kernel takes. Tiles of 128 and 256 slots are walked in key blocks of 64; their programs
#: take 128 query rows on two consumer warpgroups, which share every key and value block the producer loads.
TILE_VOLUMES = (64, 128, 256)
#: Tile volumes at which ``backend="auto"`` runs this kernel rather than the Triton one: 256 slots. Walking every
#: block, the call with the gate ran 2.43 ms queued there against 2.52, level at 128 slots (H100, Wan 1.3B shape,
#: sparsity 0.9). With the block list, at 256 slots it ran 1.72-2.02 / 1.39-1.43 ms synced / queued at four
#: stages against 1.95 / 1.48 on Triton's programs of 128 rows (those of 64 rows not timed there), and its fine
#: stage alone is 6 % faster at three stages (1.32 against 1.41 ms; the whole call not timed at three yet); at
#: 128 slots Triton's 64-row programs ran 1.72 / 1.52 ms against 2.42 / 1.70, and at 64 slots Triton was
#: ahead before (benchmarks/RESULTS.md).
PREFERRED_TILE_VOLUMES = (256,)
#: Shared-memory stages of the key ring and of the value ring (each stage ``64 * D`` elements) by consumer
#: count: one consumer, three stages ran 2.41 ms, two 2.45 (H100, D = 128, two programs a multiprocessor); two
#: consumers, three stages in both runs that compared them: walking the block list, 1.32 / 1.41 / 1.44 ms at
#: three / four / five stages at 256 slots and 1.61 / 1.60 / 1.61 at 128; walking every block, 2.55 / 2.56 /
#: 2.54 at 256 and 2.33 / 2.51 / 2.53 at 128 (H100, Wan 1.3B shape; benchmarks/RESULTS.md).
DEFAULT_STAGES = {1: 3, 2: 3}
#: Registers per thread reserved at launch by consumer count. One consumer: 128 on eight warps (the consumer
#: warpgroup, and the producer warp padded to a warpgroup) fit two programs on a multiprocessor. Two: twelve
#: warps at 168 fill a multiprocessor's 65536 registers. The producer gives all but 24 of its back.
DEFAULT_MAX_REGISTERS = {1: 128, 2: 168}


def gluon_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tile_volume: int) -> bool:
    """Whether :func:`fine_stage_gluon_packed` runs on these packed ``[B, H, S, D]`` tensors: Gluon importable,
    compute capability 9.x (Hopper's ``wgmma``), bfloat16/float16, ``V`` in :data:`TILE_VOLUMES`, ``D`` in
    {64, 128}, no gradient, and TMA row views (:func:`~diffusers_sp.kernels.vsa_triton.tma_applies`)."""
    if gluon is None or not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    if device_capability(q.device)[0] != 9 or tile_volume not in TILE_VOLUMES or q.shape[-1] not in (64, 128):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return False
    # Traced tensors have no addresses: the compiled operator checks them when it runs (_fine_stage_op).
    return torch.compiler.is_compiling() or tma_applies(*(_unit_last_stride(t) for t in (q, k, v)))


def gluon_requirements(q: torch.Tensor, tile_volume: int) -> str:
    """The message of the error raised where :func:`gluon_applies` is false: what the kernel needs and what
    these tensors are."""
    return ("the Gluon VSA kernel needs Triton with Gluon, a compute capability 9.x GPU, bfloat16/float16 "
            f"tensors without gradient, V of {'/'.join(map(str, TILE_VOLUMES))} and D of 64 or 128 with TMA row "
            f"views; got Gluon {'importable' if gluon is not None else 'not importable'}, {q.dtype} on "
            f"{q.device}, V={tile_volume}, D={q.shape[-1]}")


def gluon_preferred(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tile_volume: int) -> bool:
    """Whether ``backend="auto"`` runs the fine stage with this kernel rather than the Triton one: where it
    applies at the tile volumes of :data:`PREFERRED_TILE_VOLUMES` (measured faster there)."""
    return tile_volume in PREFERRED_TILE_VOLUMES and gluon_applies(q, k, v, tile_volume)


def fine_stage_gluon_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selected: torch.Tensor, *,
                            q_offsets: torch.Tensor, q_sizes: torch.Tensor, kv_offsets: torch.Tensor,
                            kv_sizes: torch.Tensor, tile_volume: int, scale: float,
                            gate: torch.Tensor | None = None, coarse: torch.Tensor | None = None,
                            stages: int | None = None, max_registers: int | None = None,
                            overlap_values: bool = False) -> torch.Tensor:
    """VSA's fine stage on packed tiles with the warp-specialised Gluon kernel.

    Args and result as :func:`~diffusers_sp.kernels.vsa_triton.fine_stage_triton_packed` (``q``, ``k``,
    ``v``: ``[B, H, S, D]`` bfloat16/float16; ``selected``: ``[B, H, Nq, topk]`` key-tile indices; int32
    offsets and sizes ``[N]``; ``gate`` ``[B, H, Sq, D]`` with ``coarse`` float32 ``[B, H, Nq, D]``), plus
    ``stages``: key and value blocks in flight each (2 to 4 at ``V = 64``, 2 to 5 at 128 and 256; None:
    :data:`DEFAULT_STAGES`), ``max_registers``: registers per thread the launch reserves (None:
    :data:`DEFAULT_MAX_REGISTERS`; at most 255 with one consumer, 168 with two), ``overlap_values``: leave
    each value product in flight under the next block's softmax (FlashAttention-3's full overlap; slower at 64
    slots: 2.54 ms at three stages).

    Raises:
        ValueError: :func:`gluon_applies` is false, only one of ``gate`` and ``coarse`` is given, or
            ``stages`` or ``max_registers`` is out of range.
    """
    q, k, v, gate = (_unit_last_stride(t) for t in (q, k, v, gate))  # once: gluon_applies reads these as they are
    if not gluon_applies(q, k, v, tile_volume):
        raise ValueError(gluon_requirements(q, tile_volume))
    if (gate is None) != (coarse is None):
        raise ValueError("fine_stage_gluon_packed: give gate and coarse together, or neither")
    consumers = 1 if tile_volume == BLOCK else 2
    stages = DEFAULT_STAGES[consumers] if stages is None else stages
    max_registers = DEFAULT_MAX_REGISTERS[consumers] if max_registers is None else max_registers
    if not 2 <= stages <= 3 + consumers:  # shared memory: 64 query rows and 2 * stages blocks a consumer count
        raise ValueError(f"stages must be in [2, {3 + consumers}] at V={tile_volume}, got {stages}")
    if not 24 <= max_registers <= (255 if consumers == 1 else 168):  # twelve warps share 65536 registers
        raise ValueError(f"max_registers must be in [24, {255 if consumers == 1 else 168}] at V={tile_volume}, "
                         f"got {max_registers}")
    if torch.compiler.is_compiling():  # the host-side descriptors do not trace: one opaque operator
        return torch.ops.diffusers_sp.vsa_fine_stage_gluon(q, k, v, selected, q_offsets, q_sizes, kv_offsets,
                                                           kv_sizes, tile_volume, scale, gate, coarse, stages,
                                                           max_registers, overlap_values)
    return _launch(q, k, v, selected, q_offsets, q_sizes, kv_offsets, kv_sizes, tile_volume, scale, gate, coarse,
                   stages, max_registers, overlap_values)


def _launch(q, k, v, selected, q_offsets, q_sizes, kv_offsets, kv_sizes, tile_volume, scale, gate, coarse, stages,
            max_registers, overlap_values):
    """Launches the kernel (see :func:`fine_stage_gluon_packed`; arguments, TMA addresses included, checked
    before)."""
    consumers = 1 if tile_volume == BLOCK else 2
    B, H, _, D = q.shape
    out = _output_like(q)
    blocks, counts = key_block_list(selected, kv_offsets, kv_sizes, tile_volume)
    gl_dtype = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([BLOCK, D], gl_dtype)
    operands = []
    for t in (q, k, v):
        table, coeffs = row_table(t)
        operands += [TensorDescriptor(table, list(table.shape), list(table.stride()), [BLOCK, D], layout), *coeffs]
    grid = (q_offsets.shape[0] * (tile_volume // (BLOCK * consumers)), B * H)
    _vsa_fine_gluon_kernel[grid](
        *operands, out, *out.stride()[:3], *epilogue_args(gate, coarse, out), blocks, counts, blocks.shape[-2],
        q_offsets, q_sizes, H, q_offsets.shape[0], scale * _LOG2_E,
        HEAD_DIM=D, BLOCK=BLOCK, TILE_VOLUME=tile_volume, CONSUMERS=consumers, STAGES=stages,
        CONSUMER_REGISTERS=max_registers // 8 * 8, HAS_GATE=gate is not None, OVERLAP_VALUES=overlap_values,
        num_warps=4, maxnreg=max_registers)
    return out


@torch.library.custom_op("diffusers_sp::vsa_fine_stage_gluon", mutates_args=())
def _fine_stage_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selected: torch.Tensor,
                   q_offsets: torch.Tensor, q_sizes: torch.Tensor, kv_offsets: torch.Tensor, kv_sizes: torch.Tensor,
                   tile_volume: int, scale: float, gate: Optional[torch.Tensor], coarse: Optional[torch.Tensor],
                   stages: int, max_registers: int, overlap_values: bool) -> torch.Tensor:
    # Traced calls could not check the addresses (gluon_applies): tensors TMA cannot read run the Triton kernel.
    if not tma_applies(q, k, v):
        return _launch_triton(q, k, v, selected, q_offsets, q_sizes, kv_offsets, kv_sizes, tile_volume, scale, gate,
                              coarse, None)
    return _launch(q, k, v, selected, q_offsets, q_sizes, kv_offsets, kv_sizes, tile_volume, scale, gate, coarse,
                   stages, max_registers, overlap_values)


@_fine_stage_op.register_fake
def _(q, k, v, selected, q_offsets, q_sizes, kv_offsets, kv_sizes, tile_volume, scale, gate, coarse, stages,
      max_registers, overlap_values):
    return _output_like(q)


if gluon is not None:

    @gluon.jit
    def _load_partition(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, block_base,
                        k_row0, k_col, v_row0, v_col, entries, STAGES: gl.constexpr):
        # The producer warp: key block i of the block list (vsa_block_list.key_block_list) into key stage i % STAGES
        # once every consumer freed it, then value block i likewise (key stages free earlier: a key block is done
        # with once its scores are).
        for i in range(entries):
            stage = i % STAGES
            parity = (i // STAGES & 1) ^ 1  # a fresh barrier passes parity 1: the first STAGES loads go at once
            start = gl.load(block_base + i * 2)
            mbarrier.wait(k_empty.index(stage), parity)
            mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [k_row0 + start, k_col], k_ready.index(stage),
                                            k_smem.index(stage))
            mbarrier.wait(v_empty.index(stage), parity)
            mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [v_row0 + start, v_col], v_ready.index(stage),
                                            v_smem.index(stage))

    @gluon.jit
    def _key_count(block_base, i):
        # Keys of block i of the list that count (the rest of the block is past its tile's end).
        return gl.load(block_base + i * 2 + 1)

    @gluon.jit
    def _softmax_step(s, m_i, l_i, key_count, scale_log2, cols):
        # Online softmax of one block of unscaled scores: masked key rows -inf, the scale inside exp2's argument.
        # The list holds only blocks with a key that counts, and its first block's row maximum is finite.
        s = gl.where(gl.expand_dims(cols < key_count, 0), s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * scale_log2)
        p = gl.exp2(s * scale_log2 - gl.expand_dims(m_new, 1))
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        return p, alpha, m_new, l_i

    @gluon.jit
    def _compute_partition(q_smem, ring, work, stores, first_token, row_count, BLOCK: gl.constexpr,
                           HEAD_DIM: gl.constexpr,
                           STAGES: gl.constexpr, HAS_GATE: gl.constexpr, OVERLAP_VALUES: gl.constexpr):
        # A consumer warpgroup on 64 query rows: the scores of block i + 1 on the tensor cores while the softmax of
        # block i runs (FlashAttention-3's overlap within a warpgroup), then the value product of block i, waited
        # for at once or (OVERLAP_VALUES) under the next block's softmax; then its rows' epilogue and store.
        # out_ptr, gate_ptr: element [token 0, dim 0] of this (batch, head); coarse_ptr: this query tile's row.
        k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty = ring
        block_base, entries, scale_log2 = work
        out_ptr, s_os, gate_ptr, s_gs, coarse_ptr = stores
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        cols = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, s_layout))
        zero_s = gl.zeros([BLOCK, BLOCK], gl.float32, s_layout)
        m_i = gl.full([BLOCK], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([BLOCK], gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([BLOCK, HEAD_DIM], gl.float32, o_layout)

        mbarrier.wait(q_bar, 0)
        mbarrier.wait(k_ready.index(0), 0)
        s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))
        mbarrier.arrive(k_empty.index(0), count=1)
        key_count = _key_count(block_base, 0)
        if OVERLAP_VALUES:  # the accumulator is carried through the loop as an in-flight product's result
            acc = warpgroup_mma_init(acc)
        for i in range(entries - 1):
            stage = i % STAGES
            nxt = (i + 1) % STAGES
            mbarrier.wait(k_ready.index(nxt), (i + 1) // STAGES & 1)
            s_next = warpgroup_mma(q_smem, k_smem.index(nxt).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, key_count, scale_log2, cols)
            if OVERLAP_VALUES:  # block i - 1's value product ran under this softmax: finish it (groups retire in order)
                acc = warpgroup_mma_wait(1, deps=(acc,))
                mbarrier.arrive(v_empty.index((i + STAGES - 1) % STAGES), count=1, pred=i > 0)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            p = gl.convert_layout(p.to(q_smem.dtype), p_layout)
            mbarrier.wait(v_ready.index(stage), i // STAGES & 1)
            acc = warpgroup_mma(p, v_smem.index(stage), acc, is_async=True)
            if OVERLAP_VALUES:  # the scores of block i + 1 are done; block i's value product stays in flight
                s = warpgroup_mma_wait(1, deps=(s_next,))
            else:
                s, acc = warpgroup_mma_wait(0, deps=(s_next, acc))
                mbarrier.arrive(v_empty.index(stage), count=1)
            mbarrier.arrive(k_empty.index(nxt), count=1)
            key_count = _key_count(block_base, i + 1)
        last = (entries - 1) % STAGES
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, key_count, scale_log2, cols)
        if OVERLAP_VALUES:
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(v_empty.index((entries + STAGES - 2) % STAGES), count=1, pred=entries > 1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        p = gl.convert_layout(p.to(q_smem.dtype), p_layout)
        mbarrier.wait(v_ready.index(last), (entries - 1) // STAGES & 1)
        acc = warpgroup_mma(p, v_smem.index(last), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(v_empty.index(last), count=1)

        dtype: gl.constexpr = out_ptr.dtype.element_ty
        out = (acc / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)), 1)).to(dtype)
        rows = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, o_layout))
        dims = gl.expand_dims(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout)), 0)
        tokens = gl.expand_dims((first_token + rows).to(gl.int64), 1)
        row_ok = gl.expand_dims(rows < row_count, 1)
        if HAS_GATE:  # the reference's addcmul(fine, coarse, gate), each operand in the output dtype
            g = gl.load(gate_ptr + tokens * s_gs + dims, mask=row_ok, other=0.0)
            c = gl.load(coarse_ptr + dims).to(dtype).to(gl.float32)
            out = (out.to(gl.float32) + c * g.to(gl.float32)).to(dtype)
        gl.store(out_ptr + tokens * s_os + dims, out, mask=row_ok)

    @gluon.jit
    def _vsa_fine_gluon_kernel(q_desc, q_rb, q_rh, q_cb, q_ch, k_desc, k_rb, k_rh, k_cb, k_ch,
                               v_desc, v_rb, v_rh, v_cb, v_ch, Out, s_ob, s_oh, s_os,
                               Gate, s_gb, s_gh, s_gs, Coarse, s_cb, s_ch, s_cn,
                               Blocks, Counts, max_entries, QOff, QSizes, num_heads, num_q_tiles, scale_log2,
                               HEAD_DIM: gl.constexpr, BLOCK: gl.constexpr, TILE_VOLUME: gl.constexpr,
                               CONSUMERS: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGISTERS: gl.constexpr,
                               HAS_GATE: gl.constexpr, OVERLAP_VALUES: gl.constexpr):
        # q/k/v_desc: TMA descriptors of 2-D row views; element [b, h, s, :] is row (b * rb + h * rh + s),
        # columns from (b * cb + h * ch), as in vsa_triton's kernel. A program: (query tile, block of 64 *
        # CONSUMERS rows of it) x (batch, head).
        Q_PARTS: gl.constexpr = TILE_VOLUME // (BLOCK * CONSUMERS)
        q_tile = gl.program_id(0) // Q_PARTS
        q_row = gl.program_id(0) % Q_PARTS * (BLOCK * CONSUMERS)
        bh = gl.program_id(1)
        b = bh // num_heads
        h = bh % num_heads
        first_token = gl.load(QOff + q_tile) + q_row
        row_count = gl.load(QSizes + q_tile) - q_row
        list_row = bh.to(gl.int64) * num_q_tiles + q_tile
        block_base = Blocks + list_row * max_entries * 2
        # A program without query rows (past a partial tile's end) walks one block, not none: the consumers'
        # loop is written for at least one.
        entries = 1 + (row_count > 0).to(gl.int32) * (gl.load(Counts + list_row) - 1)

        q_smem = gl.allocate_shared_memory(q_desc.dtype, [CONSUMERS] + q_desc.block_type.shape, q_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=CONSUMERS)  # a stage is free once every consumer is done with it
            mbarrier.init(v_empty.index(i), count=CONSUMERS)
        mbarrier.expect(q_bar, CONSUMERS * q_desc.block_type.nbytes)
        for c in gl.static_range(CONSUMERS):
            tma.async_copy_global_to_shared(q_desc, [b * q_rb + h * q_rh + first_token + c * BLOCK,
                                                     b * q_cb + h * q_ch], q_bar, q_smem.index(c))

        out_ptr = Out + b.to(gl.int64) * s_ob + h.to(gl.int64) * s_oh
        gate_ptr = Gate + b.to(gl.int64) * s_gb + h.to(gl.int64) * s_gh
        coarse_ptr = Coarse + b.to(gl.int64) * s_cb + h.to(gl.int64) * s_ch + q_tile.to(gl.int64) * s_cn
        ring = (k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty)
        work = (block_base, entries, scale_log2)
        stores = (out_ptr, s_os, gate_ptr, s_gs, coarse_ptr)
        producer_args = (k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, block_base,
                         b * k_rb + h * k_rh, b * k_cb + h * k_ch, b * v_rb + h * v_rh, b * v_cb + h * v_ch, entries,
                         STAGES)
        if CONSUMERS == 1:
            gl.warp_specialize([
                (_compute_partition, (q_smem.index(0), ring, work, stores, first_token, row_count, BLOCK, HEAD_DIM,
                                      STAGES, HAS_GATE, OVERLAP_VALUES)),
                (_load_partition, producer_args)], [1], [24])
        else:  # the second consumer's 64 rows in a worker partition of four warps
            gl.warp_specialize([
                (_compute_partition, (q_smem.index(0), ring, work, stores, first_token, row_count, BLOCK, HEAD_DIM,
                                      STAGES, HAS_GATE, OVERLAP_VALUES)),
                (_compute_partition, (q_smem.index(1), ring, work, stores, first_token + BLOCK, row_count - BLOCK,
                                      BLOCK, HEAD_DIM, STAGES, HAS_GATE, OVERLAP_VALUES)),
                (_load_partition, producer_args)], [4, 1], [CONSUMER_REGISTERS, 24])
