"""Tests of the VSA kernel module (diffusers_sp.kernels.vsa): tiling, top-k, and the attention
against dense SDPA and against an independent loop implementation of arXiv 2505.13389's VSA."""

import importlib.util
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from diffusers_sp.kernels import vsa, vsa_flex
from diffusers_sp.kernels.vsa import (
    make_tile_layout,
    tile_range_tokens,
    tile_tokens,
    untile_tokens,
    video_sparse_attention,
    video_sparse_attention_packed,
    vsa_topk,
)
from diffusers_sp.kernels.tiles import packed_offsets, packed_slots


def _tiled_qkv(layout, batch=2, heads=3, head_dim=8, seed=0, dtype=torch.float32, device="cpu"):
    """Random raster q, k, v ``[B, H, S, D]`` and their tiled forms ``[B, H, N, V, D]``."""
    gen = torch.Generator().manual_seed(seed)
    raster = [torch.randn(batch, heads, layout.num_tokens, head_dim, generator=gen).to(device, dtype)
              for _ in range(3)]
    return raster, [tile_tokens(x, layout, dim=2) for x in raster]


def _loop_vsa(q, k, v, q_block_sizes, kv_block_sizes, sparsity, gate):
    """VSA written as directly as possible from the paper, one (batch, head, query tile) at a time.

    q, k, v, gate: tiled ``[B, H, N, V, D]`` float32. Returns ``[B, H, Nq, V, D]``.
    """
    batch, heads, num_q_tiles, _, head_dim = q.shape
    num_kv_tiles = k.shape[2]
    scale = 1 / math.sqrt(head_dim)
    keep = max(1, min(num_kv_tiles, math.ceil(round((1 - sparsity) * num_kv_tiles, 9))))
    out = torch.zeros_like(q)
    for b in range(batch):
        for h in range(heads):
            k_means = torch.stack([k[b, h, j, :kv_block_sizes[j]].mean(0) for j in range(num_kv_tiles)])
            v_means = torch.stack([v[b, h, j, :kv_block_sizes[j]].mean(0) for j in range(num_kv_tiles)])
            for i in range(num_q_tiles):
                n_q = int(q_block_sizes[i])
                q_tokens = q[b, h, i, :n_q]
                scores = (q_tokens.mean(0) @ k_means.T) * scale
                coarse = torch.softmax(scores, 0) @ v_means
                chosen = torch.topk(scores, keep).indices.tolist()
                keys = torch.cat([k[b, h, j, :kv_block_sizes[j]] for j in chosen])
                values = torch.cat([v[b, h, j, :kv_block_sizes[j]] for j in chosen])
                fine = torch.softmax(q_tokens @ keys.T * scale, dim=-1) @ values
                out[b, h, i, :n_q] = fine + coarse * gate[b, h, i, :n_q]
    return out


def _rel_max_diff(actual, expected):
    return ((actual - expected).abs().max() / expected.abs().max()).item()


# --- tiling ------------------------------------------------------------------------------------

@pytest.mark.parametrize("grid,tile", [((5, 6, 7), (4, 4, 4)), ((8, 4, 4), (4, 4, 4)),
                                       ((3, 5, 2), (2, 2, 2)), ((1, 1, 1), (4, 4, 4)),
                                       ((1, 1, 1), (1, 1, 1))])
def test_tile_untile_round_trip(grid, tile):
    layout = make_tile_layout(grid, tile)
    S = grid[0] * grid[1] * grid[2]
    assert layout.tile_volume == tile[0] * tile[1] * tile[2]
    assert layout.tile_grid == tuple(-(-g // t) for g, t in zip(grid, tile))
    assert layout.num_tiles == math.prod(layout.tile_grid)
    assert int(layout.block_sizes.sum()) == S
    assert bool(((layout.block_sizes >= 1) & (layout.block_sizes <= layout.tile_volume)).all())
    # Valid slots first: slot j of tile i holds a token exactly when j < block_sizes[i], and the
    # tokens of a tile are in raster order.
    per_tile = layout.tiled_index.view(layout.num_tiles, layout.tile_volume)
    assert torch.equal(per_tile >= 0, torch.arange(layout.tile_volume) < layout.block_sizes[:, None])
    for i in range(layout.num_tiles):
        tokens = per_tile[i, :layout.block_sizes[i]]
        assert bool((tokens[1:] > tokens[:-1]).all())
    # tiled_index holds every raster token exactly once; raster_to_slot inverts it.
    valid = layout.tiled_index[layout.tiled_index >= 0]
    assert torch.equal(valid.sort().values, torch.arange(S))
    assert torch.equal(layout.tiled_index[layout.raster_to_slot], torch.arange(S))

    x = torch.randn(2, S, 3)
    tiled = tile_tokens(x, layout, dim=1)
    assert tiled.shape == (2, layout.num_tiles, layout.tile_volume, 3)
    padded = layout.tiled_index.view(layout.num_tiles, layout.tile_volume) < 0
    assert bool((tiled[:, padded] == 0).all())
    assert torch.equal(untile_tokens(tiled, layout, dim=1), x)
    # Negative dims name the same positions.
    assert torch.equal(tile_tokens(x, layout, dim=-2), tiled)
    assert torch.equal(untile_tokens(tiled, layout, dim=-3), x)


def test_tiled_order_hand_computed():
    layout = make_tile_layout((1, 2, 4), (1, 2, 2))
    assert layout.tiled_index.view(2, 4).tolist() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    x = torch.arange(8.0)
    assert tile_tokens(x, layout, dim=0).tolist() == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_partial_tiles_hand_computed():
    # grid (1, 3, 3), tile (1, 2, 2): tiles hold {0,1,3,4}, {2,5}, {6,7}, {8}; valid tokens first.
    layout = make_tile_layout((1, 3, 3), (1, 2, 2))
    assert layout.tiled_index.view(4, 4).tolist() == [[0, 1, 3, 4], [2, 5, -1, -1],
                                                      [6, 7, -1, -1], [8, -1, -1, -1]]
    assert layout.block_sizes.tolist() == [4, 2, 2, 1]


def test_tile_range_tokens():
    layout = make_tile_layout((3, 5, 2), (2, 2, 2))
    x = torch.arange(layout.num_tokens)
    tiled = tile_tokens(x, layout, dim=0)
    for start, end in [(0, layout.num_tiles), (1, 4), (2, 2), (layout.num_tiles - 1, layout.num_tiles)]:
        idx = tile_range_tokens(layout, start, end)
        assert idx.numel() == int(layout.block_sizes[start:end].sum())
        # Tile-slot order: the valid slots of those tiles, in order.
        V = layout.tile_volume
        slots = tiled[start:end].flatten()[layout.tiled_index[start * V:end * V] >= 0]
        assert torch.equal(x[idx], slots)
    with pytest.raises(ValueError, match="tile range"):
        tile_range_tokens(layout, 2, layout.num_tiles + 1)
    with pytest.raises(ValueError, match="tile range"):
        tile_range_tokens(layout, 3, 2)


# --- top-k ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_kv_tiles,sparsity,expected", [
    (10, 0.9, 1), (10, 0.0, 10), (10, 0.5, 5), (10, 0.55, 5), (10, 0.45, 6), (624, 0.9, 63),
    (1, 0.0, 1), (1, 0.99, 1), (100, 0.999, 1), (3, 0.7, 1), (3, 0.6, 2), (7, 1 / 7, 6)])
