"""The block list of video sparse attention's (VSA) fine stage: for each query tile, the key blocks of its
selected key tiles that hold a key, as one small Triton kernel over the coarse stage's top-k indices.

Both fine-stage kernels (:mod:`~diffusers_sp.kernels.vsa_triton` and the warp-specialised
:mod:`~diffusers_sp.kernels.vsa_gluon`) walk this list instead of every block of every selected tile, so the
blocks past a partial tile's end are neither loaded nor multiplied. With short steps, the blocks at the end of a
partial tile that hold at most 32 (or 16) keys are listed after the others, so that the Triton fine stage walks
them in steps of that many rows instead of 64 rows mostly masked. VSA: P. Zhang et al., arXiv 2505.13389.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship without Triton
    triton = None
    tl = None

#: Key rows a block: key tiles of more slots are walked in blocks of this many.
BLOCK = 64


def key_block_list(selected: torch.Tensor, kv_offsets: torch.Tensor, kv_sizes: torch.Tensor, tile_volume: int, *,
                   skip_empty: bool = True, short_steps: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """The key blocks each query tile's fine stage walks: the selected key tiles, in ``selected``'s order, each
    cut into blocks of ``min(V, 64)`` rows, and of those only the ones that hold a key (a partial tile of the
    packed layout ends early, so its last blocks hold none).

    Args:
        selected: Integer ``[B, H, Nq, topk]`` key-tile indices in ``[0, Nk)``, CUDA.
        kv_offsets, kv_sizes: int32 ``[Nk]``: where each key tile starts and its token count.
        tile_volume: ``V``.
        skip_empty: False lists every block of every selected tile (empty ones with a key count <= 0), the
            walk before the list existed; for benchmarks.
        short_steps: Row counts of shorter steps, descending, each below ``min(V, 64)`` (for example
            ``(32, 16)``): a block of at most ``short_steps[c]`` keys (and more than ``short_steps[c + 1]``) is
            listed in class ``c + 1``, after every block of the classes before it, so that the fine stage walks
            it in a step of that many rows; class 0 holds the other blocks. Empty: one class, the list order
            above. Within a class the blocks keep the order above.

    Returns:
        ``(blocks, counts)``: int32 ``[B, H, Nq, topk * P, 2]`` (P blocks a tile) whose entry ``e`` below the
        last count is ``(first key row, keys that count)`` of the e-th block walked, entries past it unset; int32
        ``[B, H, Nq, 1 + len(short_steps)]``: where each class of entries ends (class ``c`` is entries
        ``counts[..., c - 1]`` to ``counts[..., c]``; the last is the list's length, at least 1: a tile's first
        block holds at least one key).

    Raises:
        ValueError: ``short_steps`` is not descending, has more than two entries, or one is not a power of two
            in [16, min(V, 64)), or is given with ``skip_empty=False``.
    """
    block_n = min(tile_volume, BLOCK)
    short_steps = tuple(short_steps)
    if (len(short_steps) > 2 or list(short_steps) != sorted(set(short_steps), reverse=True)
            or any(r not in (16, 32) or r >= block_n for r in short_steps)):
        raise ValueError(f"short_steps must be descending row counts from (32, 16), each below {block_n}; "
                         f"got {short_steps}")
    if short_steps and not skip_empty:  # an empty block first in its class would start the softmax on -inf
        raise ValueError("short_steps needs skip_empty=True")
    parts = tile_volume // block_n
    selected = selected.contiguous()
    B, H, num_q_tiles, topk = selected.shape
    blocks = torch.empty((B, H, num_q_tiles, topk * parts, 2), device=selected.device, dtype=torch.int32)
    counts = torch.empty((B, H, num_q_tiles, 1 + len(short_steps)), device=selected.device, dtype=torch.int32)
    num_rows = B * H * num_q_tiles
    width = triton.next_power_of_2(topk)
    rows = max(1, min(16, 1024 // width))  # rows of selections a program: about 1024 entries
    bounds = tuple(short_steps) + (0,) * (2 - len(short_steps))
    _key_blocks_kernel[(triton.cdiv(num_rows, rows),)](
        selected, kv_offsets, kv_sizes, blocks, counts, num_rows, topk, ROWS=rows, TOPK=width, BLOCK_N=block_n,
        PARTS=parts, SKIP_EMPTY=skip_empty, CLASSES=1 + len(short_steps), SHORT_A=bounds[0], SHORT_B=bounds[1],
        num_warps=min(8, max(4, rows * width // 256)))
    return blocks, counts


if triton is not None:

    @triton.jit
    def _block_class(keys, walked, CLS: tl.constexpr, SHORT_A: tl.constexpr, SHORT_B: tl.constexpr):
        # Whether blocks of `keys` keys (walked: listed at all) fall in step class CLS (see key_block_list):
        # class 0 above SHORT_A keys (every block where SHORT_A is 0) and the empty blocks of skip_empty=False,
        # class 1 above SHORT_B and at most SHORT_A, class 2 above 0 and at most SHORT_B.
        if CLS == 0:
            if SHORT_A == 0:
                chosen = walked
            else:
                chosen = walked & ((keys > SHORT_A) | (keys <= 0))
        elif CLS == 1:
            chosen = walked & (keys <= SHORT_A) & (keys > SHORT_B) & (keys > 0)
        else:
            chosen = walked & (keys <= SHORT_B) & (keys > 0)
        return chosen

    @triton.jit
    def _key_blocks_kernel(Sel, KOff, KSizes, Blocks, Counts, num_rows, topk, ROWS: tl.constexpr,
                           TOPK: tl.constexpr, BLOCK_N: tl.constexpr, PARTS: tl.constexpr, SKIP_EMPTY: tl.constexpr,
                           CLASSES: tl.constexpr, SHORT_A: tl.constexpr, SHORT_B: tl.constexpr):
        # One program per ROWS rows (query tiles) of Sel [num_rows, topk]: each selected tile's blocks, class after
        # class, in tile order within a class (see key_block_list).
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, TOPK)
        ok = (rows < num_rows)[:, None] & (cols < topk)[None, :]
        tile = tl.load(Sel + rows.to(tl.int64)[:, None] * topk + cols[None, :], mask=ok, other=0)
        size = tl.load(KSizes + tile, mask=ok, other=0)
        start = tl.load(KOff + tile, mask=ok, other=0)
        if SKIP_EMPTY:
            walked = (size + BLOCK_N - 1) // BLOCK_N
        else:
            walked = tl.where(ok, PARTS, 0)
        row0 = rows.to(tl.int64)[:, None] * (topk * PARTS)
        end = tl.zeros([ROWS], dtype=tl.int32)  # entries of the classes listed so far, per row
        for cls in tl.static_range(CLASSES):
            in_tile = tl.zeros([ROWS, TOPK], dtype=tl.int32)  # this class's blocks of each selected tile
            for part in tl.static_range(PARTS):
                keys = tl.minimum(size - part * BLOCK_N, BLOCK_N)
                in_tile += _block_class(keys, ok & (part < walked), cls, SHORT_A, SHORT_B).to(tl.int32)
            entry = row0 + end[:, None] + tl.cumsum(in_tile, 1) - in_tile
            for part in tl.static_range(PARTS):
                keys = tl.minimum(size - part * BLOCK_N, BLOCK_N)
                listed = _block_class(keys, ok & (part < walked), cls, SHORT_A, SHORT_B)
                tl.store(Blocks + entry * 2, start + part * BLOCK_N, mask=listed)
                tl.store(Blocks + entry * 2 + 1, keys, mask=listed)
                entry += listed.to(tl.int64)
            end += tl.sum(in_tile, 1)
            tl.store(Counts + rows * CLASSES + cls, end, mask=rows < num_rows)
