"""Tests of VSA's coarse-stage Triton kernels (diffusers_sp.kernels.vsa_coarse_triton): tile means, tile
scores with the coarse output, and the radix top-k selection.

On the GPU the kernels run compiled. Where Triton is importable without a GPU, its interpreter
(``TRITON_INTERPRET=1``, in a subprocess: it must be set before the kernels are defined) runs the means and
top-k kernels on CPU tensors, and from Triton 3.9 on the whole three-launch stage; the scores kernel's loop over
a runtime bound does not run in Triton 3.6's interpreter (its scalar arguments are one-element arrays, which
NumPy 2.4 no longer turns into an index), so there the scores kernel is tested on the GPU only.
"""

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from unittest import mock

import pytest
import torch

from diffusers_sp.kernels import vsa
from diffusers_sp.kernels.tiles import packed_offsets, tile_range_tokens
from diffusers_sp.kernels.vsa import make_tile_layout, tile_tokens, vsa_topk

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only: the Triton kernels need CUDA and Triton")


def _packed(x, layout, start=0, end=None):
    """Raster ``[B, H, S, D]`` -> the valid tokens of tiles ``[start, end)``, tile after tile."""
    end = layout.num_tiles if end is None else end
    return x.index_select(2, tile_range_tokens(layout, start, end).to(x.device))


def _as_sets(selected):
    return [set(row) for row in selected.reshape(-1, selected.shape[-1]).tolist()]


def _tie_rows():
    """Score rows with ties at the k-th value, negative values, zeros of both signs and a NaN; k = 3."""
    rows = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.5, -1.0, -3.0, 2.0],
                         [-1.0, -2.0, -2.0, -2.0, -0.5, 1.0, 3.0, -2.0],
                         [0.0, -0.0, 0.0, 0.0, 0.0, -0.0, 0.0, 0.0],
                         [1.0, 2.0, 2.0, float("nan"), 0.5, -1.0, -3.0, 2.0],
                         [-5.0, -4.0, -3.0, -2.0, -1.0, -6.0, -7.0, -8.0]])
    expected = [{1, 2, 3}, {4, 5, 6}, {0, 2, 3}, {1, 2, 3}, {2, 3, 4}]
    return rows, expected


def _prefix_rows():
    """Score rows whose keys share long leading bits (one sign, a narrow range), rows of equal scores, -inf
    scores and many ties, with the expected selection of each k: the k largest, ties to the lower index."""
    gen = torch.Generator().manual_seed(5)
    rows = torch.cat([torch.rand(2, 45, generator=gen) * 1e-3 + 1.0,       # 1.0 to 1.001: ~20 common bits
                      -torch.rand(2, 45, generator=gen) - 4.0,              # negatives, one exponent
                      torch.randint(0, 3, (2, 45), generator=gen).float(),  # three values: ties at most k
                      torch.full((1, 45), 0.25), torch.randn(1, 45, generator=gen)])
    rows[-1, :30] = float("-inf")
    expected = {}
    for topk in (1, 7, 22, 44, 45):
        sets = []
        for row in rows.tolist():
            order = sorted(range(len(row)), key=lambda i: (-row[i], i))  # stable: the lower index first
            sets.append(set(order[:topk]))
        expected[topk] = sets
    return rows, expected