def test_vsa_topk(num_kv_tiles, sparsity, expected):
    assert vsa_topk(num_kv_tiles, sparsity) == expected


@pytest.mark.parametrize("num_kv_tiles,sparsity", [(0, 0.5), (10, 1.0), (10, -0.1), (10, 1.5)])
def test_vsa_topk_errors(num_kv_tiles, sparsity):
    with pytest.raises(ValueError):
        vsa_topk(num_kv_tiles, sparsity)


# --- attention -----------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_sparsity_zero_without_gate_is_dense_attention(backend):
    layout = make_tile_layout((5, 6, 7), (4, 4, 4))  # partial tiles on every axis
    (q, k, v), (qt, kt, vt) = _tiled_qkv(layout, batch=2, heads=3, head_dim=8)
    out_tiled = video_sparse_attention(qt, kt, vt, q_block_sizes=layout.block_sizes,
                                       kv_block_sizes=layout.block_sizes, sparsity=0.0, backend=backend)
    out = untile_tokens(out_tiled, layout, dim=2)
    expected = F.scaled_dot_product_attention(q, k, v)
    assert out.dtype == q.dtype and out.shape == expected.shape
    assert _rel_max_diff(out, expected) <= 1e-5


@pytest.mark.parametrize("sparsity", [0.5, 0.9])
def test_matches_loop_implementation_with_gate(sparsity):
    layout = make_tile_layout((5, 6, 7), (2, 2, 2))  # 3*3*4 = 36 tiles of 8 slots, partial ones too
    _, (qt, kt, vt) = _tiled_qkv(layout, batch=2, heads=2, head_dim=8, seed=1)
    gate = torch.randn(qt.shape, generator=torch.Generator().manual_seed(2))
    out = video_sparse_attention(qt, kt, vt, q_block_sizes=layout.block_sizes,
                                 kv_block_sizes=layout.block_sizes, sparsity=sparsity, gate=gate,
                                 backend="reference")
    expected = _loop_vsa(qt, kt, vt, layout.block_sizes, layout.block_sizes, sparsity, gate)
    assert _rel_max_diff(out, expected) <= 1e-5
    # Padded query slots are zero although the gate is not.
    padded = layout.tiled_index.view(layout.num_tiles, -1) < 0
    assert bool((out[:, :, padded] == 0).all())


def test_query_tile_subset_gives_the_same_rows():
    layout = make_tile_layout((5, 6, 7), (2, 2, 2))
    _, (qt, kt, vt) = _tiled_qkv(layout, batch=1, heads=2, head_dim=8, seed=3)
    gate = torch.randn(qt.shape, generator=torch.Generator().manual_seed(4))
    common = dict(kv_block_sizes=layout.block_sizes, sparsity=0.75, backend="reference")
    full = video_sparse_attention(qt, kt, vt, q_block_sizes=layout.block_sizes, gate=gate, **common)
    for start, end in [(0, 13), (13, 36), (20, 21)]:
        part = video_sparse_attention(qt[:, :, start:end], kt, vt, q_block_sizes=layout.block_sizes[start:end],
                                      gate=gate[:, :, start:end], **common)
        torch.testing.assert_close(part, full[:, :, start:end], rtol=0, atol=1e-6)


def _packed(x, layout, start=0, end=None):
    """Raster ``[B, H, S, D]`` -> the valid tokens of tiles ``[start, end)``, tile after tile (packed)."""
    return x.index_select(2, tile_range_tokens(layout, start, layout.num_tiles if end is None else end).to(x.device))


