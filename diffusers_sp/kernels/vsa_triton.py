"""Triton kernel of VSA's fine stage: block-sparse attention over each query tile's selected key tiles.

The fine stage of video sparse attention (P. Zhang et al., "VSA: Faster Video Diffusion with
Trainable Sparse Attention", arXiv 2505.13389): every query tile of ``V`` tokens attends, token by
token, to the ``topk`` key tiles its coarse stage selected, and to nothing else. FastVideo runs it
with a ThunderKittens kernel; this one is written for Triton from the paper's description and the
online-softmax recurrence of FlashAttention (T. Dao et al., arXiv 2205.14135 and 2307.08691).

One Triton program computes one (batch, head, query tile): it loads the ``[V, D]`` query tile once,
then walks the tile's list of selected key tiles, ``TILES_PER_STEP`` tiles per step, keeping the running
row maximum, row sum and output accumulator in float32 registers. Key slots past a partial tile's
block size are masked to ``-inf``; the list is read straight from the top-k indices, so no block
mask is built. Tiles of more than 64 slots (the 128-token ``(4, 4, 8)`` and 256-token ``(4, 8, 8)``
tilings) are cut into row blocks of 64: one program per (query tile, row block), each key tile walked in
column blocks of 64, so the register and shared-memory tiles stay those of a 64-slot tile (whole 128-slot
tiles ran the fine stage in 7.3 ms against 2.8 ms in blocks, H100, benchmarks/RESULTS.md). Forward only (inference). On Hopper and newer a second version of the kernel loads
every tile through Triton's tensor descriptors, i.e. with the tensor-memory accelerator (TMA), which
keeps more loads in flight: one tile per step, same arithmetic, bit-identical output.

Only importable where Triton is (CUDA builds of torch); :func:`triton_applies` says whether the
kernel can run on given tensors. Under ``torch.compile`` the launch is the custom operator
``torch.ops.diffusers_sp.vsa_fine_stage_triton`` (the host-side tensor descriptors do not trace), one
opaque node with a fake implementation for the output's shape; eager calls launch directly.
"""

from __future__ import annotations

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

_LOG2_E = 1.4426950408889634
#: Query rows per program and key columns per step: larger tiles are cut into blocks of this many slots.
_BLOCK = 64

#: Launch configuration measured fastest on an H200 (bf16, V = 64, D = 128, top-63 of 624 tiles;
#: benchmarks/RESULTS.md): one key tile per step, four warps (one warpgroup), and the tiles loaded by
#: the tensor-memory accelerator (``tma``) where :func:`tma_applies`, four pipeline stages deep
#: (2.45 ms against 3.07 ms with ordinary loads at two stages in the same run). ``num_stages=None``
#: means 4 with TMA and 2 without (ordinary loads: two tiles per step 3.4 ms, eight warps 5.4-7.0 ms).
#: A later sweep timed 5 and 6 TMA stages at 2.20 and 2.19 ms (4: 2.33-2.48 ms); they are not the
#: default because the GPU tests have not run with them.
DEFAULT_CONFIG = {"tiles_per_step": 1, "num_warps": 4, "num_stages": None, "tma": True}


