"""The local (per-rank) dense attention kernel and how it is chosen.

Every strategy ends in one call of :func:`local_attention` on the tensors a rank holds after its
communication. :func:`choose_kernel` picks the kernel for those tensors:

* FlashAttention-4 (:mod:`diffusers_sp.kernels.fa4`) where it is installed and applies (CUDA sm90 /
  sm100, bfloat16 or float16, a head dim it supports); boolean key padding masks go through its varlen
  entry. On an H200 it ran the Wan per-rank shapes 1.17-1.23x faster than cuDNN (benchmarks/RESULTS.md).
* FlashAttention-3 / -2 (``flash_attn_interface`` / ``flash_attn``) when asked for, or FA3 under
  ``"auto"`` where FA4 is absent; unmasked inputs only, FA3 on Hopper, FA2 on sm80-sm90.
* ``torch.nn.functional.scaled_dot_product_attention`` otherwise, with cuDNN first on CUDA (on H100/H200
  at DiT shapes it measured ~590 TFLOP/s against ~360 for SDPA's flash backend). Float masks, masks
  that vary over heads or queries, float32 and CPU tensors always run here.

Under ``torch.compile`` the choice is made while tracing (the installed packages and the device's
capability enter the graph as constants) and FA4 runs as a custom operator, so compiled regions keep
it with no graph break. FA3/FA2 and compiled regions that need gradients run SDPA.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import fa4

KERNELS = ("auto", "sdpa", "flash_attn")
# Names of the kernels that run (KernelChoice.name).
RUNNING_KERNELS = ("flash_attn_4", "flash_attn_3", "flash_attn_2", "sdpa")

logger = logging.getLogger(__name__)

# cuDNN first (fastest on Hopper), then flash, memory-efficient, math: SDPA takes the first that
# accepts the inputs, so masks and odd head dims still run.
_CUDA_PRIORITY = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                  SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(frozen=True)
class KernelChoice:
    """The kernel that runs one attention call and why.

    Attributes:
        name: One of ``"flash_attn_4"``, ``"flash_attn_3"``, ``"flash_attn_2"``, ``"sdpa"``.
        reason: Why a faster kernel does not run (empty when the asked-for or fastest one runs), or how a
            mask is handled (``"key padding mask through FA4's varlen entry"``).
    """

    name: str
    reason: str = ""


@functools.lru_cache(maxsize=None)
def _legacy_flash_attn():
    """``(flash_attn_func, name)`` of FlashAttention-3 (``flash_attn_interface``, Hopper) or -2
    (``flash_attn``, whose ``flash_attn_func`` is not FA4's ``flash_attn.cute``), or None."""
    try:
        from flash_attn_interface import flash_attn_func  # FlashAttention-3
        return flash_attn_func, "flash_attn_3"
    except ImportError:
        pass
    try:
        from flash_attn import flash_attn_func  # FlashAttention-2
        return flash_attn_func, "flash_attn_2"
    except ImportError:
        return None


@functools.lru_cache(maxsize=None)
def choose_kernel(requested: str, *, device_type: str, capability: tuple[int, int] | None, dtype: torch.dtype,
                  head_dim: int, mask: str | None, fa4_installed: bool, legacy_flash: str | None,
                  compiling: bool = False, needs_grad: bool = False) -> KernelChoice:
    """Which kernel runs an attention call (pure: no device or import is touched).

    Args:
        requested: ``"auto"`` (FA4 where it applies, else FA3 where installed and unmasked, else SDPA),
            ``"sdpa"`` or ``"flash_attn"`` (FA4, else an installed FA3/FA2 for unmasked inputs, else SDPA;
            the fallback's reason is logged once).
        device_type: ``q.device.type``.
        capability: CUDA compute capability ``(major, minor)``, None off CUDA.
        dtype: q's dtype.
        head_dim: ``D``.
        mask: None (no mask), ``"key_padding"`` (boolean, the same for every head and query; see
            :func:`diffusers_sp.kernels.fa4.key_padding_rows`) or ``"other"``.
        fa4_installed: Whether ``flash_attn.cute`` imports.
        legacy_flash: ``"flash_attn_3"`` / ``"flash_attn_2"`` when that package is installed, else None.
        compiling: Whether the call is being traced by ``torch.compile``: FA4 then runs as the forward-only
            custom operators of :mod:`diffusers_sp.kernels.fa4`; FA3/FA2 run only eagerly.
        needs_grad: Whether a gradient flows through the call; with ``compiling`` it rules FA4 out (its
            operators have no backward).

    Returns:
        The :class:`KernelChoice`.

    Raises:
        ValueError: ``requested`` is not one of :data:`KERNELS`.
    """
    if requested not in KERNELS:
        raise ValueError(f"unknown attention kernel {requested!r}; choose one of {KERNELS}")
    if requested == "sdpa":
        return KernelChoice("sdpa")
    reason = fa4.fa4_unsupported_reason(device_type, capability, dtype, head_dim, installed=fa4_installed)
    if reason is None and compiling and needs_grad:
        reason = "inside torch.compile with gradients, and FlashAttention-4's operators here are forward-only"
    if reason is None and mask == "other":
        reason = "the mask is not a boolean key padding mask (FlashAttention-4 takes those through varlen)"
    if reason is None:
        return KernelChoice("flash_attn_4", "key padding mask through FA4's varlen entry" if mask else "")
    # FA3's kernels are Hopper's (sm90) only; FA2's run on Ampere, Ada and Hopper (sm80-sm90).
    arch = capability[0] if capability is not None else None
    legacy_arch_ok = arch == 9 if legacy_flash == "flash_attn_3" else arch in (8, 9)
    legacy_fits = (legacy_flash is not None and legacy_arch_ok and mask is None and device_type == "cuda"
                   and not compiling and dtype in fa4.FA4_DTYPES and head_dim <= 256 and head_dim % 8 == 0)
    if legacy_fits and (requested == "flash_attn" or legacy_flash == "flash_attn_3"
                        or (capability is not None and capability[0] < 9)):
        # Under "auto", FA2 runs only before Hopper: on Hopper SDPA's cuDNN backend is faster than FA2.
        return KernelChoice(legacy_flash, reason)
    return KernelChoice("sdpa", reason)


def mask_kind(attn_mask: torch.Tensor | None, batch: int, num_keys: int) -> str | None:
    """None, ``"key_padding"`` or ``"other"``: how :func:`choose_kernel` sees an attention mask."""
    if attn_mask is None:
        return None
    return "key_padding" if fa4.key_padding_rows(attn_mask, batch, num_keys) is not None else "other"


# torch.compile calls this once per traced call site and keeps the answer as a constant of the graph:
# the package imports and the CUDA capability query behind it do not trace.
@torch.compiler.assume_constant_result
def kernel_on(requested: str, device: torch.device, dtype: torch.dtype, head_dim: int, mask: str | None = None,
              compiling: bool = False, needs_grad: bool = False) -> KernelChoice:
    """:func:`choose_kernel` for a device, with the installed packages and the device's capability looked up."""
    legacy = _legacy_flash_attn()
    return choose_kernel(requested, device_type=device.type, capability=fa4.device_capability(device), dtype=dtype,
                         head_dim=head_dim, mask=mask, fa4_installed=fa4.fa4_installed(),
                         legacy_flash=None if legacy is None else legacy[1], compiling=compiling,
                         needs_grad=needs_grad)


def kernel_for(q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None, requested: str) -> KernelChoice:
    """:func:`choose_kernel` for actual tensors: ``q`` ``[B, H, Sq, D]``, ``k`` ``[B, H, Sk, D]`` and a mask."""
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
    return kernel_on(requested, q.device, q.dtype, int(q.shape[-1]), mask_kind(attn_mask, q.shape[0], k.shape[2]),
                     compiling=torch.compiler.is_compiling(), needs_grad=needs_grad)


@functools.lru_cache(maxsize=None)
def _log_fallback(requested: str, choice: KernelChoice) -> None:
    logger.warning("attention_kernel=%r runs %s: %s", requested, choice.name, choice.reason)


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attn_mask: torch.Tensor | None = None,
                    scale: float | None = None, kernel: str = "auto") -> torch.Tensor:
    """Dense softmax attention on one rank, with the kernel :func:`choose_kernel` picks.

    Args:
        q: Queries ``[B, H, Sq, D]`` (any strides with a contiguous last dim), float32/float16/bfloat16.
        k: Keys ``[B, H, Sk, D]``, same dtype and device.
        v: Values ``[B, H, Sk, D]``.
        attn_mask: None, or a boolean (True = attend) or additive float mask broadcastable to
            ``[B, H, Sq, Sk]``.
        scale: Softmax scale; ``None`` means ``1 / sqrt(D)``.
        kernel: ``"auto"``, ``"sdpa"`` or ``"flash_attn"`` (see :func:`choose_kernel`).

    Returns:
        ``[B, H, Sq, D]`` in q's dtype.

    Raises:
        ValueError: unknown ``kernel``; RuntimeError from the kernel for unsupported inputs.
    """
    if kernel not in KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; choose one of {KERNELS}")
    choice = kernel_for(q, k, attn_mask, kernel)
    if kernel == "flash_attn" and choice.reason and choice.name == "sdpa" and not torch.compiler.is_compiling():
        _log_fallback(kernel, choice)
    if choice.name == "flash_attn_4":
        if attn_mask is None:
            return fa4.fa4_attention(q, k, v, scale=scale)
        rows = fa4.key_padding_rows(attn_mask, q.shape[0], k.shape[2])
        return fa4.fa4_key_padding_attention(q, k, v, rows, scale=scale)
    if choice.name in ("flash_attn_3", "flash_attn_2"):
        out = _legacy_flash_attn()[0](q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale)
        out = out[0] if isinstance(out, tuple) else out
        return out.transpose(1, 2)
    return _sdpa(q, k, v, attn_mask, scale)


def _sdpa(q, k, v, attn_mask, scale):
    """SDPA, with cuDNN first on CUDA."""
    if q.is_cuda:
        with sdpa_kernel(_CUDA_PRIORITY, set_priority=True):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
