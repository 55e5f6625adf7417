"""Video sparse attention (VSA): 3-D tiling, a coarse tile-level stage and a block-sparse fine stage.

Implements the attention of "VSA: Faster Video Diffusion with Trainable Sparse Attention"
(P. Zhang et al., arXiv 2505.13389) as described there and in the FastVideo implementation it
accompanies (https://github.com/hao-ai-lab/FastVideo). The code here is written from that
description, not copied.

The patchified latent grid ``(T, H, W)`` (tokens in raster order: t-major, then h, then w) is
cut into cubes ("tiles") of ``tile = (tt, th, tw)`` tokens, tiles ordered t-major, then h, then w,
tokens inside a tile in raster order. Each tile occupies ``V = tt * th * tw`` slots; edge tiles
may be partial: their ``block_sizes[i]`` valid tokens fill the first slots and the padded slots
after them hold zeros. On tiled tensors ``[B, H, N, V, D]``:

1. coarse stage: the mean q, k, v of each tile (float32), tile-level softmax attention, its output
   broadcast to every slot of the query tile;
2. selection: per (batch, head, query tile), the top-k key tiles by coarse score,
   ``k = clamp(ceil((1 - sparsity) * N_kv), 1, N_kv)`` with ``N_kv`` the global key-tile count;
3. fine stage: token-level attention of each query tile over the valid tokens of its selected
   key tiles only;
4. combine: ``out = coarse_out * gate + fine_out`` (no gate: ``out = fine_out``).

With ``sparsity = 0`` and no gate this is dense attention. Query tiles are independent given the
full K/V, so a rank that owns a contiguous range of whole tiles can compute its rows alone (the
K/V-gather path): pass its query tiles and all key tiles.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .fa4 import fa4_block_sparse_applies, fa4_block_sparse_fine_stage
# The tile layout and block lists live in .tiles (shared with the FA4 backend); re-exported here, where
# callers of the attention find them.
from .tiles import (TileLayout, _check_sparsity, block_lists, make_tile_layout, packed_offsets, packed_slots,
                    pad_tiles, tile_range_tokens, tile_tokens, unpad_tiles, untile_tokens, vsa_topk)
from .vsa_coarse_triton import coarse_stage_triton
from .vsa_flex import FLEX_DTYPES, fine_stage_flex, flex_applies
from .vsa_gluon import fine_stage_gluon_packed, gluon_applies, gluon_preferred, gluon_requirements
from .vsa_triton import fine_stage_triton_packed, padded_tiles, triton_applies, triton_requirements

__all__ = ["BACKENDS", "AUTO_ORDER", "TileLayout", "block_lists", "make_tile_layout", "tile_range_tokens",
           "tile_tokens", "untile_tokens", "vsa_topk", "video_sparse_attention", "video_sparse_attention_packed",
           "auto_backend", "backend_on"]

BACKENDS = ("auto", "reference", "flex", "triton", "gluon", "fa4")
# The order in which backend="auto" tries the fine-stage kernels (the first that applies runs), fastest
# first as measured at the Wan2.1-1.3B shape on an H200 (sparsity 0.9, bf16; benchmarks/RESULTS.md):
# Triton 2.53-2.54 ms, flex 3.07-3.16 ms, FA4 block-sparse 3.61-3.69 ms (3.32 ms even with every block
# passed as full, so at 64 x 64 blocks FA4's block-sparse forward is the slower kernel here); on an H100
# at 64-, 128- and 256-slot tiles Triton was fastest too, except that at 256 the warp-specialised Gluon fine
# stage with two consumer warpgroups ran the call faster (Hopper; "gluon" applies in this order only where
# vsa_gluon.gluon_preferred says so; its coarse stage is the Triton backend's). The packed API follows the same
# order.
AUTO_ORDER = ("gluon", "triton", "flex", "fa4", "reference")

# Upper bound on the elements (scores plus gathered keys and values) that one chunk of query tiles
# may materialise in the reference fine stage.
_REFERENCE_CHUNK_ELEMENTS = 1 << 26


def video_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                           q_block_sizes: torch.Tensor, kv_block_sizes: torch.Tensor,
                           sparsity: float, gate: torch.Tensor | None = None,
                           scale: float | None = None, backend: str = "auto") -> torch.Tensor:
    """VSA on tiled tensors (arXiv 2505.13389): coarse tile attention, top-k tile selection,
    block-sparse token attention, gated combination.

    Args:
        q: Tiled queries ``[B, H, Nq, V, D]`` (from :func:`tile_tokens`); bfloat16, float16,
            float32 (or float64, reference backend); padded slots zero. The ``Nq`` query tiles
            may be any subset of the grid's tiles (for example one rank's contiguous range).
        k: Tiled keys ``[B, H, Nk, V, D]``, all key tiles of the grid; same dtype and device;
            padded slots zero. ``Nk`` is the global tile count that sets top-k.
        v: Tiled values ``[B, H, Nk, V, D]``; padded slots zero when a gate is given.
        q_block_sizes: Integer tensor ``[Nq]``, valid tokens of each query tile, each in ``[1, V]``.
        kv_block_sizes: Integer tensor ``[Nk]``, valid tokens of each key tile, each in ``[1, V]``.
        sparsity: Fraction of key tiles each query tile skips, in ``[0, 1)``; each query tile keeps
            ``vsa_topk(Nk, sparsity)`` key tiles.
        gate: None (a zero gate: the output is the fine stage alone), or ``[B, H, Nq, V, D]``,
            the per-token weight of the coarse output (cast to q's dtype).
        scale: Softmax scale of both stages; None means ``1 / sqrt(D)``.
        backend: ``"reference"`` (pure torch, any device, differentiable), ``"fa4"``
            (FlashAttention-4's block-sparse forward, one 64-slot tile per sparse block; CUDA sm90,
            bf16/fp16, ``V`` a multiple of 64, see :func:`~diffusers_sp.kernels.fa4.fa4_block_sparse_fine_stage`),
            ``"triton"`` (the
            block-sparse Triton kernel of :mod:`diffusers_sp.kernels.vsa_triton`; CUDA, bf16/fp16,
            forward only, see :func:`~diffusers_sp.kernels.vsa_triton.triton_applies`), ``"gluon"`` (the
            Triton backend with the warp-specialised fine stage of :mod:`diffusers_sp.kernels.vsa_gluon`;
            Hopper, see :func:`~diffusers_sp.kernels.vsa_gluon.gluon_applies`), ``"flex"``
            (``flex_attention`` with a block-sparse ``BlockMask``, compiled; CUDA only, ``V`` a
            multiple of 16, ``D >= 16``, forward only) or ``"auto"`` (the first that applies in the order
            of :data:`AUTO_ORDER`; ``"gluon"`` only where
            :func:`~diffusers_sp.kernels.vsa_gluon.gluon_preferred`).

    Returns:
        ``[B, H, Nq, V, D]`` in q's dtype; padded query slots are zero.

    Raises:
        ValueError: tensors not 5-D or with mismatched batch / heads / V / D / dtype / device,
            block sizes of the wrong length or dtype, ``sparsity`` outside ``[0, 1)``, a gate of
            the wrong shape, an unknown backend, or ``"fa4"``, ``"flex"``, ``"triton"`` or ``"gluon"`` where it
            cannot run.

    The tile means sum every slot (in float32) and divide by the block size, so padded slots must be
    zero, as :func:`tile_tokens` leaves them; the fine stage masks padded key slots itself. The
    coarse stage (means, scores, softmax) runs in float32 (float64 for float64 input), the fine
    stage and the gated sum in q's dtype.
    """
    _validate(q, k, v, q_block_sizes, kv_block_sizes, sparsity, gate, backend)
    tile_volume, head_dim = q.shape[3], q.shape[4]
    num_kv_tiles = k.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    q_block_sizes = q_block_sizes.to(device=q.device, dtype=torch.long)
    kv_block_sizes = kv_block_sizes.to(device=q.device, dtype=torch.long)
    if backend == "auto":
        backend = auto_backend(q, k, v)
    q_valid = _slot_mask(q_block_sizes, tile_volume)  # [Nq, V]
    if backend in ("triton", "gluon"):  # the padded tiles read as packed ones (offsets i * V), every row stored
        num_q_tiles = q.shape[2]
        q_offsets, every_row = padded_tiles(num_q_tiles, tile_volume, q.device)
        kv_offsets, _ = padded_tiles(num_kv_tiles, tile_volume, q.device)
        out = _triton_vsa(q.flatten(2, 3), k.flatten(2, 3), v.flatten(2, 3), q_tiles=(q_offsets, q_block_sizes),
                          kv_tiles=(kv_offsets, kv_block_sizes), q_rows=every_row, tile_volume=tile_volume,
                          sparsity=sparsity, gate=None if gate is None else gate.flatten(2, 3),
                          scale=scale, fine_kernel=backend)
        return out.unflatten(2, (num_q_tiles, tile_volume)).masked_fill(~q_valid.unsqueeze(-1), 0)

    # Coarse stage: tile means and tile-level scores, in float32.
    q_mean = _tile_means(q, q_block_sizes)
    k_mean = _tile_means(k, kv_block_sizes)
    scores = torch.matmul(q_mean, k_mean.transpose(-1, -2)) * scale  # [B, H, Nq, Nk]

    # Selection: the top-k key tiles of each query tile.
    topk = vsa_topk(num_kv_tiles, sparsity)
    # Unsorted: the fine stages take the selected tiles in any order, and skipping the sort is cheaper.
    selected = scores.topk(topk, dim=-1, sorted=False).indices  # [B, H, Nq, topk]

    # Fine stage: token attention over the selected key tiles.
    if backend == "fa4":
        out = fa4_block_sparse_fine_stage(q, k, v, selected, kv_block_sizes, scale)
    elif backend == "flex":
        out = fine_stage_flex(q, k, v, selected, kv_block_sizes, scale)
    else:
        out = _fine_stage_reference(q, k, v, selected, kv_block_sizes, scale)

    if gate is not None:
        v_mean = _tile_means(v, kv_block_sizes)
        coarse_out = torch.matmul(torch.softmax(scores, dim=-1), v_mean)  # [B, H, Nq, D]
        out = torch.addcmul(out, coarse_out.to(q.dtype).unsqueeze(3), gate.to(q.dtype))
    return out.masked_fill(~q_valid.unsqueeze(-1), 0)


def video_sparse_attention_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, tile_volume: int,
                                  q_block_sizes: torch.Tensor, kv_block_sizes: torch.Tensor, sparsity: float,
                                  gate: torch.Tensor | None = None, scale: float | None = None,
                                  backend: str = "auto", q_block_offsets: torch.Tensor | None = None,
                                  kv_block_offsets: torch.Tensor | None = None) -> torch.Tensor:
    """VSA (arXiv 2505.13389) on tile-ordered tokens without padding: the tiles of
    :func:`video_sparse_attention`, each holding only its valid tokens, one after the other.

    This is the layout the VSA processor keeps through the transformer (tokens put in tile order once per
    forward), so an attention call makes no padded copy of q, k, v, the gate or the output: the Triton
    backend reads tile ``i`` at the running sum of the sizes before it. The other backends pad to
    ``[B, H, N, V, D]``, run :func:`video_sparse_attention` and drop the padding again.

    Args:
        q: ``[B, H, Sq, D]``: the valid tokens of ``Nq`` tiles (any subset of consecutive tiles, e.g. one rank's
            range), tile after tile, each tile's in the slot order of :func:`make_tile_layout`; any strides.
        k, v: ``[B, H, Sk, D]``: the valid tokens of all ``Nk`` key tiles, likewise.
        tile_volume: ``V``, the slots of a whole tile.
        q_block_sizes: Integer tensor ``[Nq]``, tokens of each query tile, each in ``[1, V]``, summing to
            ``Sq``; kv_block_sizes: ``[Nk]``, summing to ``Sk``. Checked where they are on the CPU (outside
            ``torch.compile``); on the GPU they are trusted (a check would wait for the device).
        sparsity, scale, backend: as for :func:`video_sparse_attention` (``"auto"``: the Triton kernels where
            :func:`~diffusers_sp.kernels.vsa_triton.triton_applies`, with the Gluon fine stage where
            :func:`~diffusers_sp.kernels.vsa_gluon.gluon_preferred`, else ``video_sparse_attention``'s choice).
        gate: None or ``[B, H, Sq, D]``, the per-token weight of the coarse output.
        q_block_offsets, kv_block_offsets: None, or integer ``[Nq]`` / ``[Nk]`` tensors on the sizes' device:
            where each tile starts in q / k, the exclusive running sum of the sizes (:func:`packed_offsets`).
            For callers that make many calls on one layout (the VSA processor builds them once per tile plan:
            int32 sizes and offsets on the device spare the Triton path its per-call conversions and running
            sums); None computes them. Checked against the sizes where both are on the CPU, else trusted.

    Returns:
        ``[B, H, Sq, D]`` in q's dtype (Triton: a view of a token-major ``[Sq, B, H, D]`` buffer).

    Raises:
        ValueError: tensors not 4-D or with mismatched batch / heads / D / dtype / device, block sizes of the
            wrong length, dtype or sum, block offsets that are not the sizes' running sum, a gate of the wrong
            shape, ``sparsity`` outside ``[0, 1)``, an unknown backend, or a backend that cannot run on these
            tensors.
    """
    _validate_packed(q, k, v, tile_volume, q_block_sizes, kv_block_sizes, gate, backend)
    _validate_offsets(q_block_sizes, q_block_offsets, "q_block_offsets")
    _validate_offsets(kv_block_sizes, kv_block_offsets, "kv_block_offsets")
    _check_sparsity(sparsity)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if backend in ("auto", "triton", "gluon") and triton_applies(q, k, v, tile_volume):
        gluon = backend == "gluon" or (backend == "auto" and gluon_preferred(q, k, v, tile_volume))
        q_sizes = q_block_sizes.to(device=q.device, dtype=torch.int32)
        kv_sizes = kv_block_sizes.to(device=q.device, dtype=torch.int32)
        q_offsets, kv_offsets = (packed_offsets(sizes) if given is None else given.to(q.device, torch.int32)
                                 for sizes, given in ((q_sizes, q_block_offsets), (kv_sizes, kv_block_offsets)))
        return _triton_vsa(q, k, v, q_tiles=(q_offsets, q_sizes), kv_tiles=(kv_offsets, kv_sizes), q_rows=q_sizes,
                           tile_volume=tile_volume, sparsity=sparsity, gate=gate, scale=scale,
                           fine_kernel="gluon" if gluon else "triton")
    if backend == "triton":
        raise ValueError(f"backend='triton': {triton_requirements(q, k, v, tile_volume)}. Use backend='reference', "
                         "'flex' or 'auto'.")
    q_slots = packed_slots(q_block_sizes.to(q.device), tile_volume, q.shape[2])
    kv_slots = packed_slots(kv_block_sizes.to(q.device), tile_volume, k.shape[2])
    num_q_tiles, num_kv_tiles = q_block_sizes.shape[0], kv_block_sizes.shape[0]
    out = video_sparse_attention(
        pad_tiles(q, q_slots, num_q_tiles, tile_volume), pad_tiles(k, kv_slots, num_kv_tiles, tile_volume),
        pad_tiles(v, kv_slots, num_kv_tiles, tile_volume), q_block_sizes=q_block_sizes, kv_block_sizes=kv_block_sizes,
        sparsity=sparsity, gate=None if gate is None else pad_tiles(gate, q_slots, num_q_tiles, tile_volume),
        scale=scale, backend=backend)
    return unpad_tiles(out, q_slots)


def _triton_vsa(q, k, v, *, q_tiles, kv_tiles, q_rows, tile_volume, sparsity, gate, scale, fine_kernel="triton"):
    """VSA with the Triton kernels on packed ``[B, H, S, D]`` tiles: the coarse stage (tile means, scores, top-k
    and the coarse output: :mod:`.vsa_coarse_triton`), then the fine stage (``fine_kernel``: ``"triton"``,
    :mod:`.vsa_triton`, or ``"gluon"``, :mod:`.vsa_gluon`) with the gated coarse output in its epilogue.
    ``q_tiles`` and ``kv_tiles``: ``(offsets, sizes)``; ``q_rows``: the query rows of each tile to compute and
    store."""
    (q_offsets, q_sizes), (kv_offsets, kv_sizes) = [tuple(t.to(torch.int32) for t in pair)
                                                    for pair in (q_tiles, kv_tiles)]
    selected, coarse = coarse_stage_triton(
        q, k, v, q_offsets=q_offsets, q_sizes=q_sizes, kv_offsets=kv_offsets, kv_sizes=kv_sizes,
        tile_volume=tile_volume, topk=vsa_topk(kv_offsets.shape[0], sparsity), scale=scale,
        with_output=gate is not None)
    fine_stage = fine_stage_gluon_packed if fine_kernel == "gluon" else fine_stage_triton_packed
    return fine_stage(q, k, v, selected, q_offsets=q_offsets, q_sizes=q_rows.to(torch.int32), kv_offsets=kv_offsets,
                      kv_sizes=kv_sizes, tile_volume=tile_volume, scale=scale,
                      gate=None if gate is None else gate.to(q.dtype), coarse=coarse)


def auto_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """The fine-stage backend ``backend="auto"`` runs for tiled ``[B, H, N, V, D]`` tensors: the first of
    :data:`AUTO_ORDER` that applies (``"reference"`` always does)."""
    applies = {"fa4": lambda: fa4_block_sparse_applies(q, k, v) is None,
               "gluon": lambda: triton_applies(q, k, v) and gluon_preferred(  # padded tiles read as packed ones
                   *(t.flatten(2, 3) for t in (q, k, v)), q.shape[3]),
               "triton": lambda: triton_applies(q, k, v),
               "flex": lambda: flex_applies(q, k, v),
               "reference": lambda: True}
    return next(name for name in AUTO_ORDER if applies[name]())


def backend_on(backend: str, device, dtype: torch.dtype, head_dim: int, tile_volume: int) -> str:
    """The backend ``backend`` (one of :data:`BACKENDS`) resolves to for tensors on ``device`` of ``dtype`` with
    head dim ``head_dim`` and tiles of ``tile_volume`` slots, without gradient: ``backend`` itself unless it is
    ``"auto"``, else the first of :data:`AUTO_ORDER` that applies (what :func:`video_sparse_attention_packed`
    and :func:`video_sparse_attention` run). Reads a one-tile stand-in tensor, no data."""
    if backend != "auto":
        return backend
    probe = torch.empty(1, 1, 1, tile_volume, head_dim, device=device, dtype=dtype)
    with torch.no_grad():
        return auto_backend(probe, probe, probe)


def _fine_stage_reference(q, k, v, selected, kv_block_sizes, scale):
    """Fine stage in plain torch: per chunk of query tiles, gather the selected key tiles and run
    SDPA with the padded key slots masked. Returns ``[B, H, Nq, V, D]`` in q's dtype."""
    batch, heads, num_q_tiles, tile_volume, head_dim = q.shape
    topk = selected.shape[-1]
    kv_valid = _slot_mask(kv_block_sizes, tile_volume)  # [Nk, V]
    batch_index = torch.arange(batch, device=q.device).view(batch, 1, 1, 1)
    head_index = torch.arange(heads, device=q.device).view(1, heads, 1, 1)

    elements_per_q_tile = batch * heads * topk * tile_volume * (tile_volume + 2 * head_dim)
    chunk = max(1, _REFERENCE_CHUNK_ELEMENTS // elements_per_q_tile)
    outputs = []
    for start in range(0, num_q_tiles, chunk):
        chosen = selected[:, :, start:start + chunk]  # [B, H, c, topk]
        c = chosen.shape[2]
        # Gathered key tiles [B, H, c, topk, V, D] -> one key sequence per query tile.
        k_sel = k[batch_index, head_index, chosen].reshape(batch, heads * c, topk * tile_volume, head_dim)
        v_sel = v[batch_index, head_index, chosen].reshape(batch, heads * c, topk * tile_volume, head_dim)
        key_mask = kv_valid[chosen].reshape(batch, heads * c, 1, topk * tile_volume)
        q_chunk = q[:, :, start:start + c].reshape(batch, heads * c, tile_volume, head_dim)
        out = F.scaled_dot_product_attention(q_chunk, k_sel, v_sel, attn_mask=key_mask, scale=scale)
        outputs.append(out.view(batch, heads, c, tile_volume, head_dim))
    return torch.cat(outputs, dim=2)


def _tile_means(x: torch.Tensor, block_sizes: torch.Tensor) -> torch.Tensor:
    """``[B, H, N, V, D]`` with zero padded slots -> ``[B, H, N, D]`` in float32 (float64 for float64
    input): each tile's mean over its valid slots."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    return x.sum(dim=3, dtype=dtype) / block_sizes.to(dtype).unsqueeze(-1)


def _slot_mask(block_sizes: torch.Tensor, tile_volume: int) -> torch.Tensor:
    """``[N]`` block sizes -> bool ``[N, V]``, True on valid slots (the first ``block_sizes[i]``)."""
    return torch.arange(tile_volume, device=block_sizes.device) < block_sizes.unsqueeze(-1)


def _validate_packed(q, k, v, tile_volume, q_block_sizes, kv_block_sizes, gate, backend) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown VSA backend {backend!r}; choose one of {BACKENDS}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"packed VSA expects {name} of shape [B, H, S, D], got {tuple(t.shape)}")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must agree on B, H and D "
                         "([B, H, Sq, D] and [B, H, Sk, D])")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point() or not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must share one float dtype and device, got {q.dtype}, {k.dtype}, {v.dtype} on "
                         f"{q.device}, {k.device}, {v.device}")
    if int(tile_volume) < 1:
        raise ValueError(f"tile_volume must be >= 1, got {tile_volume}")
    for name, sizes, tokens in (("q_block_sizes", q_block_sizes, q.shape[2]), ("kv_block_sizes", kv_block_sizes,
                                                                                k.shape[2])):
        if sizes.dim() != 1 or sizes.is_floating_point() or sizes.is_complex() or sizes.dtype == torch.bool:
            raise ValueError(f"{name} must be a 1-D integer tensor (one entry per tile), got {sizes.dtype} "
                             f"{tuple(sizes.shape)}")
        checkable = sizes.device.type == "cpu" and not torch.compiler.is_compiling()
        if checkable and (int(sizes.sum()) != tokens or bool((sizes < 1).any())
                                           or bool((sizes > tile_volume).any())):
            raise ValueError(f"{name} must be in [1, {tile_volume}] and sum to the {tokens} tokens of the "
                             f"sequence, got sum {int(sizes.sum())}")
    if gate is not None and gate.shape != q.shape:
        raise ValueError(f"gate must have q's shape {tuple(q.shape)}, got {tuple(gate.shape)}")
    if backend == "gluon":
        _check_gluon(q, k, v, int(tile_volume))


def _validate_offsets(sizes: torch.Tensor, offsets: torch.Tensor | None, name: str) -> None:
    if offsets is None:
        return
    if offsets.shape != sizes.shape or offsets.is_floating_point() or offsets.is_complex() or \
            offsets.dtype == torch.bool or offsets.device != sizes.device:
        raise ValueError(f"{name} must be an integer tensor of the block sizes' shape {tuple(sizes.shape)} on their "
                         f"device {sizes.device}, got {offsets.dtype} {tuple(offsets.shape)} on {offsets.device}")
    if sizes.device.type == "cpu" and not torch.compiler.is_compiling() and \
            not torch.equal(offsets.to(torch.int32), packed_offsets(sizes)):
        raise ValueError(f"{name} must be the exclusive running sum of the block sizes (packed_offsets), got "
                         f"{offsets[:8].tolist()}... for sizes {sizes[:8].tolist()}...")


def _validate(q, k, v, q_block_sizes, kv_block_sizes, sparsity, gate, backend) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown VSA backend {backend!r}; choose one of {BACKENDS}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 5:
            raise ValueError(f"VSA expects tiled {name} of shape [B, H, N, V, D], got {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if q.shape[:2] != k.shape[:2] or q.shape[3:] != k.shape[3:]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on B, H, V and D "
                         "([B, H, Nq, V, D] and [B, H, Nk, V, D])")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise ValueError(f"q, k, v must share one float dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    for name, sizes, count in (("q_block_sizes", q_block_sizes, q.shape[2]),
                               ("kv_block_sizes", kv_block_sizes, k.shape[2])):
        if sizes.dim() != 1 or sizes.shape[0] != count:
            raise ValueError(f"{name} must have shape [{count}] (one entry per tile), got {tuple(sizes.shape)}")
        if sizes.is_floating_point() or sizes.is_complex() or sizes.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got {sizes.dtype}")
    _check_sparsity(sparsity)
    if gate is not None and gate.shape != q.shape:
        raise ValueError(f"gate must have q's shape {tuple(q.shape)}, got {tuple(gate.shape)}")
    if backend == "flex" and not flex_applies(q, k, v):
        dtypes = "/".join(str(d).removeprefix("torch.") for d in FLEX_DTYPES)
        raise ValueError("backend='flex' needs CUDA tensors, torch.nn.attention.flex_attention, a "
                         f"{dtypes} dtype, a tile volume V that is a multiple of 16, a head "
                         "dim >= 16 and no gradient (it is forward-only); got device "
                         f"{q.device}, {q.dtype}, V={q.shape[3]}, D={q.shape[4]}, "
                         f"requires_grad={any(t.requires_grad for t in (q, k, v))}. "
                         "Use backend='reference' or 'auto'.")
    if backend == "fa4" and fa4_block_sparse_applies(q, k, v) is not None:
        raise ValueError(f"backend='fa4': {fa4_block_sparse_applies(q, k, v)}. Use backend='triton', 'flex', "
                         "'reference' or 'auto'.")
    if backend == "triton" and not triton_applies(q, k, v):
        raise ValueError(f"backend='triton': {triton_requirements(q, k, v)}. Use backend='reference', 'flex' "
                         "or 'auto'.")
    if backend == "gluon":
        _check_gluon(q.flatten(2, 3), k.flatten(2, 3), v.flatten(2, 3), q.shape[3])


def _check_gluon(q, k, v, tile_volume) -> None:
    """``backend="gluon"`` on packed ``[B, H, S, D]`` tensors where the Gluon fine stage or the Triton coarse stage
    cannot run: a ValueError."""
    if not triton_applies(q, k, v, tile_volume):
        raise ValueError(f"backend='gluon': {triton_requirements(q, k, v, tile_volume)}. Use backend='reference', "
                         "'flex' or 'auto'.")
    if not gluon_applies(q, k, v, tile_volume):
        raise ValueError(f"backend='gluon': {gluon_requirements(q, tile_volume)}. Use backend='triton' or 'auto'.")