@cuda
def test_triton_tile_means_cuda():
    """GPU-only: the tile-means kernel equals the float32 mean of each packed tile's tokens, alone and in the
    one launch for q (a range of tiles), k and v."""
    from diffusers_sp.kernels.vsa_coarse_triton import _launch_means, tile_means_triton

    layout = make_tile_layout((9, 20, 18), (4, 8, 8))
    gen = torch.Generator().manual_seed(16)
    x = [torch.randn(2, 3, layout.num_tokens, 128, generator=gen).to("cuda", torch.bfloat16) for _ in range(3)]
    sizes = layout.block_sizes.to("cuda", torch.int32)
    offsets = packed_offsets(sizes)
    expected = [vsa._tile_means(tile_tokens(t.float(), layout, dim=2), sizes.long()) for t in x]
    torch.testing.assert_close(tile_means_triton(_packed(x[0], layout), offsets, sizes, layout.tile_volume),
                               expected[0], rtol=1e-5, atol=1e-5)
    q_tiles = (packed_offsets(sizes[3:10]), sizes[3:10])
    for heads in (1, 2, 3):  # heads per program; 2 leaves a partial group of the 3 heads
        means = _launch_means((_packed(x[0], layout, 3, 10), _packed(x[1], layout), _packed(x[2], layout)),
                              q_tiles, (offsets, sizes), layout.tile_volume, {"mean_heads": heads})
        for got, want in zip(means, (expected[0][:, :, 3:10], expected[1], expected[2])):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@cuda
@pytest.mark.parametrize("tile,head_dim", [((4, 4, 4), 128), ((2, 2, 4), 64), ((4, 8, 8), 128), ((2, 2, 2), 32)])
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9])
def test_triton_coarse_stage_cuda(tile, head_dim, sparsity):
    """GPU-only: the coarse stage (means, scores, top-k, coarse output) on packed tiles in the ``[B, S, H, D]``
    layout of the model, all query tiles and a range of them: the selected key tiles are the top-k of
    torch's float32 products of the same means (as sets; increasing and distinct), and the coarse output is
    ``softmax(scale * products) @ v_means``."""
    from diffusers_sp.kernels.vsa_coarse_triton import _launch_coarse, coarse_stage_triton, tile_means_triton

    layout = make_tile_layout((5, 10, 9) if tile[1] < 8 else (9, 20, 18), tile)
    gen = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(2, 3, layout.num_tokens, head_dim, generator=gen).transpose(1, 2).contiguous()
               .to("cuda", torch.bfloat16).transpose(1, 2) for _ in range(3))
    sizes = layout.block_sizes.to("cuda", torch.int32)
    offsets = packed_offsets(sizes)
    scale = head_dim ** -0.5
    topk = vsa_topk(layout.num_tiles, sparsity)
    for start, end in [(0, layout.num_tiles), (4, 11)]:
        qp = _packed(q, layout, start, end)
        kp, vp = _packed(k, layout), _packed(v, layout)
        q_sizes = sizes[start:end]
        for with_output in (False, True):
            selected, coarse = coarse_stage_triton(
                qp, kp, vp, q_offsets=packed_offsets(q_sizes), q_sizes=q_sizes, kv_offsets=offsets, kv_sizes=sizes,
                tile_volume=layout.tile_volume, topk=topk, scale=scale, with_output=with_output)
            q_mean = tile_means_triton(qp, packed_offsets(q_sizes), q_sizes, layout.tile_volume)
            k_mean, v_mean = (tile_means_triton(x, offsets, sizes, layout.tile_volume) for x in (kp, vp))
            products = q_mean.double() @ k_mean.double().transpose(-1, -2)
            assert selected.dtype == torch.int32 and selected.shape == (2, 3, end - start, topk)
            assert bool((selected.diff(dim=-1) > 0).all()), "indices not increasing"
            assert _as_sets(selected) == _as_sets(products.topk(topk, dim=-1).indices)
            if with_output:
                expected = torch.softmax(products * scale, dim=-1) @ v_mean.double()
                torch.testing.assert_close(coarse.double(), expected, rtol=1e-5, atol=1e-5)
                # The coarse output's product in one TF32 pass (an option): the same selection, the output
                # within TF32's rounding of the probabilities and value means.
                q_offsets = packed_offsets(q_sizes)
                sel_tf32, coarse_tf32 = _launch_coarse(qp, kp, vp, q_offsets, q_sizes, offsets, sizes,
                                                       layout.tile_volume, topk, scale, True,
                                                       {"output_precision": "tf32"})
                assert torch.equal(sel_tf32, selected)
                error = ((coarse_tf32.double() - expected).norm() / expected.norm()).item()
                assert 0 < error < 2e-3, error
            else:
                assert coarse is None