def triton_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`fine_stage_triton` can run on tiled ``q``, ``k``, ``v`` of ``[B, H, N, V, D]``.

    Needs Triton, CUDA tensors, bfloat16 or float16, a power-of-two tile volume ``V`` in [16, 256]
    and head dim ``D`` in {32, 64, 128} (register tile sizes), and no gradient (forward only).
    """
    if triton is None or not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    tile_volume, head_dim = q.shape[-2], q.shape[-1]
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    power_of_two = tile_volume & (tile_volume - 1) == 0
    return power_of_two and 16 <= tile_volume <= 256 and head_dim in (32, 64, 128) and not needs_grad


def tma_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the tensor-descriptor (TMA) variant of the kernel can run: :func:`triton_applies`,
    Triton's host tensor descriptors, a GPU of compute capability 9.0 or newer, and fewer than 2**31
    rows of ``V`` tokens in q, k and v (TMA coordinates are 32-bit)."""
    if not triton_applies(q, k, v) or TensorDescriptor is None:
        return False
    if torch.cuda.get_device_capability(q.device)[0] < 9:
        return False
    return max(t.numel() // t.shape[-1] for t in (q, k, v)) < 2 ** 31


def triton_requirements(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """The message of the error raised where :func:`triton_applies` is false: what the kernel needs
    and what these tensors are."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return ("the Triton VSA kernel needs Triton, CUDA bfloat16/float16 tensors without gradient, a "
            "power-of-two tile volume V in [16, 256] and head dim D of 32, 64 or 128; got "
            f"Triton {'importable' if triton is not None else 'not installed'}, device {q.device}, {q.dtype}, "
            f"V={q.shape[-2]}, D={q.shape[-1]}, requires_grad={grad}")


def fine_stage_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selected: torch.Tensor,
                      kv_block_sizes: torch.Tensor, scale: float, *, config: dict | None = None) -> torch.Tensor:
    """Block-sparse attention of each query tile over its selected key tiles (VSA's fine stage).

    Args:
        q: Tiled queries ``[B, H, Nq, V, D]``, bfloat16 or float16, CUDA; any strides with the last
            dim contiguous.
        k, v: Tiled keys and values ``[B, H, Nk, V, D]``, same dtype and device; padded key slots
            may hold any finite value (they are masked; a NaN or Inf in a padded V slot would still
            reach the output through ``0 * x``, as in the reference).
        selected: Integer tensor ``[B, H, Nq, topk]`` of key-tile indices in ``[0, Nk)`` (distinct
            per query tile; order does not matter).
        kv_block_sizes: Integer tensor ``[Nk]``, valid tokens of each key tile, each in ``[1, V]``;
            slots ``j >= kv_block_sizes[i]`` of tile ``i`` are masked.
        scale: Softmax scale.
        config: Launch options overriding :data:`DEFAULT_CONFIG` (``tiles_per_step`` in
            {1, 2, 4} with ``V * tiles_per_step <= 256``, 1 for ``V = 256``, ``num_warps``, ``num_stages``, ``tma``:
            load the tiles with the Hopper tensor-memory accelerator through Triton's tensor
            descriptors, used with one tile per step where :func:`tma_applies`, else ordinary
            loads), for benchmarks and tests.

    Returns:
        ``[B, H, Nq, V, D]`` contiguous, q's dtype: softmax over the selected key slots, float32
        accumulation. Rows of padded query slots hold the attention of whatever the slot holds (the
        caller zeroes them).

    Raises:
        ValueError: :func:`triton_applies` is false for these tensors, or ``config`` has an invalid
            ``tiles_per_step``.
    """
    if not triton_applies(q, k, v):
        raise ValueError(triton_requirements(q, k, v))
    if config is None and torch.compiler.is_compiling():
        return torch.ops.diffusers_sp.vsa_fine_stage_triton(q, k, v, selected, kv_block_sizes, scale)
    return _launch(q, k, v, selected, kv_block_sizes, scale, config)


def _launch(q, k, v, selected, kv_block_sizes, scale, config):
    """Launches the kernel (see :func:`fine_stage_triton`); ``[B, H, Nq, V, D]`` contiguous."""
    cfg = dict(DEFAULT_CONFIG, **(config or {}))
    batch, heads, num_q_tiles, tile_volume, head_dim = q.shape
    if cfg["tiles_per_step"] not in (1, 2, 4) or tile_volume * cfg["tiles_per_step"] > 256:
        raise ValueError(f"tiles_per_step must be 1, 2 or 4 with V * tiles_per_step <= 256; got "
                         f"{cfg['tiles_per_step']} with V = {tile_volume}")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    selected = selected.contiguous()
    kv_block_sizes = kv_block_sizes.to(device=q.device, dtype=torch.int32).contiguous()
    out = torch.empty((batch, heads, num_q_tiles, tile_volume, head_dim), device=q.device, dtype=q.dtype)
    topk = selected.shape[-1]
    # Rows per program, and key columns per step (four TMA stages of 128-slot key and value blocks would
    # overflow shared memory at D = 128).
    block = min(tile_volume, _BLOCK)
    grid = (num_q_tiles * (tile_volume // block), batch * heads)
    use_tma = cfg["tma"] and cfg["tiles_per_step"] == 1 and tma_applies(q, k, v)
    stages = cfg["num_stages"] or (4 if use_tma else 2)
    if use_tma:
        flat = [t.contiguous().view(-1, head_dim) for t in (q, k, v, out)]  # [rows, D]; out is contiguous
        descs = [TensorDescriptor.from_tensor(t, [block, head_dim]) for t in flat]
        _vsa_fine_kernel_tma[grid](
            *descs, selected, kv_block_sizes, *selected.stride(), heads, num_q_tiles, k.shape[2], topk,
            scale * _LOG2_E, TILE=tile_volume, HEAD_DIM=head_dim, BLOCK=block,
            num_warps=cfg["num_warps"], num_stages=stages)
        return out
    if tile_volume > block:
        _vsa_fine_kernel_blocks[grid](
            q, k, v, out, selected, kv_block_sizes,
            *q.stride()[:4], *k.stride()[:4], *v.stride()[:4], *out.stride()[:4], *selected.stride(),
            heads, topk, scale * _LOG2_E, TILE=tile_volume, HEAD_DIM=head_dim, BLOCK=block,
            num_warps=cfg["num_warps"], num_stages=stages)
        return out
    _vsa_fine_kernel[grid](
        q, k, v, out, selected, kv_block_sizes,
        *q.stride()[:4], *k.stride()[:4], *v.stride()[:4], *out.stride()[:4], *selected.stride(),
        heads, topk, scale * _LOG2_E,  # the kernel uses exp2
        TILE=tile_volume, HEAD_DIM=head_dim, TILES_PER_STEP=cfg["tiles_per_step"],
        num_warps=cfg["num_warps"], num_stages=stages)
    return out


@torch.library.custom_op("diffusers_sp::vsa_fine_stage_triton", mutates_args=())
def _fine_stage_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selected: torch.Tensor,
                   kv_block_sizes: torch.Tensor, scale: float) -> torch.Tensor:
    return _launch(q, k, v, selected, kv_block_sizes, scale, None)


@_fine_stage_op.register_fake
def _(q, k, v, selected, kv_block_sizes, scale):
    return q.new_empty(q.shape)


if triton is not None:

    @triton.jit
    def _vsa_fine_kernel(Q, K, V, Out, Sel, KVSizes,
                         s_qb, s_qh, s_qn, s_qv, s_kb, s_kh, s_kn, s_kv, s_vb, s_vh, s_vn, s_vv,
                         s_ob, s_oh, s_on, s_ov, s_sb, s_sh, s_sn, s_sk,
                         num_heads, topk, scale_log2,
                         TILE: tl.constexpr, HEAD_DIM: tl.constexpr, TILES_PER_STEP: tl.constexpr):
        # 64-bit offsets: a [B, H, N, V, D] tensor may have more than 2**31 elements.
        q_tile = tl.program_id(0).to(tl.int64)
        bh = tl.program_id(1).to(tl.int64)
        b = bh // num_heads
        h = bh % num_heads
        BLOCK_N: tl.constexpr = TILE * TILES_PER_STEP
        rows = tl.arange(0, TILE)
        cols = tl.arange(0, BLOCK_N)
        dims = tl.arange(0, HEAD_DIM)
        slot = cols % TILE          # slot inside its key tile
        which = cols // TILE        # which of this step's tiles a key column belongs to

        q_ptrs = Q + b * s_qb + h * s_qh + q_tile * s_qn + rows[:, None] * s_qv + dims[None, :]
        q = tl.load(q_ptrs)
        k_base = K + b * s_kb + h * s_kh
        v_base = V + b * s_vb + h * s_vh
        sel_base = Sel + b * s_sb + h * s_sh + q_tile * s_sn

        m_i = tl.full([TILE], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([TILE], dtype=tl.float32)
        acc = tl.zeros([TILE, HEAD_DIM], dtype=tl.float32)
        for start in range(0, topk, TILES_PER_STEP):
            pick = start + which
            in_list = pick < topk
            kv_tile = tl.load(sel_base + pick * s_sk, mask=in_list, other=0).to(tl.int64)
            n_valid = tl.load(KVSizes + kv_tile, mask=in_list, other=0)
            key_ok = slot < n_valid  # False for padded slots and for a step past the list's end
            k = tl.load(k_base + kv_tile[:, None] * s_kn + slot[:, None] * s_kv + dims[None, :])
            s = tl.dot(q, tl.trans(k)) * scale_log2
            s = tl.where(key_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            vals = tl.load(v_base + kv_tile[:, None] * s_vn + slot[:, None] * s_vv + dims[None, :])
            acc = acc * alpha[:, None] + tl.dot(p.to(vals.dtype), vals)
            m_i = m_new
        acc = acc / l_i[:, None]
        o_ptrs = Out + b * s_ob + h * s_oh + q_tile * s_on + rows[:, None] * s_ov + dims[None, :]
        tl.store(o_ptrs, acc.to(Out.dtype.element_ty))

    @triton.jit
    def _vsa_fine_kernel_tma(q_desc, k_desc, v_desc, o_desc, Sel, KVSizes, s_sb, s_sh, s_sn, s_sk,
                             num_heads, num_q_tiles, num_kv_tiles, topk, scale_log2,
                             TILE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
        # The same recurrence as _vsa_fine_kernel, one key tile per step, with every tile moved by
        # the tensor-memory accelerator: q, k, v and out are [rows of TILE tokens, HEAD_DIM] 2-D
        # views, tile i of (batch, head) bh at row (bh * num_tiles + i) * TILE. A program holds BLOCK
        # rows of its query tile (BLOCK = min(TILE, 64)) and walks each key tile in BLOCK
        # columns.
        PARTS: tl.constexpr = TILE // BLOCK
        q_tile = tl.program_id(0) // PARTS
        q_row = tl.program_id(0) % PARTS * BLOCK
        bh = tl.program_id(1)
        b = bh // num_heads
        h = bh % num_heads
        cols = tl.arange(0, BLOCK)
        q = q_desc.load([(bh * num_q_tiles + q_tile) * TILE + q_row, 0])
        sel_base = Sel + b.to(tl.int64) * s_sb + h.to(tl.int64) * s_sh + q_tile.to(tl.int64) * s_sn
        kv_row0 = bh * num_kv_tiles
        m_i = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK], dtype=tl.float32)
        acc = tl.zeros([BLOCK, HEAD_DIM], dtype=tl.float32)
        # One loop over (selected tile, column block) pairs, so that the pipeliner keeps one block's loads
        # per stage. A column block of padded slots only (part * BLOCK >= n_valid) adds nothing: its scores
        # are -inf and the running maximum is finite from a tile's first block on.
        for step in range(0, topk * PARTS):
            part = step % PARTS
            kv_tile = tl.load(sel_base + (step // PARTS) * s_sk).to(tl.int32)
            n_valid = tl.load(KVSizes + kv_tile)
            k = k_desc.load([(kv_row0 + kv_tile) * TILE + part * BLOCK, 0])
            s = tl.dot(q, tl.trans(k)) * scale_log2
            s = tl.where((part * BLOCK + cols < n_valid)[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            vals = v_desc.load([(kv_row0 + kv_tile) * TILE + part * BLOCK, 0])
            acc = acc * alpha[:, None] + tl.dot(p.to(vals.dtype), vals)
            m_i = m_new
        acc = acc / l_i[:, None]
        o_desc.store([(bh * num_q_tiles + q_tile) * TILE + q_row, 0], acc.to(q.dtype))

    @triton.jit
    def _vsa_fine_kernel_blocks(Q, K, V, Out, Sel, KVSizes,
                                s_qb, s_qh, s_qn, s_qv, s_kb, s_kh, s_kn, s_kv, s_vb, s_vh, s_vn, s_vv,
                                s_ob, s_oh, s_on, s_ov, s_sb, s_sh, s_sn, s_sk,
                                num_heads, topk, scale_log2,
                                TILE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
        # _vsa_fine_kernel_tma with ordinary loads, for tiles larger than BLOCK where TMA does not apply.
        PARTS: tl.constexpr = TILE // BLOCK
        q_tile = (tl.program_id(0) // PARTS).to(tl.int64)
        q_row = tl.program_id(0) % PARTS * BLOCK
        bh = tl.program_id(1).to(tl.int64)
        b = bh // num_heads
        h = bh % num_heads
        rows = q_row + tl.arange(0, BLOCK)
        cols = tl.arange(0, BLOCK)
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + b * s_qb + h * s_qh + q_tile * s_qn + rows[:, None] * s_qv + dims[None, :])
        k_base = K + b * s_kb + h * s_kh
        v_base = V + b * s_vb + h * s_vh
        sel_base = Sel + b * s_sb + h * s_sh + q_tile * s_sn
        m_i = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK], dtype=tl.float32)
        acc = tl.zeros([BLOCK, HEAD_DIM], dtype=tl.float32)
        for step in range(0, topk * PARTS):
            slot = step % PARTS * BLOCK + cols
            kv_tile = tl.load(sel_base + (step // PARTS) * s_sk).to(tl.int64)
            n_valid = tl.load(KVSizes + kv_tile)
            k = tl.load(k_base + kv_tile * s_kn + slot[:, None] * s_kv + dims[None, :])
            s = tl.dot(q, tl.trans(k)) * scale_log2
            s = tl.where((slot < n_valid)[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            vals = tl.load(v_base + kv_tile * s_vn + slot[:, None] * s_vv + dims[None, :])
            acc = acc * alpha[:, None] + tl.dot(p.to(vals.dtype), vals)
            m_i = m_new
        acc = acc / l_i[:, None]
        tl.store(Out + b * s_ob + h * s_oh + q_tile * s_on + rows[:, None] * s_ov + dims[None, :],
                 acc.to(Out.dtype.element_ty))
