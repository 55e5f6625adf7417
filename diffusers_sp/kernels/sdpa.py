"""The local (per-rank) dense attention kernel.

Every strategy ends in one call of :func:`local_attention` on the tensors a rank holds after its
communication. The kernel is ``torch.nn.functional.scaled_dot_product_attention`` with the backend
priority set for speed on CUDA (cuDNN first: on H100/H200 at DiT shapes it measured ~590 TFLOP/s
against ~360 for SDPA's flash backend), or flash-attn when it is installed and applies.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

KERNELS = ("auto", "sdpa", "flash_attn")

# cuDNN first (fastest on Hopper), then flash, memory-efficient, math: SDPA takes the first that
# accepts the inputs, so masks and odd head dims still run.
_CUDA_PRIORITY = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                  SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@functools.lru_cache(maxsize=None)
def _flash_attn_func():
    """flash-attn's ``flash_attn_func`` (FA3's ``flash_attn_interface`` first), or None if not installed."""
    try:
        from flash_attn_interface import flash_attn_func  # FlashAttention-3 (Hopper)
        return flash_attn_func
    except ImportError:
        pass
    try:
        from flash_attn import flash_attn_func  # FlashAttention-2
        return flash_attn_func
    except ImportError:
        return None


@functools.lru_cache(maxsize=None)
def _is_hopper_or_newer(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def _use_flash_attn(q: torch.Tensor, attn_mask, kernel: str) -> bool:
    if kernel == "sdpa" or attn_mask is not None or not q.is_cuda:
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] > 256:
        return False
    fn = _flash_attn_func()
    if fn is None:
        return False
    if kernel == "flash_attn":
        return True
    # auto: FlashAttention-2 is slower than SDPA's cuDNN backend on Hopper; FA3 is not.
    return fn.__module__.startswith("flash_attn_interface") or not _is_hopper_or_newer(q.device.index or 0)


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attn_mask: torch.Tensor | None = None,
                    scale: float | None = None, kernel: str = "auto") -> torch.Tensor:
    """Dense softmax attention on one rank.

    Args:
        q: Queries ``[B, H, Sq, D]`` (any strides with a contiguous last dim), float32/float16/bfloat16.
        k: Keys ``[B, H, Sk, D]``, same dtype and device.
        v: Values ``[B, H, Sk, D]``.
        attn_mask: None, or a boolean (True = attend) or additive float mask broadcastable to
            ``[B, H, Sq, Sk]``.
        scale: Softmax scale; ``None`` means ``1 / sqrt(D)``.
        kernel: ``"auto"`` (flash-attn when installed and it is the faster choice for the device,
            else SDPA with cuDNN first on CUDA), ``"sdpa"`` or ``"flash_attn"``.

    Returns:
        ``[B, H, Sq, D]`` in q's dtype.

    Raises:
        ValueError: unknown ``kernel``; RuntimeError from SDPA for unsupported inputs.
    """
    if kernel not in KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; choose one of {KERNELS}")
    if _use_flash_attn(q, attn_mask, kernel):
        out = _flash_attn_func()(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale)
        out = out[0] if isinstance(out, tuple) else out
        return out.transpose(1, 2)
    if q.is_cuda:
        with sdpa_kernel(_CUDA_PRIORITY, set_priority=True):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
