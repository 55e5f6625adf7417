"""The warp-specialised Gluon fine stage of VSA (``diffusers_sp.kernels.vsa_gluon``) against the Triton fine
stage and the reference, on packed tiles with partial edge tiles (GPU-only, Hopper), and where it refuses."""

import pytest
import torch

from diffusers_sp.kernels import vsa, vsa_gluon
from diffusers_sp.kernels.vsa import make_tile_layout, packed_offsets, tile_range_tokens

_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def test_gluon_refuses_what_it_cannot_run():
    """CPU tensors and 32-slot tiles are not the kernel's: ``gluon_applies`` says no and the launch
    raises a ValueError naming what it needs, before any launch."""
    q = torch.zeros(1, 2, 64, 128, dtype=torch.bfloat16)
    assert not vsa_gluon.gluon_applies(q, q, q, 64)
    assert not vsa_gluon.gluon_applies(q, q, q, 32)
    sizes = torch.full((1,), 64, dtype=torch.int32)
    with pytest.raises(ValueError, match="V of 64/128/256 and D of 64 or 128"):
        vsa_gluon.fine_stage_gluon_packed(q, q, q, torch.zeros(1, 2, 1, 1, dtype=torch.int32), q_offsets=sizes * 0,
                                          q_sizes=sizes, kv_offsets=sizes * 0, kv_sizes=sizes, tile_volume=64,
                                          scale=1.0)


def _check_against_triton_and_reference(layout_kind, head_dim, grid, tile, **options):
    """The Gluon fine stage on packed tiles of ``tile`` over ``grid`` (most tiles partial) held as ``[B, S, H,
    D]`` projections or token-major buffers, with top-1, top-5 and every-tile selections, with and without a
    gate: equal to the Triton fine stage to bf16 rounding, and to the reference on the valid rows."""
    from diffusers_sp.kernels.vsa_triton import fine_stage_triton_packed

    layout = make_tile_layout(grid, tile)
    V = layout.tile_volume
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
    assert int(sizes.min()) < V // 2  # partial tiles: row blocks and key blocks past a tile's end occur
    offsets = packed_offsets(sizes)
    slots = vsa.packed_slots(sizes, V, S)
    valid = vsa._slot_mask(sizes, V)[None, None, :, :, None]
    coarse = torch.randn(B, H, n, head_dim, generator=gen).cuda()
    scale = head_dim ** -0.5
    assert vsa_gluon.gluon_applies(q, k, v, V)
    for topk in (1, 5, n):
        selected = torch.stack([torch.randperm(n, generator=torch.Generator().manual_seed(i))[:topk]
                                for i in range(B * H * n)]).view(B, H, n, topk).to("cuda", torch.int32)
        for g, c in ((None, None), (gate, coarse)):
            args = dict(q_offsets=offsets, q_sizes=sizes, kv_offsets=offsets, kv_sizes=sizes, tile_volume=V,
                        scale=scale, gate=g, coarse=c)
            fast = vsa_gluon.fine_stage_gluon_packed(q, k, v, selected, **options, **args)
            triton_out = fine_stage_triton_packed(q, k, v, selected, **args)
            assert fast.dtype == torch.bfloat16 and fast.shape == q.shape and fast.stride() == triton_out.stride()
            got, expected = (vsa.pad_tiles(x.float(), slots, n, V) * valid for x in (fast, triton_out))
            torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)
            if g is None:  # the reference's fine stage on padded tiles, compared on the valid rows
                padded = [vsa.pad_tiles(x.float(), slots, n, V) for x in (q, k, v)]
                reference = vsa._fine_stage_reference(*padded, selected.long(), sizes, scale)
                torch.testing.assert_close(got, reference * valid, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not _HOPPER, reason="GPU-only: the Gluon kernel runs on Hopper (compute capability 9.x)")
