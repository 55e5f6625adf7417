"""Tests of the RoPE kernel (diffusers_sp.kernels.rope): bit-identical to the model's operations.

On the GPU the kernel runs compiled and must equal Diffusers' operations bit for bit in every dtype. Where
Triton is importable without a GPU, its interpreter (``TRITON_INTERPRET=1``, in a subprocess: it must be set
before the kernel is defined) runs it on CPU tensors: float32 and float16 to the bit; bf16 within one unit in
the last place, since the interpreter rounds float32 to bf16 by truncation where the GPU rounds to nearest even.
"""

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from unittest import mock

import pytest
import torch

from diffusers_sp.kernels.rope import fused_rope_applies, rope_adjacent_pairs, rope_adjacent_pairs_reference

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only: the kernel needs CUDA and Triton")


def _tables(batch, seq, heads, dim, *, per_batch=False, per_head=False, seed=0, device="cpu", repeated=False):
    """Float32 tables ``[1 or B, S, 1 or H, D]``. ``repeated``: Wan's, each angle repeated for the two channels
    of a pair; else every channel its own value, so that reading the other channel of a pair shows."""
    gen = torch.Generator().manual_seed(seed)
    shape = (batch if per_batch else 1, seq, heads if per_head else 1, dim // 2 if repeated else dim)
    angles = torch.randn(shape, generator=gen, dtype=torch.float64) * 20
    cos, sin = angles.cos(), angles.sin()
    if repeated:
        cos, sin = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
    return cos.float().to(device), sin.float().to(device)


def _inputs(batch, seq, heads, dim, dtype, *, seed=0, device="cpu"):
    """``[B, S, H, D]`` values over many magnitudes (1e-6 to 1e4), so that the products round in every way."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, heads, dim, generator=gen) * 10 ** (torch.rand(batch, seq, heads, dim, generator=gen) * 10 - 6)
    return x.to(dtype).to(device)


#: (B, S, H, D, tables per batch, tables per head): partial blocks of rows, a D that is no power of two, tables
#: given per batch entry and per head.
SHAPES = [(1, 37, 3, 16, False, False), (2, 5, 2, 10, False, False), (1, 64, 12, 128, False, False),
          (2, 9, 5, 6, True, False), (3, 7, 4, 8, True, True), (1, 1, 1, 2, False, False)]


def test_reference_is_the_rotation_of_adjacent_pairs():
    """The reference rotates each pair (2i, 2i + 1) by the angle its tables hold (float64 check)."""
    x = _inputs(2, 5, 3, 8, torch.float64)
    cos, sin = _tables(2, 5, 3, 8, per_batch=True, per_head=True, repeated=True)
    out = rope_adjacent_pairs_reference(x, cos.double(), sin.double())
    pairs = torch.complex(x[..., 0::2], x[..., 1::2]) * torch.complex(cos[..., 0::2].double(), sin[..., 1::2].double())
    assert torch.allclose(out[..., 0::2], pairs.real) and torch.allclose(out[..., 1::2], pairs.imag)


def test_cpu_runs_the_reference():
    """On CPU tensors the kernel does not apply, and the function is the reference (the same bits)."""
    x = _inputs(1, 6, 2, 8, torch.bfloat16)
    cos, sin = _tables(1, 6, 2, 8)
    assert not fused_rope_applies(x, cos, sin)
    assert torch.equal(rope_adjacent_pairs(x, cos, sin), rope_adjacent_pairs_reference(x, cos, sin))


_INTERPRETED = textwrap.dedent("""
    import torch
    from diffusers_sp.kernels.rope import _rope_triton, rope_adjacent_pairs_reference
    from tests.test_rope_kernel import SHAPES, _inputs, _tables

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for seed, (b, s, h, d, per_batch, per_head) in enumerate(SHAPES):
            x = _inputs(b, s, h, d, dtype, seed=seed)
            cos, sin = _tables(b, s, h, d, per_batch=per_batch, per_head=per_head, seed=seed)
            views = [x, x.transpose(1, 2).contiguous().transpose(1, 2)]  # [B, S, H, D] strided as [B, H, S, D]
            for view in views:
                ref = rope_adjacent_pairs_reference(view, cos, sin)
                out = _rope_triton(view, cos, sin)
                assert out.dtype == dtype and out.shape == ref.shape and out.is_contiguous()
                if dtype == torch.bfloat16:
                    # The interpreter truncates float32 to bf16: at most one unit in the last place apart.
                    ulp = torch.finfo(torch.bfloat16).eps * ref.float().abs().clamp_min(torch.finfo(torch.float32).tiny)
                    assert ((out.float() - ref.float()).abs() <= ulp).all(), (dtype, b, s, h, d)
                else:
                    assert torch.equal(out, ref), (dtype, b, s, h, d, (out - ref).abs().max())
    print("interpreted rope ok")
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its interpreter runs on CPU)")
def test_rope_kernel_in_triton_interpreter():
    """The kernel's indexing (rows in partial blocks, a D of no power of two, tables per batch entry and per
    head, strided inputs), run by Triton's interpreter on CPU tensors against the reference."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True,
                            timeout=300, cwd=root)
    assert result.returncode == 0 and "interpreted rope ok" in result.stdout, result.stderr[-3000:]


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rope_kernel_bit_identical_on_gpu(dtype):
    """Compiled, the kernel equals the model's operations bit for bit in every dtype, shape and layout above
    (and at the Wan 1.3B shape); compiled with multiply-add contraction it does not, which shows that the
    comparison can fail."""
    from diffusers_sp.kernels.rope import _rope_triton

    shapes = SHAPES + [(1, 32760, 12, 128, False, False)]
    for seed, (b, s, h, d, per_batch, per_head) in enumerate(shapes):
        x = _inputs(b, s, h, d, dtype, seed=seed, device="cuda")
        cos, sin = _tables(b, s, h, d, per_batch=per_batch, per_head=per_head, seed=seed, device="cuda")
        for view in (x, x.transpose(1, 2).contiguous().transpose(1, 2)):
            assert fused_rope_applies(view, cos, sin)
            ref = rope_adjacent_pairs_reference(view, cos, sin)
            out = rope_adjacent_pairs(view, cos, sin)
            assert torch.equal(out, ref), (dtype, b, s, h, d, (out.float() - ref.float()).abs().max())
    contracted = _rope_triton(x, cos, sin, fp_fusion=True)
    assert not torch.equal(contracted, rope_adjacent_pairs_reference(x, cos, sin))


@cuda
def test_rope_kernel_declines_what_it_cannot_match():
    """Autograd, bf16 tables, odd D, mismatched tables and empty inputs run the reference; the gradient then
    flows."""
    x = _inputs(1, 8, 2, 8, torch.bfloat16, device="cuda")
    cos, sin = _tables(1, 8, 2, 8, device="cuda")
    assert not fused_rope_applies(x, cos.bfloat16(), sin.bfloat16())
    assert not fused_rope_applies(x[..., :7], cos[..., :7], sin[..., :7])
    assert not fused_rope_applies(x, cos[:, :4], sin[:, :4])
    assert not fused_rope_applies(x[:, :0], cos[:, :0], sin[:, :0])
    assert rope_adjacent_pairs(x[:, :0], cos[:, :0], sin[:, :0]).shape == (1, 0, 2, 8)
    leaf = x.float().requires_grad_()
    assert not fused_rope_applies(leaf, cos, sin)
    rope_adjacent_pairs(leaf, cos, sin).sum().backward()
    assert leaf.grad is not None and leaf.grad.abs().sum() > 0
    with torch.no_grad():
        assert fused_rope_applies(leaf, cos, sin)


def test_wan_vsa_self_attention_takes_the_family_rope():
    """Under VSA, Wan's self-attention runs the family's own rewrite (for its RoPE kernel) in every block, and
    the output equals that of the model's processor with the attention call taken over (one process, CPU)."""
    from diffusers_sp import enable_sequence_parallel
    from diffusers_sp.pipelines import wan
    from diffusers_sp.tiny_models import tiny_wan_transformer

    model = tiny_wan_transformer().eval()
    gen = torch.Generator().manual_seed(4)
    kwargs = dict(hidden_states=torch.randn(1, 16, 5, 8, 10, generator=gen), timestep=torch.tensor([500.0]),
                  encoder_hidden_states=torch.randn(1, 12, 32, generator=gen))
    with torch.no_grad():
        handle = enable_sequence_parallel(model, mode="vsa", vsa_sparsity=0.5, vsa_tile_size=(2, 2, 2))
        with mock.patch.object(wan, "rope_adjacent_pairs", wraps=wan.rope_adjacent_pairs) as rope:
            out = model(**kwargs).sample
        assert rope.call_count == 2 * len(model.blocks)  # queries and keys of every block
        for block in model.blocks:
            block.attn1.processor.kv_first = None  # the model's processor, its attention call taken over
        generic = model(**kwargs).sample
        handle.disable()
    assert torch.equal(out, generic), (out - generic).abs().max()