def test_packed_slots_and_offsets_hand_computed():
    sizes = torch.tensor([4, 2, 2, 1])
    assert packed_slots(sizes, 4, 9).tolist() == [0, 1, 2, 3, 4, 5, 8, 9, 12]
    assert packed_offsets(sizes).tolist() == [0, 4, 6, 8]


@pytest.mark.parametrize("with_gate", [False, True])
def test_packed_equals_padded(with_gate):
    """VSA on packed tile-ordered tokens (the processor's layout: no padded slots) gives the padded API's rows,
    for all query tiles and for a range of them (one rank's tiles), with partial tiles."""
    layout = make_tile_layout((5, 6, 7), (2, 2, 2))  # 36 tiles, partial ones on every axis
    (q, k, v), (qt, kt, vt) = _tiled_qkv(layout, batch=2, heads=3, head_dim=8, seed=11)
    gate = torch.randn(q.shape, generator=torch.Generator().manual_seed(12)) if with_gate else None
    gate_t = None if gate is None else tile_tokens(gate, layout, dim=2)
    sizes = layout.block_sizes
    for start, end in [(0, layout.num_tiles), (7, 20)]:
        padded = video_sparse_attention(qt[:, :, start:end], kt, vt, q_block_sizes=sizes[start:end],
                                        kv_block_sizes=sizes, sparsity=0.7,
                                        gate=None if gate_t is None else gate_t[:, :, start:end])
        expected = padded.flatten(2, 3)[:, :, (layout.tiled_index.view(-1, layout.tile_volume)[start:end] >= 0)
                                        .reshape(-1)]
        packed = video_sparse_attention_packed(
            _packed(q, layout, start, end), _packed(k, layout), _packed(v, layout), tile_volume=layout.tile_volume,
            q_block_sizes=sizes[start:end], kv_block_sizes=sizes, sparsity=0.7,
            gate=None if gate is None else _packed(gate, layout, start, end))
        torch.testing.assert_close(packed, expected, rtol=0, atol=1e-6)


def test_packed_triton_path_on_stand_ins():
    """The Triton path of the packed API (coarse stage, fine stage with the gate in its epilogue) run through
    CPU stand-ins of the two stages equals the reference backend: offsets, sizes and
    the coarse output reach the kernels as they must."""
    from kernel_stand_ins import stand_in_kernels

    layout = make_tile_layout((5, 6, 7), (2, 2, 2))
    (q, k, v), _ = _tiled_qkv(layout, batch=1, heads=2, head_dim=8, seed=13)
    gate = torch.randn(q.shape, generator=torch.Generator().manual_seed(14))
    args = dict(tile_volume=layout.tile_volume, q_block_sizes=layout.block_sizes[3:30],
                kv_block_sizes=layout.block_sizes, sparsity=0.6, gate=_packed(gate, layout, 3, 30))
    qp, kp, vp = _packed(q, layout, 3, 30), _packed(k, layout), _packed(v, layout)
    reference = video_sparse_attention_packed(qp, kp, vp, backend="reference", **args)
    with stand_in_kernels() as calls:
        fast = video_sparse_attention_packed(qp, kp, vp, backend="triton", **args)
    assert (calls["vsa_triton"], calls["vsa_coarse"]) == (1, 1), dict(calls)
    torch.testing.assert_close(fast, reference, rtol=0, atol=1e-6)
    # The tile offsets given by the caller (as the VSA processor's tile plan gives them) reach the kernels.
    sizes32 = layout.block_sizes.to(torch.int32)
    with stand_in_kernels() as calls:
        given = video_sparse_attention_packed(qp, kp, vp, backend="triton", q_block_offsets=packed_offsets(
            sizes32[3:30]), kv_block_offsets=packed_offsets(sizes32), **dict(args, q_block_sizes=sizes32[3:30],
                                                                             kv_block_sizes=sizes32))
    assert calls["vsa_triton"] == 1
    torch.testing.assert_close(given, fast, rtol=0, atol=0)


def test_packed_errors():
    layout = make_tile_layout((3, 5, 2), (2, 2, 2))
    (q, k, v), _ = _tiled_qkv(layout, batch=1, heads=2, head_dim=8)
    sizes = layout.block_sizes
    ok = dict(tile_volume=layout.tile_volume, q_block_sizes=sizes, kv_block_sizes=sizes, sparsity=0.5)
    with pytest.raises(ValueError, match="sum to the"):
        video_sparse_attention_packed(q[:, :, 1:], k, v, **ok)
    with pytest.raises(ValueError, match=r"\[B, H, S, D\]"):
        video_sparse_attention_packed(q[None], k, v, **ok)
    with pytest.raises(ValueError, match="gate must have"):
        video_sparse_attention_packed(q, k, v, gate=q[:, :1], **ok)
    with pytest.raises(ValueError, match="backend='triton'"):
        video_sparse_attention_packed(q, k, v, backend="triton", **ok)
    offsets = packed_offsets(sizes)
    for bad, match in ((offsets[1:], "integer tensor of the block sizes' shape"),
                       (offsets.float(), "integer tensor of the block sizes' shape"),
                       (offsets + 1, "exclusive running sum"), (torch.cumsum(sizes, 0), "exclusive running sum")):
        with pytest.raises(ValueError, match=match):
            video_sparse_attention_packed(q, k, v, q_block_offsets=bad, **ok)
        with pytest.raises(ValueError, match=match):
            video_sparse_attention_packed(q, k, v, kv_block_offsets=bad, **ok)
    plain = video_sparse_attention_packed(q, k, v, **ok)
    torch.testing.assert_close(video_sparse_attention_packed(q, k, v, q_block_offsets=offsets,
                                                             kv_block_offsets=offsets.long(), **ok), plain)


