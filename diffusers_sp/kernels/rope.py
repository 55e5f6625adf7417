"""RoPE on pairs of adjacent channels (Wan's rotary embedding) in one Triton kernel, bit-identical to the
model's own operations.

Rotary position embedding (J. Su et al., "RoFormer", arXiv 2104.09864) rotates each pair of channels
``(2i, 2i + 1)`` of a query or key by a per-token angle. Diffusers' ``WanAttnProcessor`` writes it as eight
PyTorch operations over strided views: four float32 products, a difference and a sum, each written to memory
at twice the input's size, and two strided copies back to the input's dtype. On a bf16 query of the Wan 1.3B
shape (32760 tokens, 12 heads x 128) that is about 1.5 GB of memory traffic where the rotation itself reads
and writes 0.2 GB; the model applies it to the queries and the keys of every block.

:func:`rope_adjacent_pairs` does it in one pass. It is the same function to the bit: every product, the
difference and the sum are rounded to float32 one by one as PyTorch's kernels round them (the kernel is
compiled with ``enable_fp_fusion=False``, so no multiply-add is contracted into a fused multiply-add,
which rounds once), and the result is rounded to the input's dtype once, to nearest even, as the strided
copy rounds it. Where the kernel does not apply (CPU, no Triton, other dtypes, autograd, ``torch.compile``,
whose Inductor fuses the same operations itself) the model's operations run.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship without Triton
    triton = None
    tl = None

#: Input dtypes the kernel takes (the tables are float32, so PyTorch computes in float32 for each).
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def rope_adjacent_pairs_reference(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding with the operations, in the order, of the function local to Diffusers'
    ``WanAttnProcessor.__call__`` (0.42): the definition :func:`rope_adjacent_pairs` is held to.

    Args:
        x: ``[B, S, H, D]`` queries or keys, D even.
        freqs_cos, freqs_sin: ``[1 or B, S, 1 or H, D]`` tables, each value repeated for the two channels of
            a pair; the cosine is read at the even channels and the sine at the odd ones.

    Returns:
        ``[B, S, H, D]`` in ``x``'s dtype: ``out[2i] = x[2i] cos[2i] - x[2i+1] sin[2i+1]``,
        ``out[2i+1] = x[2i] sin[2i+1] + x[2i+1] cos[2i]``, computed in the promoted dtype of ``x`` and the
        tables.
    """
    even, odd = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out.type_as(x)


def fused_rope_applies(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> bool:
    """Whether :func:`rope_adjacent_pairs` runs its Triton kernel on these inputs: CUDA tensors on one
    device, Triton installed, ``x`` ``[B, S, H, D]`` bf16, fp16 or float32 with D even and unit stride along
    D, float32 tables of one shape ``[1 or B, S, 1 or H, D]`` with unit stride along D, at least one and
    fewer than 2**31 elements, no autograd graph to record, and not inside ``torch.compile``."""
    if triton is None or not x.is_cuda or torch.compiler.is_compiling():
        return False
    if x.dtype not in _DTYPES or freqs_cos.dtype != torch.float32 or freqs_sin.dtype != torch.float32:
        return False
    if x.ndim != 4 or freqs_cos.shape != freqs_sin.shape or freqs_cos.ndim != 4:
        return False
    batch, seq, heads, dim = x.shape
    tb, ts, th, td = freqs_cos.shape
    if dim % 2 or td != dim or ts != seq or tb not in (1, batch) or th not in (1, heads):
        return False
    if x.stride(-1) != 1 or freqs_cos.stride(-1) != 1 or freqs_sin.stride(-1) != 1 or not 0 < x.numel() < 2**31:
        return False
    if freqs_cos.device != x.device or freqs_sin.device != x.device:
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or freqs_cos.requires_grad or freqs_sin.requires_grad))