@cuda
def test_triton_topk_ties_and_long_rows_cuda():
    """GPU-only: the radix selection on rows with ties at the k-th value (lower indices win), negatives,
    signed zeros and a NaN (largest), keys sharing long leading bits, equal rows and -inf, at several rows per
    program, with and without the early exit; rows past MAX_SELECT_TILES go to
    torch.topk with the same sets."""
    from diffusers_sp.kernels import vsa_coarse_triton
    from diffusers_sp.kernels.vsa_coarse_triton import topk_tiles_triton

    rows, expected = _tie_rows()
    for per_program, bits in ((1, 2), (2, 2), (8, 2), (1, 1), (4, 4)):
        for early_exit in (True, False):
            got = topk_tiles_triton(rows.cuda(), 3, rows_per_program=per_program, bits_per_step=bits,
                                    early_exit=early_exit)
            assert _as_sets(got) == expected, (per_program, bits, early_exit)
    rows, expected = _prefix_rows()
    for topk, sets in expected.items():
        for per_program, bits, early_exit in ((1, 1, True), (1, 1, False), (4, 2, True), (2, 4, True)):
            got = topk_tiles_triton(rows.cuda(), topk, rows_per_program=per_program, bits_per_step=bits,
                                    early_exit=early_exit)
            assert _as_sets(got) == sets, (topk, per_program, bits, early_exit)
            assert bool((got.diff(dim=-1) > 0).all())
    scores = torch.randn(2, 5, 300, 1000, generator=torch.Generator().manual_seed(3)).cuda()
    reference = _as_sets(scores.topk(37, dim=-1).indices)
    assert _as_sets(topk_tiles_triton(scores, 37)) == reference
    with mock.patch.object(vsa_coarse_triton, "MAX_SELECT_TILES", 512):
        assert _as_sets(topk_tiles_triton(scores, 37)) == reference