def test_reference_backend_gradients():
    layout = make_tile_layout((2, 2, 4), (1, 2, 2))  # 4 whole tiles
    _, tiled = _tiled_qkv(layout, batch=1, heads=1, head_dim=4, seed=8, dtype=torch.float64)
    gate = torch.randn(tiled[0].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    inputs = [x.requires_grad_() for x in (*tiled, gate)]

    def vsa_of(q, k, v, g):
        return video_sparse_attention(q, k, v, q_block_sizes=layout.block_sizes, kv_block_sizes=layout.block_sizes,
                                      sparsity=0.5, gate=g, backend="auto")  # auto: reference on CPU

    assert torch.autograd.gradcheck(vsa_of, inputs, fast_mode=True)


def test_errors():
    layout = make_tile_layout((3, 5, 2), (2, 2, 2))
    _, (qt, kt, vt) = _tiled_qkv(layout, batch=1, heads=2, head_dim=8)
    bad_calls = [  # (regex of the message, args, keyword overrides)
        ("sparsity", (qt, kt, vt), dict(sparsity=1.0)),
        ("sparsity", (qt, kt, vt), dict(sparsity=-0.5)),
        ("agree on B, H, V and D", (qt, kt[..., :4], vt[..., :4]), {}),
        ("same shape", (qt, kt, vt[:, :, :-1]), {}),
        (r"\[B, H, N, V, D\]", (qt.flatten(2, 3), kt, vt), {}),
        ("q_block_sizes", (qt, kt, vt), dict(q_block_sizes=layout.block_sizes[:-1])),
        ("kv_block_sizes", (qt, kt, vt), dict(kv_block_sizes=layout.block_sizes.float())),
        ("gate", (qt, kt, vt), dict(gate=qt[:, :1])),
        ("unknown VSA backend", (qt, kt, vt), dict(backend="thunderkittens")),
        ("Triton", (qt, kt, vt), dict(backend="triton")),  # float32 CPU tensors: never Triton's
        ("dtype", (qt, kt.double(), vt.double()), {}),
    ]
    if not torch.cuda.is_available():
        bad_calls.append(("needs CUDA.*a bfloat16/float16/float32 dtype", (qt, kt, vt), dict(backend="flex")))
    for match, args, overrides in bad_calls:
        kwargs = dict(q_block_sizes=layout.block_sizes, kv_block_sizes=layout.block_sizes, sparsity=0.5,
                      backend="reference")
        kwargs.update(overrides)
        with pytest.raises(ValueError, match=match):
            video_sparse_attention(*args, **kwargs)


@pytest.mark.parametrize("grid,tile", [((0, 4, 4), (4, 4, 4)), ((4, 4, 4), (4, 0, 4)),
                                       ((4, 4), (4, 4, 4)), ((-1, 2, 2), (1, 1, 1))])
def test_layout_errors(grid, tile):
    with pytest.raises(ValueError, match="three ints >= 1"):
        make_tile_layout(grid, tile)


def test_tile_shape_errors():
    layout = make_tile_layout((3, 5, 2), (2, 2, 2))
    with pytest.raises(ValueError, match="tokens"):
        tile_tokens(torch.zeros(2, layout.num_tokens + 1), layout, dim=1)
    with pytest.raises(ValueError, match="out of range"):
        tile_tokens(torch.zeros(2, layout.num_tokens), layout, dim=2)
    with pytest.raises(ValueError, match="num_tiles, V"):
        untile_tokens(torch.zeros(layout.num_tiles, layout.tile_volume + 1), layout, dim=0)


# --- flex backend ------------------------------------------------------------------------------

@pytest.mark.skipif(vsa_flex.BlockMask is None, reason="torch without flex_attention")
def test_flex_block_mask_encodes_the_selection():
    """CPU check of the flex path's BlockMask: full blocks are exactly the selected whole tiles,
    mask_mod blocks exactly the selected partial tiles, and mask_mod keeps their valid slots."""
    layout = make_tile_layout((5, 6, 7), (4, 4, 4))  # 8 tiles: 1 whole, 7 partial
    V, num_tiles, batch, heads, topk = layout.tile_volume, layout.num_tiles, 2, 3, 5
    gen = torch.Generator().manual_seed(0)
    selected = torch.stack([torch.randperm(num_tiles, generator=gen)[:topk]
                            for _ in range(batch * heads * num_tiles)]).view(batch, heads, num_tiles, topk)
    block_mask = vsa_flex.selection_block_mask(selected, layout.block_sizes, V)
    assert block_mask.BLOCK_SIZE == (V, V)
    assert tuple(block_mask.seq_lengths) == (num_tiles * V, num_tiles * V)

    def as_sets(num_blocks, indices):
        return [set(indices[b, h, i, :num_blocks[b, h, i]].tolist())
                for b in range(batch) for h in range(heads) for i in range(num_tiles)]

    whole = {j for j in range(num_tiles) if layout.block_sizes[j] == V}
    chosen = [set(selected[b, h, i].tolist()) for b in range(batch) for h in range(heads) for i in range(num_tiles)]
    assert as_sets(block_mask.full_kv_num_blocks, block_mask.full_kv_indices) == [c & whole for c in chosen]
    assert as_sets(block_mask.kv_num_blocks, block_mask.kv_indices) == [c - whole for c in chosen]
    zero = torch.zeros((), dtype=torch.long)
    keep = block_mask.mask_mod(zero, zero, zero, torch.arange(num_tiles * V))
    assert torch.equal(keep.view(num_tiles, V), torch.arange(V) < layout.block_sizes[:, None])


# GPU-only: skipped without CUDA.
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only: backend='flex' needs CUDA")
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("sparsity", [0.0, 0.6, 0.9])
def test_flex_matches_reference_cuda(dtype, atol, sparsity):
    """GPU-only: the flex BlockMask path (full tiles without mask_mod, partial tiles with it,
    a subset of query tiles) agrees with the reference path."""
    layout = make_tile_layout((5, 10, 9), (4, 4, 4), device="cuda")  # 2*3*3 = 18 tiles, most partial
    _, (qt, kt, vt) = _tiled_qkv(layout, batch=2, heads=3, head_dim=64, seed=6, dtype=dtype, device="cuda")
    gate = torch.randn(qt.shape, generator=torch.Generator().manual_seed(7)).to("cuda", dtype)
    for gate_arg in (None, gate):
        for start, end in [(0, layout.num_tiles), (5, 12)]:
            kwargs = dict(q_block_sizes=layout.block_sizes[start:end], kv_block_sizes=layout.block_sizes,
                          sparsity=sparsity, gate=None if gate_arg is None else gate_arg[:, :, start:end])
            q_part = qt[:, :, start:end]
            flex = video_sparse_attention(q_part, kt, vt, backend="flex", **kwargs)
            reference = video_sparse_attention(q_part, kt, vt, backend="reference", **kwargs)
            assert flex.dtype == dtype
            torch.testing.assert_close(flex.float(), reference.float(), rtol=atol, atol=atol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only: backend='triton' needs CUDA and Triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9])
