"""FlashAttention-4 as the local kernel: dense, key-padding masks (varlen) and VSA's block-sparse fine stage.

FlashAttention-4 (PyPI ``flash-attn-4``, import ``flash_attn.cute``; T. Dao et al.,
https://github.com/Dao-AILab/flash-attention) is a set of CuTe DSL kernels with a Hopper (sm90) and a
Blackwell (sm100/sm110) forward pass. On an H200 it ran the per-rank attention shapes of the Wan
benchmarks 1.17-1.23x faster than cuDNN SDPA (benchmarks/RESULTS.md). This module wraps its three
entries the project uses:

* :func:`fa4_attention`: dense attention, ``flash_attn_func``;
* :func:`fa4_key_padding_attention`: a boolean key padding mask, through ``flash_attn_varlen_func``
  with the valid keys of each batch row packed (ragged text, padded prompts);
* :func:`fa4_block_sparse_fine_stage`: VSA's fine stage (arXiv 2505.13389) with FA4's block sparsity,
  one block per 64-slot tile: whole key tiles are "full" blocks, partial edge tiles "mask" blocks
  whose padded slots a ``mask_mod`` removes, so the result is exact.

Whether FA4 applies is decided by :func:`fa4_unsupported_reason` (pure, testable without a GPU).

Inside ``torch.compile`` the three entries run as PyTorch custom operators (``torch.library.custom_op``,
namespace ``diffusers_sp``): the CuTe DSL kernels compile themselves at their first call and cannot be
traced, so each entry is one opaque node of the graph, with a fake implementation that gives the
output's shape, dtype and strides (Diffusers wraps its FlashAttention-3 hub kernel the same way). Eager
calls skip the operator's dispatch and call FA4 directly. The operators are forward-only: a compiled
region that needs gradients runs SDPA instead (see :func:`diffusers_sp.kernels.sdpa.choose_kernel`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

FA4_DTYPES = (torch.bfloat16, torch.float16)
# FA4's compute capabilities with a forward kernel: Hopper (9.x) and Blackwell data centre (10.x, 11.x).
FA4_ARCHS = (9, 10, 11)
# Padded key slots get this threshold in the mask_mod's table: no key index reaches it.
_NEVER = 1 << 30


@functools.lru_cache(maxsize=None)
def fa4_functions():
    """``(flash_attn_func, flash_attn_varlen_func)`` of ``flash_attn.cute``, or None if FA4 is not installed.

    Any import error (the package missing, or its CuTe DSL runtime unable to load, e.g. on a machine
    without CUDA) counts as not installed.
    """
    try:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    except Exception:  # noqa: BLE001 - ImportError, or the DSL's own errors when CUDA is missing
        return None
    return flash_attn_func, flash_attn_varlen_func


@torch.compiler.assume_constant_result  # a constant while torch.compile traces (the import does not trace)
def fa4_installed() -> bool:
    """Whether ``flash_attn.cute`` imports here."""
    return fa4_functions() is not None


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


# torch.compile evaluates this once while tracing and keeps the answer as a constant (the CUDA query
# itself does not trace).
@torch.compiler.assume_constant_result
def device_capability(device: torch.device) -> tuple[int, int] | None:
    """``(major, minor)`` of a CUDA device, None for any other device."""
    if device.type != "cuda":
        return None
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def fa4_unsupported_reason(device_type: str, capability: tuple[int, int] | None, dtype: torch.dtype,
                           head_dim: int, *, installed: bool) -> str | None:
    """Why FA4 cannot run attention with these inputs, or None when it can.

    Args:
        device_type: ``"cuda"``, ``"cpu"``, ...
        capability: The CUDA compute capability ``(major, minor)``; None off CUDA.
        dtype: The dtype of q, k and v.
        head_dim: ``D`` of q, k and v (FA4 here always has ``head_dim_v == head_dim``).
        installed: Whether ``flash_attn.cute`` imports (:func:`fa4_installed`).

    Returns:
        A short reason for a log line, or None. The head-dim limits are FA4's own: on sm90 ``8 <= D <= 256``;
        on sm100/sm110 ``8 <= D <= 128`` or ``D == 256``; ``D`` a multiple of 8 (16 bytes of bf16/fp16).
    """
    if not installed:
        return "flash-attn-4 is not installed (pip install 'diffusers-sp[flash]' on a CUDA machine)"
    if device_type != "cuda":
        return f"FlashAttention-4 runs on CUDA only (tensors on {device_type})"
    if capability is None or capability[0] not in FA4_ARCHS:
        return f"FlashAttention-4 has kernels for sm90/sm100/sm110 only (this GPU is sm{''.join(map(str, capability or ()))})"
    if dtype not in FA4_DTYPES:
        return f"FlashAttention-4 takes bfloat16 or float16 (got {str(dtype).removeprefix('torch.')})"
    if head_dim % 8:
        return f"FlashAttention-4 needs a head dim that is a multiple of 8 (got {head_dim})"
    if capability[0] == 9:
        fits = 8 <= head_dim <= 256
    else:
        fits = 8 <= head_dim <= 128 or head_dim == 256
    if not fits:
        return f"head dim {head_dim} is outside FlashAttention-4's range on sm{capability[0]}{capability[1]}"
    return None


def key_padding_rows(attn_mask: torch.Tensor | None, batch: int, num_keys: int) -> torch.Tensor | None:
    """The ``[B, Sk]`` boolean key padding mask inside an attention mask, or None if it is not one.

    A key padding mask is boolean and the same for every head and query: shape ``[B, 1, 1, Sk]`` or
    ``[1, 1, 1, Sk]``, or ``[1, Sk]`` / ``[Sk]`` (SDPA reads a 2-D mask as ``[Sq, Sk]``, so a 2-D mask
    is one only with a single row). Float (additive) masks and masks that vary over heads or queries
    return None: only SDPA runs those.
    """
    if attn_mask is None or attn_mask.dtype != torch.bool or attn_mask.shape[-1] != num_keys:
        return None
    mask = attn_mask
    if mask.dim() == 4:
        if mask.shape[1] != 1 or mask.shape[2] != 1 or mask.shape[0] not in (1, batch):
            return None
        mask = mask[:, 0, 0]
    elif mask.dim() in (1, 2):
        if mask.dim() == 2 and mask.shape[0] != 1:
            return None
        mask = mask.reshape(1, num_keys)
    else:
        return None
    return mask.expand(batch, num_keys)


def fa4_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
    """Dense (unmasked, non-causal) attention with FA4's ``flash_attn_func`` (under ``torch.compile``:
    the custom operator ``torch.ops.diffusers_sp.fa4_attention``).

    Args:
        q: ``[B, H, Sq, D]`` bfloat16/float16 on a CUDA device FA4 supports (see :func:`fa4_unsupported_reason`).
        k, v: ``[B, H, Sk, D]``, same dtype and device.
        scale: Softmax scale; None means ``1 / sqrt(D)``.

    Returns:
        ``[B, H, Sq, D]`` (a transposed view of FA4's ``[B, Sq, H, D]`` output), q's dtype.

    Raises:
        RuntimeError: FA4 is not installed; FA4's own errors for inputs it cannot run.
    """
    dense = torch.ops.diffusers_sp.fa4_attention if torch.compiler.is_compiling() else _dense
    return dense(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale).transpose(1, 2)


def fa4_key_padding_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor, *,
                              scale: float | None = None) -> torch.Tensor:
    """Attention over the valid keys only, through FA4's varlen entry.

    The valid keys of each batch row are packed one after another (``cu_seqlens_k`` from the mask's
    row sums); every query row of batch ``b`` attends to batch ``b``'s valid keys, which is what SDPA
    computes with the boolean mask broadcast over heads and queries. Packing reads the mask's valid
    count on the host (one synchronisation per call).

    Args:
        q: ``[B, H, Sq, D]`` bfloat16/float16 (CUDA, FA4-supported).
        k, v: ``[B, H, Sk, D]``.
        key_mask: Boolean ``[B, Sk]``, True for a key that is attended (see :func:`key_padding_rows`).
        scale: Softmax scale; None means ``1 / sqrt(D)``.

    Returns:
        ``[B, H, Sq, D]`` in q's dtype. A batch row with no valid key gets zeros (SDPA gives NaN there).

    Under ``torch.compile`` this is the custom operator ``torch.ops.diffusers_sp.fa4_key_padding_attention``
    (packing inside it, so the data-dependent sizes never enter the graph).
    """
    padded = torch.ops.diffusers_sp.fa4_key_padding_attention if torch.compiler.is_compiling() else _key_padding
    return padded(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), key_mask, scale).transpose(1, 2)


def fa4_block_sparse_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why VSA's fine stage cannot run on FA4's block-sparse kernel, or None when it can.

    ``q``, ``k``, ``v`` are tiled ``[B, H, N, V, D]``. Beyond :func:`fa4_unsupported_reason`: the tile
    volume ``V`` must be 64 or 128 (FA4's sm90 block-sparse forward runs 64-row query tiles and a key tile,
    at most 128, equal to the sparse block), FA4's block sparsity is forward-only here, and Blackwell's
    block-sparse tile sizes are not the 64 x 64 blocks this path builds.
    """
    reason = fa4_unsupported_reason(q.device.type, device_capability(q.device), q.dtype, q.shape[-1],
                                    installed=fa4_installed())
    if reason is not None:
        return reason
    capability = device_capability(q.device)
    if capability is None or capability[0] != 9:
        return "the block-sparse VSA path is built for Hopper (sm90)"
    if q.shape[3] % 64 or q.shape[3] > 128:
        # The sparse block must equal the forward's key tile, at most 128 on sm90 (FA4 raises "Block sparsity
        # requires sparse_block_size[1]=256 to match tile_n=128" for a 256-slot tile).
        return f"the tile volume V={q.shape[3]} is not 64 or 128"
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return "the block-sparse path is forward-only"
    return None


def fa4_block_sparse_fine_stage(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selected: torch.Tensor,
                                kv_block_sizes: torch.Tensor, scale: float) -> torch.Tensor:
    """VSA's fine stage on FA4's block-sparse forward: each query tile attends to the valid tokens of
    its selected key tiles.

    Args:
        q: Tiled queries ``[B, H, Nq, V, D]``, bfloat16/float16, CUDA sm90, ``V % 64 == 0``.
        k, v: Tiled keys and values ``[B, H, Nk, V, D]``.
        selected: ``[B, H, Nq, topk]`` distinct key-tile indices per query tile (any order).
        kv_block_sizes: LongTensor ``[Nk]``, valid slots of each key tile (the first ones).
        scale: Softmax scale.

    Returns:
        ``[B, H, Nq, V, D]`` in q's dtype; rows of padded query slots hold unspecified values (the caller
        zeroes them).

    One sparse block is one tile (``V x V``). A selected key tile with ``V`` valid slots is a full block
    (no mask evaluated); a partial one is a mask block, where :func:`_valid_key_slot_mask_mod` reads a
    per-slot threshold table and removes the padded slots, so the softmax is over valid keys only.
    Under ``torch.compile`` this is the custom operator ``torch.ops.diffusers_sp.fa4_block_sparse_fine_stage``.
    """
    fine = torch.ops.diffusers_sp.fa4_block_sparse_fine_stage if torch.compiler.is_compiling() else _block_sparse
    return fine(q, k, v, selected, kv_block_sizes, scale)


@functools.lru_cache(maxsize=None)
def _valid_key_slot_mask_mod():
    """The CuTe DSL ``mask_mod`` of the partial key tiles: key slot ``n`` is kept when ``n >= threshold[n]``,
    with ``threshold`` 0 on valid slots and 2**30 on padded ones (a table lookup, FA4's ``aux_tensors``).

    Built once (FA4 caches compiled kernels by the mask_mod's identity)."""
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute import utils

    @cute.jit
    def valid_key_slot(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
        threshold = aux_tensors[0]
        return kv_idx >= utils.scalar_to_ssa(threshold[kv_idx[0]], cutlass.Int32)

    return valid_key_slot


def _require():
    functions = fa4_functions()
    if functions is None:
        raise RuntimeError("FlashAttention-4 (flash_attn.cute) is not installed")
    return functions


# ---------------------------------------------------------------- the kernels, and their custom operators
# Layouts inside the operators are FA4's: q [B, Sq, H, D], k and v [B, Sk, H, D], outputs [B, Sq, H, D]
# as FA4 returns them (fresh tensors: an operator's output may not alias its inputs).


def _dense(q, k, v, scale):
    out = _require()[0](q, k, v, softmax_scale=scale)
    return out[0] if isinstance(out, tuple) else out


def _key_padding(q, k, v, key_mask, scale):
    """Packs the valid keys of each batch row (``cu_seqlens_k`` from the mask's row sums; one host
    synchronisation) and runs FA4's varlen entry; ``[B, Sq, H, D]``."""
    batch, seq_q, heads, head_dim = q.shape
    seq_k = k.shape[1]
    counts = key_mask.sum(dim=1, dtype=torch.int32)
    cu_k = F.pad(counts.cumsum(0, dtype=torch.int32), (1, 0))
    cu_q = torch.arange(0, (batch + 1) * seq_q, seq_q, dtype=torch.int32, device=q.device)
    keep = key_mask.reshape(-1).nonzero().squeeze(1)
    k_packed = k.reshape(batch * seq_k, heads, head_dim).index_select(0, keep)
    v_packed = v.reshape(batch * seq_k, heads, v.shape[-1]).index_select(0, keep)
    out = _require()[1](q.reshape(batch * seq_q, heads, head_dim), k_packed, v_packed,
                        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=seq_q, max_seqlen_k=seq_k,
                        softmax_scale=scale)
    out = out[0] if isinstance(out, tuple) else out
    return out.view(batch, seq_q, heads, v.shape[-1])


def _block_sparse(q, k, v, selected, kv_block_sizes, scale):
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    from .tiles import block_lists

    batch, heads, num_q_tiles, tile_volume, head_dim = q.shape
    num_kv_tiles = k.shape[2]
    whole = (kv_block_sizes == tile_volume)[selected]  # [B, H, Nq, topk]
    full_count, full_index = block_lists(selected, whole, num_kv_tiles)
    mask_count, mask_index = block_lists(selected, ~whole, num_kv_tiles)
    sparse = BlockSparseTensorsTorch(mask_block_cnt=mask_count, mask_block_idx=mask_index,
                                     full_block_cnt=full_count, full_block_idx=full_index,
                                     block_size=(tile_volume, tile_volume))
    slot = torch.arange(tile_volume, device=q.device)
    threshold = torch.where(slot < kv_block_sizes.unsqueeze(-1), 0, _NEVER).to(torch.int32).reshape(-1)
    func = _require()[0]
    out = func(q.reshape(batch, heads, num_q_tiles * tile_volume, head_dim).transpose(1, 2),
               k.reshape(batch, heads, num_kv_tiles * tile_volume, head_dim).transpose(1, 2),
               v.reshape(batch, heads, num_kv_tiles * tile_volume, head_dim).transpose(1, 2),
               softmax_scale=scale, mask_mod=_valid_key_slot_mask_mod(), aux_tensors=[threshold],
               block_sparse_tensors=sparse)
    out = out[0] if isinstance(out, tuple) else out
    return _block_sparse_layout(out, q.shape)


def _block_sparse_layout(out: torch.Tensor, shape) -> torch.Tensor:
    """FA4's ``[B, Nq * V, H, D]`` output seen as ``[B, H, Nq, V, D]`` (a view, no copy)."""
    batch, heads, num_q_tiles, tile_volume, head_dim = shape
    return out.view(batch, num_q_tiles, tile_volume, heads, head_dim).permute(0, 3, 1, 2, 4)


@torch.library.custom_op("diffusers_sp::fa4_attention", mutates_args=())
def _fa4_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    return _dense(q, k, v, scale)


@_fa4_attention_op.register_fake
def _(q, k, v, scale):
    return q.new_empty(q.shape[:-1] + v.shape[-1:])


@torch.library.custom_op("diffusers_sp::fa4_key_padding_attention", mutates_args=())
def _fa4_key_padding_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor,
                        scale: float | None) -> torch.Tensor:
    return _key_padding(q, k, v, key_mask, scale)


@_fa4_key_padding_op.register_fake
def _(q, k, v, key_mask, scale):
    return q.new_empty(q.shape[:-1] + v.shape[-1:])


@torch.library.custom_op("diffusers_sp::fa4_block_sparse_fine_stage", mutates_args=())
def _fa4_block_sparse_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selected: torch.Tensor,
                         kv_block_sizes: torch.Tensor, scale: float) -> torch.Tensor:
    return _block_sparse(q, k, v, selected, kv_block_sizes, scale)


@_fa4_block_sparse_op.register_fake
def _(q, k, v, selected, kv_block_sizes, scale):
    batch, heads, num_q_tiles, tile_volume, head_dim = q.shape
    flat = q.new_empty(batch, num_q_tiles * tile_volume, heads, head_dim)
    return _block_sparse_layout(flat, q.shape)