def rope_adjacent_pairs(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding of ``x``, in one Triton kernel where :func:`fused_rope_applies`, else with the
    model's operations (:func:`rope_adjacent_pairs_reference`); the two give the same bits.

    Args:
        x: ``[B, S, H, D]`` queries or keys (bf16, fp16 or float32 for the kernel), D even.
        freqs_cos, freqs_sin: float32 ``[1 or B, S, 1 or H, D]`` tables (Wan's ``rotary_emb``), each value
            repeated for the two channels of a pair.

    Returns:
        A new ``[B, S, H, D]`` tensor in ``x``'s dtype: contiguous from the kernel, laid out as ``x`` (as
        ``torch.empty_like`` lays it out) from the model's operations.
    """
    if not fused_rope_applies(x, freqs_cos, freqs_sin):
        return rope_adjacent_pairs_reference(x, freqs_cos, freqs_sin)
    return _rope_triton(x, freqs_cos, freqs_sin)


#: Rows ``(b, s, h)`` of ``D`` channels per program: 32 rows of 128 bf16 channels are 8 KiB read and written.
_ROWS = 32


def _rope_triton(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor, *,
                 fp_fusion: bool = False, rows_per_program: int = _ROWS, num_warps: int = 4) -> torch.Tensor:
    """Launches :func:`_rope_pairs_kernel` (``fp_fusion=True`` only to show, in a test, that contraction changes
    bits; the launch configuration is a parameter for ``benchmarks/bench_rope.py --sweep``)."""
    batch, seq, heads, dim = x.shape
    out = torch.empty((batch, seq, heads, dim), dtype=x.dtype, device=x.device)
    rows = batch * seq * heads
    grid = (triton.cdiv(rows, rows_per_program),)
    extra = {} if _interpreting() else {"enable_fp_fusion": fp_fusion}
    _rope_pairs_kernel[grid](
        x, freqs_cos, freqs_sin, out, rows, seq, heads,
        x.stride(0), x.stride(1), x.stride(2), *_table_strides(freqs_cos), *_table_strides(freqs_sin),
        HALF=dim // 2, PAIRS=triton.next_power_of_2(dim // 2), ROWS=rows_per_program, num_warps=num_warps,
        **extra)
    return out


def _table_strides(table: torch.Tensor) -> list[int]:
    """Strides of a table's first three dimensions, 0 for one of size 1 (broadcast over B or H)."""
    return [table.stride(i) if table.shape[i] > 1 else 0 for i in range(3)]


def _interpreting() -> bool:
    """Whether Triton runs its interpreter (``TRITON_INTERPRET=1``), which takes no compile options."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


if triton is not None:

    @triton.jit
    def _rope_pairs_kernel(X, Cos, Sin, Out, rows, seq, heads,
                           sxb, sxs, sxh, scb, scs, sch, ssb, sss, ssh,
                           HALF: tl.constexpr, PAIRS: tl.constexpr, ROWS: tl.constexpr):
        """One program rotates ``ROWS`` rows ``(b, s, h)`` (flattened in that order) of ``2 * HALF`` channels.
        ``Out`` is contiguous ``[B, S, H, 2 * HALF]``; the others are read through their strides (channels at
        unit stride). Rows are loaded whole and their pairs split in registers, so loads and stores run
        along the channels."""
        row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        head = row % heads
        tok = (row // heads) % seq
        b = row // (heads * seq)
        chan = tl.arange(0, 2 * PAIRS)
        mask = (row < rows)[:, None] & (chan < 2 * HALF)[None, :]
        x_row = (b * sxb + tok * sxs + head * sxh)[:, None]
        x = tl.load(X + x_row + chan[None, :], mask=mask, other=0.0).to(tl.float32)
        cos = tl.load(Cos + (b * scb + tok * scs + head * sch)[:, None] + chan[None, :], mask=mask, other=0.0)
        sin = tl.load(Sin + (b * ssb + tok * sss + head * ssh)[:, None] + chan[None, :], mask=mask, other=0.0)
        # [ROWS, PAIRS, 2]: the two channels of a pair in the last dimension, split into one tensor each.
        x = tl.reshape(x, (ROWS, PAIRS, 2))
        cos = tl.reshape(cos, (ROWS, PAIRS, 2))
        sin = tl.reshape(sin, (ROWS, PAIRS, 2))
        even, odd = tl.split(x)  # [ROWS, PAIRS] each
        cos_even, _ = tl.split(cos)  # the cosine of the even channel, the sine of the odd one, as the model reads them
        _, sin_odd = tl.split(sin)
        # Each product, then the difference and the sum, rounded to float32 one by one (no contraction:
        # enable_fp_fusion=False at launch), as PyTorch's separate kernels round them.
        out_even = even * cos_even - odd * sin_odd
        out_odd = even * sin_odd + odd * cos_even
        out = tl.reshape(tl.join(out_even, out_odd), (ROWS, 2 * PAIRS))  # pairs back in channel order
        tl.store(Out + (row * (2 * HALF))[:, None] + chan[None, :], out.to(Out.dtype.element_ty), mask=mask)