_INTERPRETED = textwrap.dedent("""
    import torch
    from diffusers_sp.kernels import vsa
    from diffusers_sp.kernels.tiles import make_tile_layout, packed_offsets, tile_range_tokens, tile_tokens
    from diffusers_sp.kernels.vsa_coarse_triton import _launch_coarse, _launch_means, topk_tiles_triton

    rows, expected = ROWS, EXPECTED
    for per_program, bits in ((1, 2), (2, 1), (8, 2), (1, 4)):
        for early_exit in (True, False):
            got = topk_tiles_triton(rows, 3, rows_per_program=per_program, bits_per_step=bits,
                                    early_exit=early_exit)
            got = [set(r) for r in got.tolist()]
            assert got == expected, (per_program, bits, early_exit, got)
    rows, expected = PREFIX_ROWS, PREFIX_EXPECTED
    for topk, sets in expected.items():
        for per_program, bits, early_exit in ((1, 1, True), (1, 1, False), (4, 2, True), (2, 4, True)):
            got = topk_tiles_triton(rows, topk, rows_per_program=per_program, bits_per_step=bits,
                                    early_exit=early_exit)
            assert [set(r) for r in got.tolist()] == sets, (topk, per_program, bits, early_exit)
    scores = torch.randn(3, 7, 50, generator=torch.Generator().manual_seed(1))
    for topk, bits in ((1, 2), (9, 2), (50, 2), (9, 1), (9, 4)):
        got = topk_tiles_triton(scores, topk, rows_per_program=4, bits_per_step=bits)
        assert bool((got.diff(dim=-1) > 0).all())
        assert [set(r) for r in got.view(-1, topk).tolist()] == \\
            [set(r) for r in scores.topk(topk, dim=-1).indices.view(-1, topk).tolist()]
    layout = make_tile_layout((5, 6, 7), (2, 2, 4))
    gen = torch.Generator().manual_seed(2)
    x = [torch.randn(2, 3, layout.num_tokens, 32, generator=gen).to(torch.bfloat16) for _ in range(3)]
    sizes = layout.block_sizes.to(torch.int32)
    order = tile_range_tokens(layout, 0, layout.num_tiles)
    for heads in (1, 2, 3):  # heads per program; 2 leaves a partial group of the 3 heads
        means = _launch_means([t.index_select(2, order) for t in x], (packed_offsets(sizes), sizes),
                              (packed_offsets(sizes), sizes), layout.tile_volume, {"mean_heads": heads})
        for got, t in zip(means, x):
            want = vsa._tile_means(tile_tokens(t.float(), layout, dim=2), sizes.long())
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    import triton
    if tuple(int(part) for part in triton.__version__.split(".")[:2]) >= (3, 9):
        # Triton 3.9's interpreter runs the scores kernel's loop over a runtime bound (3.6's cannot): the three
        # launches against float64 products of the tile means, all and a range of query tiles (partial tiles),
        # with and without the coarse output.
        q_mean, k_mean, v_mean = (vsa._tile_means(tile_tokens(t.float(), layout, dim=2), sizes.long()).double()
                                  for t in x)
        kp, vp = (t.index_select(2, order) for t in x[1:])
        for start, end, topk, with_output in ((0, layout.num_tiles, 5, True), (3, 11, 1, False), (3, 11, 18, True)):
            q_sizes = sizes[start:end]
            qp = x[0].index_select(2, tile_range_tokens(layout, start, end))
            selected, coarse = _launch_coarse(qp, kp, vp, packed_offsets(q_sizes), q_sizes, packed_offsets(sizes),
                                              sizes, layout.tile_volume, topk, 32 ** -0.5, with_output)
            products = q_mean[:, :, start:end] @ k_mean.transpose(-1, -2)
            assert [set(r) for r in selected.view(-1, topk).tolist()] == \
                [set(r) for r in products.topk(topk, dim=-1).indices.view(-1, topk).tolist()], (start, topk)
            assert bool((selected.diff(dim=-1) > 0).all())
            if with_output:
                expected = torch.softmax(products * 32 ** -0.5, dim=-1) @ v_mean
                torch.testing.assert_close(coarse.double(), expected, rtol=1e-5, atol=1e-5)
        print("three-launch coarse stage interpreted")
    print("interpreted kernels ok")
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its interpreter runs on CPU)")
def test_coarse_kernels_in_triton_interpreter():
    """The top-k kernel (ties, negatives, signed zeros, NaN, keys sharing long leading bits, equal rows, -inf;
    one and several rows per program; radix digits of 1, 2 and 4 bits; with and without the early exit; k of 1,
    some and all), the three-tensor means kernel (one, two and three heads per program) and, from Triton 3.9
    on, the three launches of the coarse stage (partial tiles, all and a range of query tiles, with and without
    the output), run by Triton's interpreter on CPU tensors."""
    rows, expected = _tie_rows()
    literal = repr(rows.tolist()).replace("nan", "float('nan')")
    prefix_rows, prefix_expected = _prefix_rows()
    prefix_literal = repr(prefix_rows.tolist()).replace("-inf", "float('-inf')")
    script = (_INTERPRETED.replace("PREFIX_ROWS", f"torch.tensor({prefix_literal})")
              .replace("PREFIX_EXPECTED", repr(prefix_expected))
              .replace("ROWS", f"torch.tensor({literal})").replace("EXPECTED", repr(expected)))
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0 and "interpreted kernels ok" in result.stdout, result.stderr[-3000:]
    triton_version = tuple(int(part) for part in importlib.metadata.version("triton").split(".")[:2])
    assert ("three-launch coarse stage interpreted" in result.stdout) == (triton_version >= (3, 9)), result.stdout