@pytest.mark.parametrize("tile,head_dim", [((4, 4, 4), 128), ((2, 2, 4), 64), ((2, 8, 8), 128), ((4, 8, 8), 128),
                                           ((4, 8, 8), 64)])
def test_triton_matches_reference_cuda(dtype, sparsity, tile, head_dim):
    """GPU-only: the Triton fine-stage kernel at its default launch configuration (partial key tiles
    masked in the kernel) agrees with the reference path, with and without a gate, for all query
    tiles and for a subset; 64-, 128- and 256-token tiles (the larger two cut into row and column blocks of
    64, whose blocks of padded slots only must add nothing). Several key tiles per step are tested in
    :func:`test_triton_multi_tile_steps_cuda`."""
    grid = (5, 10, 9) if tile[1] < 8 else (9, 20, 18)  # partial tiles on every axis, at least 12 tiles
    layout = make_tile_layout(grid, tile, device="cuda")
    _, (qt, kt, vt) = _tiled_qkv(layout, batch=2, heads=3, head_dim=head_dim, seed=8, dtype=dtype, device="cuda")
    gate = torch.randn(qt.shape, generator=torch.Generator().manual_seed(9)).to("cuda", dtype)
    for gate_arg in (None, gate):
        for start, end in [(0, layout.num_tiles), (5, 12)]:
            kwargs = dict(q_block_sizes=layout.block_sizes[start:end], kv_block_sizes=layout.block_sizes,
                          sparsity=sparsity, gate=None if gate_arg is None else gate_arg[:, :, start:end])
            q_part = qt[:, :, start:end]
            fast = video_sparse_attention(q_part, kt, vt, backend="triton", **kwargs)
            reference = video_sparse_attention(q_part.float(), kt.float(), vt.float(), backend="reference",
                                               **dict(kwargs, gate=None if gate_arg is None
                                                      else kwargs["gate"].float()))
            assert fast.dtype == dtype
            torch.testing.assert_close(fast.float(), reference, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only: the Triton kernel needs CUDA and Triton")
@pytest.mark.parametrize("config,tile", [({"tma": False}, (4, 4, 4)), ({"tma": True}, (4, 4, 4)),
                                         ({"tma": True, "num_stages": 3}, (4, 4, 4)), ({"tma": False}, (4, 8, 8)),
                                         ({"tma": True}, (4, 8, 8)), ({"tma": True, "block_m": 64}, (4, 8, 8)),
                                         ({"tma": False, "block_m": 128}, (4, 8, 8)),
                                         ({"tma": True, "block_m": 128, "num_warps": 4, "num_stages": 3}, (4, 8, 8)),
                                         ({"tma": True}, (2, 8, 8)), ({"tma": True, "block_m": 32}, (2, 8, 8)),
                                         ({"tma": True, "short_steps": (32, 16)}, (4, 4, 4)),
                                         ({"tma": False, "short_steps": (32, 16)}, (4, 4, 4)),
                                         ({"tma": True, "short_steps": ()}, (4, 4, 4)),
                                         ({"tma": True, "short_steps": (32, 16)}, (4, 8, 8)),
                                         ({"tma": True, "short_steps": (16,)}, (4, 4, 4))],
                         ids=str)
def test_triton_fine_stage_configs_cuda(config, tile):
    """GPU-only: the fine stage at several top-k, with the tensor-descriptor (TMA) loads, which must
    actually run (Hopper), and with ordinary loads, for 64-, 128- and 256-slot tiles (key tiles in column
    blocks of 64; query rows in blocks of 32, 64 or 128 per program, on four warps). Fine stage
    against the reference's on the valid rows."""
    from diffusers_sp.kernels.vsa_triton import fine_stage_triton, tma_applies

    grid = (5, 10, 9) if tile == (4, 4, 4) else (9, 20, 18)
    layout = make_tile_layout(grid, tile, device="cuda")  # 18 tiles, most partial
    _, (qt, kt, vt) = _tiled_qkv(layout, batch=2, heads=3, head_dim=64, seed=10, dtype=torch.bfloat16,
                                 device="cuda")
    scale = 64 ** -0.5
    if config.get("tma"):
        assert tma_applies(*(t.flatten(2, 3) for t in (qt, kt, vt))), "the TMA loads do not apply on this GPU"
    for topk in (1, 5, 7):
        selected = torch.stack([torch.randperm(layout.num_tiles, generator=torch.Generator().manual_seed(i))[:topk]
                                for i in range(2 * 3 * layout.num_tiles)]).view(2, 3, layout.num_tiles, topk)
        selected = selected.to("cuda")
        fast = fine_stage_triton(qt, kt, vt, selected, layout.block_sizes, scale, config=config)
        reference = vsa._fine_stage_reference(qt.float(), kt.float(), vt.float(), selected, layout.block_sizes, scale)
        valid = vsa._slot_mask(layout.block_sizes, layout.tile_volume)[None, None, :, :, None]
        torch.testing.assert_close(fast.float() * valid, reference * valid, rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="block_m must be"):  # a query block larger than the tile
        fine_stage_triton(qt, kt, vt, selected, layout.block_sizes, scale,
                          config=dict(config, block_m=2 * layout.tile_volume))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only: the Triton kernels need CUDA and Triton")
@pytest.mark.parametrize("layout_kind", ["bshd", "token_major"])
@pytest.mark.parametrize("tile,head_dim", [((4, 4, 4), 128), ((2, 2, 4), 64), ((4, 8, 8), 128)])
@pytest.mark.parametrize("tma", [True, False])
def test_triton_packed_matches_reference_cuda(layout_kind, tile, head_dim, tma):
    """GPU-only: the packed Triton path (tile means kernel, fine stage with the gate in its epilogue) on
    tile-ordered tokens held as the processor holds them (``[B, S, H, D]`` projections seen as
    ``[B, H, S, D]``, or the token-major ``[S, B, H, D]`` buffers of the collectives) equals the reference
    backend, for all query tiles and for a range of them, with and without a gate, TMA and ordinary loads; and
    walking every key block and query block (empty ones included) gives the same bits as skipping the empty
    (both in 64-row steps); and so do the short key steps for the ends of partial tiles, (32, 16) as by
    default, 32 or 16 alone, or none (``short_steps``)."""
    from unittest import mock

    from diffusers_sp.kernels import vsa_triton

    grid = (5, 10, 9) if tile[1] < 8 else (9, 20, 18)
    layout = make_tile_layout(grid, tile)
    B, H, S = 2, 3, layout.num_tokens
    gen = torch.Generator().manual_seed(15)

    def held(x):  # [B, H, S, D] values in the memory layout under test
        if layout_kind == "bshd":
            return x.transpose(1, 2).contiguous().to("cuda", torch.bfloat16).transpose(1, 2)
        return x.permute(2, 0, 1, 3).contiguous().to("cuda", torch.bfloat16).permute(1, 2, 0, 3)

    q, k, v, gate = (torch.randn(B, H, S, head_dim, generator=gen) for _ in range(4))
    sizes = layout.block_sizes
    config = None if tma else {"tma": False}
    for start, end in [(0, layout.num_tiles), (5, 12)]:
        for g in (None, gate):
            args = dict(tile_volume=layout.tile_volume, q_block_sizes=sizes[start:end].cuda(),
                        kv_block_sizes=sizes.cuda(), sparsity=0.75)
            qp, kp, vp = held(_packed(q, layout, start, end)), held(_packed(k, layout)), held(_packed(v, layout))
            gp = None if g is None else held(_packed(g, layout, start, end))
            with mock.patch.object(vsa_triton, "DEFAULT_CONFIG", dict(vsa_triton.DEFAULT_CONFIG, **(config or {}))):
                fast = video_sparse_attention_packed(qp, kp, vp, gate=gp, backend="triton", **args)
                sizes32 = [args[n].to(torch.int32) for n in ("q_block_sizes", "kv_block_sizes")]
                given = video_sparse_attention_packed(  # int32 sizes and offsets given, as the tile plan gives them
                    qp, kp, vp, gate=gp, backend="triton", **dict(args, q_block_sizes=sizes32[0],
                                                                  kv_block_sizes=sizes32[1]),
                    q_block_offsets=packed_offsets(sizes32[0]), kv_block_offsets=packed_offsets(sizes32[1]))
            assert torch.equal(given, fast), "the given tile offsets changed the result"
            # The block list in 64-row steps (the order of the walk over every block) and every block walked.
            one_step = dict(vsa_triton.DEFAULT_CONFIG, **(config or {}), short_steps=())
            with mock.patch.object(vsa_triton, "DEFAULT_CONFIG", one_step):
                listed = video_sparse_attention_packed(qp, kp, vp, gate=gp, backend="triton", **args)
            with mock.patch.object(vsa_triton, "DEFAULT_CONFIG", dict(one_step, skip_empty_blocks=False)):
                walked_all = video_sparse_attention_packed(qp, kp, vp, gate=gp, backend="triton", **args)
            assert torch.equal(listed, walked_all), "skipping the empty key blocks and query blocks moved a bit"
            reference = video_sparse_attention_packed(qp.float(), kp.float(), vp.float(), backend="reference",
                                                      gate=None if gp is None else gp.float(), **args)
            assert fast.dtype == torch.bfloat16 and fast.shape == qp.shape
            torch.testing.assert_close(fast.float(), reference, rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(listed.float(), reference, rtol=2e-2, atol=2e-2, msg="short_steps=()")
            for variant in ({"short_steps": (32,)}, {"short_steps": (16,)}):
                with mock.patch.object(vsa_triton, "DEFAULT_CONFIG",
                                       dict(vsa_triton.DEFAULT_CONFIG, **(config or {}), **variant)):
                    other = video_sparse_attention_packed(qp, kp, vp, gate=gp, backend="triton", **args)
                torch.testing.assert_close(other.float(), reference, rtol=2e-2, atol=2e-2, msg=str(variant))
    if tma:
        assert vsa_triton.tma_applies(qp, kp, vp), "the TMA loads do not apply on this GPU"


_BLOCK_LIST_CHECK = textwrap.dedent("""
    import torch
    from diffusers_sp.kernels.vsa_block_list import key_block_list

    def expected(selected, offsets, sizes, tile_volume, skip_empty, short_steps):
        # Per row: the classes' entries one after the other, and where each class ends.
        block = min(tile_volume, 64)

        def step_class(keys):  # 0: 64-row steps; 1, 2: the short steps' rows (at most that many keys)
            if not short_steps or keys > short_steps[0] or keys <= 0:
                return 0
            return 1 if len(short_steps) == 1 or keys > short_steps[1] else 2

        rows = []
        for chosen in selected.reshape(-1, selected.shape[-1]).tolist():
            classes = [[] for _ in short_steps + (None,)]
            for tile in chosen:
                for part in range(tile_volume // block):
                    keys = int(sizes[tile]) - part * block
                    if keys > 0 or not skip_empty:
                        classes[step_class(keys)].append((int(offsets[tile]) + part * block, min(keys, block)))
            ends = [sum(len(c) for c in classes[:i + 1]) for i in range(len(classes))]
            rows.append((sum(classes, []), ends))
        return rows

    gen = torch.Generator().manual_seed(4)
    for tile_volume, num_tiles, topk in ((64, 9, 4), (128, 11, 5), (256, 7, 3), (256, 30, 17)):
        sizes = torch.randint(1, tile_volume + 1, (num_tiles,), generator=gen, dtype=torch.int32)
        sizes[::3] = tile_volume
        edges = torch.tensor([16, 32, 17, 33, 15, 31], dtype=torch.int32) + (tile_volume // 2 // 64) * 64
        sizes[1:1 + len(edges)] = edges[:num_tiles - 1]  # last blocks of exactly, just above and below a step
        offsets = (torch.cumsum(sizes, 0) - sizes).to(torch.int32)
        selected = torch.stack([torch.randperm(num_tiles, generator=gen)[:topk] for _ in range(2 * 3 * 5)])
        for dtype in (torch.int64, torch.int32):
            sel = selected.view(2, 3, 5, topk).to(DEVICE, dtype)
            for skip_empty, short in ((True, ()), (False, ()), (True, (32, 16)), (True, (32,)), (True, (16,))):
                blocks, counts = key_block_list(sel, offsets.to(DEVICE), sizes.to(DEVICE), tile_volume,
                                                skip_empty=skip_empty, short_steps=short)
                want = expected(selected, offsets, sizes, tile_volume, skip_empty, short)
                assert blocks.dtype == counts.dtype == torch.int32 and counts.shape == (2, 3, 5, 1 + len(short))
                got_ends = counts.view(-1, 1 + len(short)).tolist()
                assert got_ends == [ends for _, ends in want], (tile_volume, skip_empty, short)
                flat = blocks.view(-1, blocks.shape[-2], 2).cpu()
                for row, ends, (w, _) in zip(flat, got_ends, want):
                    assert [tuple(e) for e in row[:ends[-1]].tolist()] == w, (tile_volume, skip_empty, short)
    for bad in ((16, 32), (64,), (32, 16, 8), (48,)):
        try:
            key_block_list(sel, offsets.to(DEVICE), sizes.to(DEVICE), 64, short_steps=bad)
        except ValueError as e:
            assert "short_steps" in str(e)
        else:
            raise AssertionError(f"short_steps={bad} accepted")
    print("block lists ok")
""")


def _block_list_expected_and_got(device):
    result = subprocess.run([sys.executable, "-c", _BLOCK_LIST_CHECK.replace("DEVICE", repr(device))],
                            env=dict(os.environ, TRITON_INTERPRET="1" if device == "cpu" else "0"),
                            capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0 and "block lists ok" in result.stdout, result.stderr[-3000:]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its interpreter runs on CPU)")
def test_key_block_list_in_triton_interpreter():
    """The fine stage's block list (vsa_block_list.key_block_list) equals a loop's: the selected tiles in their
    order, each cut into blocks of min(V, 64) rows, only those holding a key (or all of them, skip_empty=False),
    with each block's first row and key count, and with short steps the blocks of at most 32 / 16 keys listed
    after the others, class by class, with each class's end; bad short steps raise; at 64-, 128- and 256-slot
    tiles, int64 and int32 selections; run by Triton's interpreter on CPU tensors."""
    _block_list_expected_and_got("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only: the Triton kernels need CUDA and Triton")
def test_key_block_list_cuda():
    """GPU-only: the block list as in the interpreter test, compiled."""
    _block_list_expected_and_got("cuda")


def test_fine_stage_launch_blocks():
    """Query rows per program, key columns per step and stages of the fine stage: 64 query rows at every tile
    volume from 64 slots (5 stages with TMA, 2 without), 128 on request (3 stages with TMA); a tile smaller
    than a block is one block; a query block that cannot cover a tile is refused."""
    from diffusers_sp.kernels.vsa_triton import launch_blocks

    assert launch_blocks(64, True) == (64, 64, 5)
    assert launch_blocks(128, True) == (64, 64, 5)
    assert launch_blocks(256, True) == (64, 64, 5)
    assert launch_blocks(256, False) == (64, 64, 2)
    assert launch_blocks(16, True) == (16, 16, 5)
    assert launch_blocks(256, True, {"block_m": 128}) == (128, 64, 3)
    assert launch_blocks(256, True, {"block_m": 128, "num_stages": 4}) == (128, 64, 4)
    for bad in (256, 96, 8):
        with pytest.raises(ValueError, match="block_m must be"):
            launch_blocks(128, True, {"block_m": bad})
    with pytest.raises(ValueError, match="divide the tile volume 64"):
        launch_blocks(64, True, {"block_m": 128})


def test_triton_requirements_message_names_the_cause():
    """The Triton backend's error says what is missing (CPU tensors, no Triton, gradients) rather
    than only the shapes."""
    from diffusers_sp.kernels.vsa_triton import fine_stage_triton, triton_requirements

    layout = make_tile_layout((3, 4, 4), (2, 2, 2))
    _, (qt, kt, vt) = _tiled_qkv(layout, batch=1, heads=2, head_dim=32)
    qt.requires_grad_(True)
    message = triton_requirements(qt, kt, vt)
    assert "device cpu" in message and "requires_grad=True" in message and "Triton" in message
    with pytest.raises(ValueError, match="requires_grad=True"):
        fine_stage_triton(qt, kt, vt, torch.zeros(1, 2, layout.num_tiles, 1, dtype=torch.long),
                          layout.block_sizes, 1.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only: the fine-stage kernels need CUDA")
@pytest.mark.parametrize("backend", ["triton", "flex", "fa4"])
def test_compiled_vsa_equals_eager_cuda(backend):
    """``torch.compile(video_sparse_attention, fullgraph=True)``: the Triton and FA4 fine stages run as
    their custom operators, flex_attention is compiled by the enclosing compile; the output equals
    the eager one (partial tiles, a gate, sparsity 0.9)."""
    from diffusers_sp.kernels import fa4

    if backend == "fa4" and fa4.fa4_block_sparse_applies(*(torch.empty(1, 1, 1, 64, 128, device="cuda",
                                                                       dtype=torch.bfloat16),) * 3):
        pytest.skip("needs flash-attn-4 on Hopper")
    layout = make_tile_layout((5, 10, 9), (4, 4, 4), device="cuda")
    _, (qt, kt, vt) = _tiled_qkv(layout, batch=1, heads=3, head_dim=128, seed=8, dtype=torch.bfloat16, device="cuda")
    gate = torch.randn(qt.shape, generator=torch.Generator().manual_seed(9)).to("cuda", torch.bfloat16)
    kwargs = dict(q_block_sizes=layout.block_sizes, kv_block_sizes=layout.block_sizes, sparsity=0.9, gate=gate,
                  backend=backend)
    torch._dynamo.reset()
    try:
        eager = video_sparse_attention(qt, kt, vt, **kwargs)
        compiled = torch.compile(video_sparse_attention, fullgraph=True)(qt, kt, vt, **kwargs)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(compiled.float(), eager.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kind", ["contiguous", "bshd", "token_major", "ulysses_view", "batch2_bshd"])
def test_row_view_addresses_every_element(kind):
    """The 2-D row view behind the Triton kernel's TMA loads (:func:`~diffusers_sp.kernels.vsa_triton._row_view`)
    puts element ``[b, h, s, :]`` of each layout the processor hands it at row ``b * row_b + h * row_h + s``,
    column ``b * col_b + h * col_h`` of a table with the token stride as its row stride, inside the declared
    ``[rows, cols]``."""
    from diffusers_sp.kernels.vsa_triton import _row_view

    B, H, S, D = (2 if kind == "batch2_bshd" else 1), 3, 5, 8
    if kind == "contiguous":
        t = torch.zeros(B, H, S, D)
    elif kind in ("bshd", "batch2_bshd"):
        t = torch.zeros(B, S, H, D).transpose(1, 2)
    elif kind == "token_major":
        t = torch.zeros(S, B, H, D).permute(1, 2, 0, 3)
    else:  # the second of three tensors of scatter_heads' [S, n, B, h, D] buffer
        t = torch.zeros(S, 3, B, H, D)[:, 1].permute(1, 2, 0, 3)
    rows, cols, (row_b, row_h, col_b, col_h) = _row_view(t)
    for b in range(B):
        for h in range(H):
            for s in range(S):
                row, col = b * row_b + h * row_h + s, b * col_b + h * col_h
                assert row < rows and col + D <= cols
                assert row * t.stride(2) + col == b * t.stride(0) + h * t.stride(1) + s * t.stride(2)
    assert (rows - 1) * t.stride(2) + cols == (B - 1) * t.stride(0) + (H - 1) * t.stride(1) + (S - 1) * t.stride(2) + D
    overlapping = torch.zeros(1, 2, 1, D).as_strided((1, 2, 1, D), (2 * D, D, 4, 1))
    assert _row_view(overlapping) is None
