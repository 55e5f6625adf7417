"""The warp-specialised Gluon fine stage of VSA (``diffusers_sp.kernels.vsa_gluon``) against the Triton fine
stage and the reference, on packed tiles with partial edge tiles (GPU-only, Hopper), and where it refuses."""

import pytest
import torch

from diffusers_sp.kernels import vsa, vsa_gluon
from diffusers_sp.kernels.vsa import make_tile_layout, packed_offsets, tile_range_tokens

_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def test_gluon_refuses_what_it_cannot_run():
    """CPU tensors, 128-slot tiles and float32 are not the kernel's: ``gluon_applies`` says no and the launch
    raises a ValueError naming what it needs, before any launch."""
    q = torch.zeros(1, 2, 64, 128, dtype=torch.bfloat16)
    assert not vsa_gluon.gluon_applies(q, q, q, 64)
    sizes = torch.full((1,), 64, dtype=torch.int32)
    with pytest.raises(ValueError, match="V=64 and D of 64 or 128"):
        vsa_gluon.fine_stage_gluon_packed(q, q, q, torch.zeros(1, 2, 1, 1, dtype=torch.int32), q_offsets=sizes * 0,
                                          q_sizes=sizes, kv_offsets=sizes * 0, kv_sizes=sizes, tile_volume=64,
                                          scale=1.0)


@pytest.mark.skipif(not _HOPPER, reason="GPU-only: the Gluon kernel runs on Hopper (compute capability 9.x)")
@pytest.mark.parametrize("layout_kind", ["bshd", "token_major"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("stages,max_registers,overlap_values", [(2, 128, False), (3, 128, False), (3, 128, True),
                                                                 (4, None, True)])
def test_gluon_fine_stage_matches_triton_and_reference_cuda(layout_kind, head_dim, stages, max_registers,
                                                            overlap_values):
    """On a 5 x 10 x 9 grid of 4 x 4 x 4 tiles (most partial) held as ``[B, S, H, D]`` projections or
    token-major buffers, with top-1, top-5 and top-18 (every tile) selections, with and without a gate:
    the Gluon fine stage equals the Triton one to bf16 rounding, and the reference on the valid rows, at two to
    four stages, two programs a multiprocessor or one, each value product waited for at once or under the next
    block's softmax."""
    from diffusers_sp.kernels.vsa_triton import fine_stage_triton_packed

    layout = make_tile_layout((5, 10, 9), (4, 4, 4))
    B, H, S, n = 2, 3, layout.num_tokens, layout.num_tiles
    gen = torch.Generator().manual_seed(21)
    order = tile_range_tokens(layout, 0, n)

    def held(x):  # packed [B, H, S, D] bf16 values in the memory layout under test
        x = x.index_select(2, order)
        if layout_kind == "bshd":
            return x.transpose(1, 2).contiguous().to("cuda", torch.bfloat16).transpose(1, 2)
        return x.permute(2, 0, 1, 3).contiguous().to("cuda", torch.bfloat16).permute(1, 2, 0, 3)

    q, k, v, gate = (held(torch.randn(B, H, S, head_dim, generator=gen)) for _ in range(4))
    sizes = layout.block_sizes.to("cuda", torch.int32)
    offsets = packed_offsets(sizes)
    slots = vsa.packed_slots(sizes, 64, S)
    valid = vsa._slot_mask(sizes, 64)[None, None, :, :, None]
    coarse = torch.randn(B, H, n, head_dim, generator=gen).cuda()
    scale = head_dim ** -0.5
    assert vsa_gluon.gluon_applies(q, k, v, 64)
    for topk in (1, 5, n):
        selected = torch.stack([torch.randperm(n, generator=torch.Generator().manual_seed(i))[:topk]
                                for i in range(B * H * n)]).view(B, H, n, topk).to("cuda", torch.int32)
        for g, c in ((None, None), (gate, coarse)):
            args = dict(q_offsets=offsets, q_sizes=sizes, kv_offsets=offsets, kv_sizes=sizes, tile_volume=64,
                        scale=scale, gate=g, coarse=c)
            fast = vsa_gluon.fine_stage_gluon_packed(q, k, v, selected, stages=stages, max_registers=max_registers,
                                                     overlap_values=overlap_values, **args)
            triton_out = fine_stage_triton_packed(q, k, v, selected, **args)
            assert fast.dtype == torch.bfloat16 and fast.shape == q.shape and fast.stride() == triton_out.stride()
            torch.testing.assert_close(fast.float(), triton_out.float(), rtol=1e-2, atol=1e-2)
            if g is None:  # the reference's fine stage on padded tiles, compared on the valid rows
                padded = [vsa.pad_tiles(x.float(), slots, n, 64) for x in (q, k, v)]
                reference = vsa._fine_stage_reference(*padded, selected.long(), sizes, scale)
                got = vsa.pad_tiles(fast.float(), slots, n, 64)
                torch.testing.assert_close(got * valid, reference * valid, rtol=2e-2, atol=2e-2)