@pytest.mark.parametrize("layout_kind", ["bshd", "token_major"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("stages,max_registers,overlap_values", [(2, 128, False), (3, 128, False), (3, 128, True),
                                                                 (4, 255, True)])
def test_gluon_fine_stage_matches_triton_and_reference_cuda(layout_kind, head_dim, stages, max_registers,
                                                            overlap_values):
    """64-slot tiles (one consumer warpgroup) on a 5 x 10 x 9 grid of 4 x 4 x 4 tiles, at two to four stages,
    two programs a multiprocessor or one, each value product waited for at once or under the next block's
    softmax."""
    _check_against_triton_and_reference(layout_kind, head_dim, (5, 10, 9), (4, 4, 4), stages=stages,
                                        max_registers=max_registers, overlap_values=overlap_values)


@pytest.mark.skipif(not _HOPPER, reason="GPU-only: the Gluon kernel runs on Hopper (compute capability 9.x)")
@pytest.mark.parametrize("layout_kind", ["bshd", "token_major"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("tile", [(4, 4, 8), (4, 8, 8)])
@pytest.mark.parametrize("stages,overlap_values", [(None, False), (2, False), (5, True)])
def test_gluon_two_consumers_at_larger_tiles_cuda(layout_kind, head_dim, tile, stages, overlap_values):
    """128- and 256-slot tiles (two consumer warpgroups on 128 query rows, key tiles walked in blocks of 64) on
    a 6 x 12 x 18 grid whose edge tiles hold fewer than 64 tokens, so that a program's second warpgroup has no
    valid row and key blocks lie wholly past a tile's end."""
    _check_against_triton_and_reference(layout_kind, head_dim, (6, 12, 18), tile, stages=stages,
                                        overlap_values=overlap_values)


def test_gluon_launch_options_are_checked_before_any_launch():
    """Out-of-range ``stages`` and ``max_registers`` raise a ValueError naming the range; checked after
    ``gluon_applies``, so on a machine without a Hopper GPU the requirement error comes first."""
    q = torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16)
    sizes = torch.full((1,), 256, dtype=torch.int32)
    call = dict(q_offsets=sizes * 0, q_sizes=sizes, kv_offsets=sizes * 0, kv_sizes=sizes, tile_volume=256,
                scale=1.0)
    selected = torch.zeros(1, 2, 1, 1, dtype=torch.int32)
    if not _HOPPER:
        with pytest.raises(ValueError, match="compute capability 9.x"):
            vsa_gluon.fine_stage_gluon_packed(q, q, q, selected, stages=9, **call)
        return
    q = q.cuda()
    call = {key: (val.cuda() if torch.is_tensor(val) else val) for key, val in call.items()}
    with pytest.raises(ValueError, match=r"stages must be in \[2, 5\] at V=256"):
        vsa_gluon.fine_stage_gluon_packed(q, q, q, selected.cuda(), stages=6, **call)
    with pytest.raises(ValueError, match=r"max_registers must be in \[24, 168\] at V=256"):
        vsa_gluon.fine_stage_gluon_packed(q, q, q, selected.cuda(), max_registers=255, **call)


def test_gluon_backend_refuses_with_a_clear_error_where_it_cannot_run():
    """``backend="gluon"`` on CPU tensors (tiled and packed): a ValueError that names the backend and what
    would work, before any kernel runs."""
    from diffusers_sp.kernels.vsa import video_sparse_attention, video_sparse_attention_packed

    layout = make_tile_layout((4, 8, 8), (4, 8, 8))
    q = torch.zeros(1, 2, layout.num_tiles, 256, 64, dtype=torch.bfloat16)
    sizes = layout.block_sizes
    with pytest.raises(ValueError, match="backend='gluon'.*Use backend="):
        video_sparse_attention(q, q, q, q_block_sizes=sizes, kv_block_sizes=sizes, sparsity=0.5, backend="gluon")
    with pytest.raises(ValueError, match="backend='gluon'.*Use backend="):
        video_sparse_attention_packed(q.flatten(2, 3), q.flatten(2, 3), q.flatten(2, 3), tile_volume=256,
                                      q_block_sizes=sizes, kv_block_sizes=sizes, sparsity=0.5, backend="gluon")


@pytest.mark.skipif(not _HOPPER, reason="GPU-only: the Gluon kernel runs on Hopper (compute capability 9.x)")
@pytest.mark.parametrize("tile", [(4, 4, 8), (4, 8, 8)])
def test_gluon_backend_and_auto_choice_cuda(tile):
    """On Hopper ``backend="auto"`` resolves to ``"gluon"`` at the tile volumes of
    ``PREFERRED_TILE_VOLUMES`` (256 slots) and to ``"triton"`` elsewhere; the packed call with
    ``backend="gluon"`` equals the Triton backend's to bf16 rounding, ``"auto"`` equals the backend it names,
    and compiled (``fullgraph``, the Gluon launch an opaque operator) the Gluon call equals eager; the tiled call
    with ``backend="gluon"`` equals the reference backend's."""
    from diffusers_sp.kernels.vsa import backend_on, video_sparse_attention, video_sparse_attention_packed

    V = tile[0] * tile[1] * tile[2]
    expected = "gluon" if V in vsa_gluon.PREFERRED_TILE_VOLUMES else "triton"
    assert backend_on("auto", torch.device("cuda"), torch.bfloat16, 128, V) == expected
    assert backend_on("auto", torch.device("cuda"), torch.bfloat16, 128, 64) == "triton"
    layout = make_tile_layout((6, 12, 18), tile)
    n, S = layout.num_tiles, layout.num_tokens
    gen = torch.Generator().manual_seed(5)
    q, k, v, gate = (torch.randn(1, S, 3, 128, generator=gen).to("cuda", torch.bfloat16).transpose(1, 2)
                     for _ in range(4))
    sizes = layout.block_sizes
    args = dict(tile_volume=V, q_block_sizes=sizes, kv_block_sizes=sizes, sparsity=0.6, gate=gate)
    fast = video_sparse_attention_packed(q, k, v, backend="gluon", **args)
    triton_out = video_sparse_attention_packed(q, k, v, backend="triton", **args)
    torch.testing.assert_close(fast.float(), triton_out.float(), rtol=1e-2, atol=1e-2)
    auto = video_sparse_attention_packed(q, k, v, **args)
    assert torch.equal(auto, fast if expected == "gluon" else triton_out)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(video_sparse_attention_packed, fullgraph=True)(q, k, v, backend="gluon", **args)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(compiled.float(), fast.float(), rtol=1e-2, atol=1e-2)
    slots = vsa.packed_slots(sizes.cuda(), V, S)
    tiled = [vsa.pad_tiles(x, slots, n, V) for x in (q, k, v, gate)]
    kwargs = dict(q_block_sizes=sizes, kv_block_sizes=sizes, sparsity=0.6, gate=tiled[3])
    fast_tiled = vsa.video_sparse_attention(*tiled[:3], backend="gluon", **kwargs)
    reference = video_sparse_attention(*(x.float() for x in tiled[:3]), backend="reference",
                                       **dict(kwargs, gate=tiled[3].float()))
    torch.testing.assert_close(fast_tiled.float(), reference, rtol=3e-2, atol=3e-2)
