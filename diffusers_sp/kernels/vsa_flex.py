"""VSA's fine stage on ``flex_attention``: the selection as a block-sparse BlockMask of whole tiles, compiled.

The portable GPU backend of :mod:`~diffusers_sp.kernels.vsa` (``backend="flex"``): it runs wherever
``torch.nn.attention.flex_attention`` compiles (any CUDA card, any 16/32-bit float dtype), slower than the
Triton and Gluon fine stages on Hopper (benchmarks/RESULTS.md). The block-sparse mask format is
flex_attention's own (PyTorch, ``BlockMask.from_kv_blocks``); one block is one tile of the VSA layout
(:mod:`~diffusers_sp.kernels.tiles`).
"""

from __future__ import annotations

import functools

import torch

try:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # torch without flex_attention
    BlockMask = None
    flex_attention = None

from .tiles import block_lists

__all__ = ["FLEX_DTYPES", "fine_stage_flex", "selection_block_mask", "flex_kernel_options", "flex_applies"]

FLEX_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def fine_stage_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selected: torch.Tensor,
                    kv_block_sizes: torch.Tensor, scale: float) -> torch.Tensor:
    """VSA's fine stage with compiled ``flex_attention`` and a BlockMask whose blocks are whole tiles.

    Args:
        q: ``[B, H, Nq, V, D]`` tiled queries (CUDA, bf16/fp16/fp32; see :func:`flex_applies`).
        k, v: ``[B, H, Nk, V, D]`` tiled keys and values, padded slots zero.
        selected: ``[B, H, Nq, topk]`` distinct key-tile indices per query tile (any order).
        kv_block_sizes: integer ``[Nk]``, each key tile's valid tokens, on q's device.
        scale: the softmax scale applied to ``q @ k^T``.

    Returns:
        ``[B, H, Nq, V, D]`` in q's dtype: each query slot's attention over the valid slots of its tile's
        selected key tiles.
    """
    batch, heads, num_q_tiles, tile_volume, head_dim = q.shape
    num_kv_tiles = k.shape[2]
    block_mask = selection_block_mask(selected, kv_block_sizes, tile_volume)
    # Inside a compiled region the enclosing compile compiles flex_attention (a nested torch.compile
    # call would not trace).
    attend = flex_attention if torch.compiler.is_compiling() else compiled_flex_attention()
    out = attend(
        q.reshape(batch, heads, num_q_tiles * tile_volume, head_dim),
        k.reshape(batch, heads, num_kv_tiles * tile_volume, head_dim),
        v.reshape(batch, heads, num_kv_tiles * tile_volume, head_dim),
        block_mask=block_mask, scale=scale,
        kernel_options=flex_kernel_options(tile_volume, head_dim, q.element_size()))
    return out.view(batch, heads, num_q_tiles, tile_volume, head_dim)


def selection_block_mask(selected: torch.Tensor, kv_block_sizes: torch.Tensor, tile_volume: int):
    """Forward-only BlockMask of the fine stage: block size ``V`` (one block = one tile) on both axes.

    Args:
        selected: ``[B, H, Nq, topk]`` distinct selected key-tile indices per query tile.
        kv_block_sizes: LongTensor ``[Nk]`` on the same device.
        tile_volume: ``V``.

    Selected key tiles with ``V`` valid tokens are "full" blocks (no mask_mod evaluated); selected
    partial tiles are mask_mod blocks, where ``mask_mod`` keeps the key slots below the tile's block
    size. Each ``[..., Nk]`` index list starts with its ``count`` tiles in ascending order; the
    entries after the count are never read. The transposed lists that only the backward pass reads
    are not built (they cost more than the rest of the mask).

    The selection lives in the block lists only (putting it in ``mask_mod`` as well made the fine
    stage 60 % slower on an H200), so only compiled flex_attention computes VSA with this mask;
    uncompiled flex_attention reads ``mask_mod`` alone and would attend to every tile.
    """
    num_q_tiles = selected.shape[2]
    num_kv_tiles = kv_block_sizes.shape[0]
    whole = (kv_block_sizes == tile_volume)[selected]  # [B, H, Nq, topk]
    full_num_blocks, full_indices = block_lists(selected, whole, num_kv_tiles)
    partial_num_blocks, partial_indices = block_lists(selected, ~whole, num_kv_tiles)

    def valid_key_slot(b, h, q_idx, kv_idx):
        return (kv_idx % tile_volume) < kv_block_sizes[kv_idx // tile_volume]

    return BlockMask.from_kv_blocks(
        partial_num_blocks, partial_indices, full_num_blocks, full_indices,
        BLOCK_SIZE=tile_volume, mask_mod=valid_key_slot,
        seq_lengths=(num_q_tiles * tile_volume, num_kv_tiles * tile_volume),
        compute_q_blocks=False)


def flex_kernel_options(tile_volume: int, head_dim: int, element_size: int) -> dict:
    """Triton launch options for flex_attention's forward kernel.

    The kernel's ``BLOCK_M`` / ``BLOCK_N`` must divide the BlockMask block size (here ``V``); its
    defaults on Hopper (``BLOCK_M = 128`` for bf16, D = 128) do not divide ``V = 64``. Take the
    largest power of two (at least 16, which ``V % 16 == 0`` guarantees) that divides ``V``, capped
    lower for wide rows (``D * element_size > 256`` bytes) to stay within shared memory. Four warps
    and two stages: on an H200 (bf16, D = 128, V = 64, Wan2.1 shape, 90 % sparsity) they ran the
    fine stage in about 3.1 ms against 6.5 ms for the default eight warps.
    """
    wide_rows = head_dim * element_size > 256
    cap_m, cap_n = (64, 32) if wide_rows else (128, 64)

    def largest_divisor(cap: int) -> int:
        size = cap
        while tile_volume % size:
            size //= 2
        return size

    return {"BLOCK_M": largest_divisor(cap_m), "BLOCK_N": largest_divisor(cap_n), "num_warps": 4, "num_stages": 2}


@functools.lru_cache(maxsize=None)
def compiled_flex_attention():
    """``torch.compile(flex_attention, fullgraph=True)``, built on first use.

    ``fullgraph=True`` turns a graph break or a hit recompile limit into an error: without it
    dynamo would fall back to uncompiled flex_attention, which ignores the block lists (see
    :func:`selection_block_mask`) and materialises the full score matrix.
    """
    return torch.compile(flex_attention, fullgraph=True)


def flex_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`fine_stage_flex` can run on tiled ``[B, H, N, V, D]`` tensors: CUDA, flex_attention
    importable, a 16/32-bit float dtype, V a multiple of 16 (the kernel's smallest tile), D >= 16 (tensor-core
    dot products), and no gradient wanted (the BlockMask is built for the forward pass only)."""
    tile_volume, head_dim = q.shape[-2], q.shape[-1]
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return (q.is_cuda and flex_attention is not None and q.dtype in FLEX_DTYPES
            and tile_volume % 16 == 0 and head_dim >= 16 and not needs_grad)
