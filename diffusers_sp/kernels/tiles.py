"""VSA's tile layout and block lists: the arithmetic every VSA backend (reference, flex_attention,
Triton, FlashAttention-4's block-sparse forward) and the VSA processor share.

From "VSA: Faster Video Diffusion with Trainable Sparse Attention" (P. Zhang et al., arXiv
2505.13389): the patchified latent grid ``(T, H, W)`` is cut into cubes of ``tile = (tt, th, tw)``
tokens, tiles ordered t-major, then h, then w, tokens inside a tile in raster order; edge tiles may
be partial (their valid tokens fill the first slots). The block lists here are the (count, indices)
format that flex_attention's ``BlockMask`` and FlashAttention-4's ``BlockSparseTensorsTorch`` share.
This module imports no kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, eq=False)
class TileLayout:
    """How a raster token sequence maps onto VSA tiles.

    Attributes:
        grid: Latent grid ``(T, H, W)`` in tokens; the raster sequence has ``S = T * H * W`` tokens.
        tile: Tile shape ``(tt, th, tw)``.
        num_tiles: Number of tiles ``N = prod(tile_grid)``.
        tile_volume: Slots per tile ``V = tt * th * tw``.
        tile_grid: Tiles per axis ``(ceil(T / tt), ceil(H / th), ceil(W / tw))``.
        block_sizes: LongTensor ``[N]``, the number of valid (non-padded) tokens of each tile, in
            ``[1, V]``; sums to ``S``.
        tiled_index: LongTensor ``[N * V]``; for each tile slot (tile-major), the raster index of the
            token it holds, or -1 for a padded slot. Slot ``j`` of tile ``i`` is valid exactly when
            ``j < block_sizes[i]``.
        raster_to_slot: LongTensor ``[S]``; for each raster token, the tile slot that holds it
            (the inverse of ``tiled_index`` on valid slots).
    """

    grid: tuple[int, int, int]
    tile: tuple[int, int, int]
    num_tiles: int
    tile_volume: int
    tile_grid: tuple[int, int, int]
    block_sizes: torch.Tensor
    tiled_index: torch.Tensor
    raster_to_slot: torch.Tensor

    @property
    def num_tokens(self) -> int:
        """``S = T * H * W``, the length of the raster sequence."""
        return self.grid[0] * self.grid[1] * self.grid[2]


def make_tile_layout(grid, tile=(4, 4, 4), device=None) -> TileLayout:
    """Build the :class:`TileLayout` of a latent grid.

    Args:
        grid: ``(T, H, W)`` token counts of the patchified latent, three ints >= 1.
        tile: ``(tt, th, tw)`` tile shape, three ints >= 1 (VSA's default is ``(4, 4, 4)``, 64 tokens).
        device: Device of the layout's index tensors (default: CPU).

    Returns:
        The layout. Tiles are ordered t-major, then h, then w; inside a tile the valid tokens come
        first, in raster order, and the padded slots of a partial tile last (FastVideo's
        convention, which lets ``block_sizes`` alone say which slots are valid). Examples:
        ``grid=(1, 2, 4), tile=(1, 2, 2)`` gives tiles ``[[0, 1, 4, 5], [2, 3, 6, 7]]``;
        ``grid=(1, 3, 3), tile=(1, 2, 2)`` gives ``[[0, 1, 3, 4], [2, 5, -1, -1], [6, 7, -1, -1],
        [8, -1, -1, -1]]``.

    Raises:
        ValueError: ``grid`` or ``tile`` is not three ints, or has an entry < 1.
    """
    grid = _three_positive_ints("grid", grid)
    tile = _three_positive_ints("tile", tile)
    T, H, W = grid
    tt, th, tw = tile
    tile_grid = (-(-T // tt), -(-H // th), -(-W // tw))
    num_tiles = tile_grid[0] * tile_grid[1] * tile_grid[2]
    tile_volume = tt * th * tw

    def axis_coords(num_axis_tiles: int, tile_len: int) -> torch.Tensor:
        # [num_axis_tiles, tile_len]: coordinate along one axis of each (tile, offset) pair.
        return (torch.arange(num_axis_tiles, device=device)[:, None] * tile_len
                + torch.arange(tile_len, device=device)[None, :])

    # Broadcast to [nt, nh, nw, tt, th, tw]: tile-major, then slot in raster order.
    t = axis_coords(tile_grid[0], tt).view(-1, 1, 1, tt, 1, 1)
    h = axis_coords(tile_grid[1], th).view(1, -1, 1, 1, th, 1)
    w = axis_coords(tile_grid[2], tw).view(1, 1, -1, 1, 1, tw)
    in_grid = ((t < T) & (h < H) & (w < W)).reshape(num_tiles, tile_volume)
    raster = (t * (H * W) + h * W + w).reshape(num_tiles, tile_volume)
    # Pack each tile's valid tokens to its front (a stable sort keeps their raster order), so that
    # slot j of tile i is valid exactly when j < block_sizes[i].
    packed = torch.argsort((~in_grid).to(torch.int8), dim=1, stable=True)
    valid = in_grid.gather(1, packed).reshape(-1)
    tiled_index = torch.where(valid, raster.gather(1, packed).reshape(-1), -1)

    raster_to_slot = torch.empty(T * H * W, dtype=torch.long, device=device)
    raster_to_slot[tiled_index[valid]] = torch.nonzero(valid).squeeze(1)
    block_sizes = in_grid.sum(dim=1)
    return TileLayout(grid=grid, tile=tile, num_tiles=num_tiles, tile_volume=tile_volume,
                      tile_grid=tile_grid, block_sizes=block_sizes, tiled_index=tiled_index,
                      raster_to_slot=raster_to_slot)


def tile_tokens(x: torch.Tensor, layout: TileLayout, dim: int) -> torch.Tensor:
    """Reorder a raster token sequence into VSA tiles.

    Args:
        x: Any tensor whose dimension ``dim`` is the raster sequence of length ``S = T * H * W``,
            e.g. ``[B, H, S, D]`` with ``dim=2``.
        layout: The grid's :class:`TileLayout`.
        dim: The sequence dimension (negative values count from the end).

    Returns:
        ``x`` with dimension ``dim`` replaced by ``[num_tiles, V]`` (e.g. ``[B, H, N, V, D]``),
        same dtype and device; padded slots are zero.

    Raises:
        ValueError: ``dim`` is out of range or ``x.shape[dim] != S``.
    """
    dim = _normalize_dim(dim, x.dim())
    if x.shape[dim] != layout.num_tokens:
        raise ValueError(f"tile_tokens: dimension {dim} of x has {x.shape[dim]} tokens, but the "
                         f"grid {layout.grid} has {layout.num_tokens}")
    tiled_shape = list(x.shape)
    tiled_shape[dim] = layout.num_tiles * layout.tile_volume
    tiled = x.new_zeros(tiled_shape)
    tiled.index_copy_(dim, layout.raster_to_slot.to(x.device), x)
    return tiled.unflatten(dim, (layout.num_tiles, layout.tile_volume))


def untile_tokens(x_tiled: torch.Tensor, layout: TileLayout, dim: int) -> torch.Tensor:
    """Inverse of :func:`tile_tokens`: back to raster order, padded slots dropped.

    Args:
        x_tiled: Tensor with ``[num_tiles, V]`` at dimensions ``dim, dim + 1``
            (e.g. ``[B, H, N, V, D]`` with ``dim=2``).
        layout: The grid's :class:`TileLayout`.
        dim: Where the two tile dimensions start (negative values count from the end and name
            the first of the two).

    Returns:
        ``x_tiled`` with those two dimensions replaced by the raster sequence of length ``S``.

    Raises:
        ValueError: ``dim`` is out of range or the tile dimensions are not ``[num_tiles, V]``.
    """
    dim = _normalize_dim(dim, x_tiled.dim())
    if dim == x_tiled.dim() - 1:
        raise ValueError(f"untile_tokens: dim {dim} is the last dimension; [num_tiles, V] need two")
    expected = (layout.num_tiles, layout.tile_volume)
    if tuple(x_tiled.shape[dim:dim + 2]) != expected:
        raise ValueError(f"untile_tokens: dimensions {dim}, {dim + 1} of x_tiled are "
                         f"{tuple(x_tiled.shape[dim:dim + 2])}, expected [num_tiles, V] = {expected}")
    flat = x_tiled.flatten(dim, dim + 1)
    return flat.index_select(dim, layout.raster_to_slot.to(x_tiled.device))


def tile_range_tokens(layout: TileLayout, tile_start: int, tile_end: int) -> torch.Tensor:
    """Raster indices of the valid tokens of tiles ``[tile_start, tile_end)``, in tile-slot order.

    A rank of the K/V-gather path that owns a contiguous range of whole tiles uses this to pick its
    tokens from the raster sequence (``x.index_select(dim, idx)``).

    Returns:
        LongTensor ``[sum(block_sizes[tile_start:tile_end])]`` on the layout's device.

    Raises:
        ValueError: unless ``0 <= tile_start <= tile_end <= num_tiles``.
    """
    if not 0 <= tile_start <= tile_end <= layout.num_tiles:
        raise ValueError(f"tile range [{tile_start}, {tile_end}) is not inside "
                         f"[0, {layout.num_tiles}) tiles")
    slots = layout.tiled_index[tile_start * layout.tile_volume:tile_end * layout.tile_volume]
    return slots[slots >= 0]


def packed_offsets(block_sizes: torch.Tensor) -> torch.Tensor:
    """Where each tile starts in a packed tile-ordered sequence (its valid tokens only, tile after tile):
    the exclusive running sum of ``block_sizes`` (``[N]`` integers), int32 ``[N]`` on the same device."""
    sizes = block_sizes.to(torch.int32)
    return torch.cumsum(sizes, 0, dtype=torch.int32) - sizes


def packed_slots(block_sizes: torch.Tensor, tile_volume: int, num_tokens: int) -> torch.Tensor:
    """For each token of a packed tile-ordered sequence of ``num_tokens = sum(block_sizes)`` tokens, its slot
    in the padded ``[N * V]`` layout: LongTensor ``[num_tokens]`` on block_sizes' device."""
    sizes = block_sizes.long()
    tile = torch.repeat_interleave(torch.arange(sizes.shape[0], device=sizes.device), sizes, output_size=num_tokens)
    start = (torch.cumsum(sizes, 0) - sizes)[tile]
    return tile * tile_volume + torch.arange(num_tokens, device=sizes.device) - start


def pad_tiles(x: torch.Tensor, slots: torch.Tensor, num_tiles: int, tile_volume: int) -> torch.Tensor:
    """Packed ``[B, H, L, D]`` tile-ordered tokens -> padded tiles ``[B, H, num_tiles, V, D]`` (zero padded
    slots), ``slots`` from :func:`packed_slots`."""
    B, H, _, D = x.shape
    out = x.new_zeros(B, H, num_tiles * tile_volume, D)
    out.index_copy_(2, slots, x)
    return out.view(B, H, num_tiles, tile_volume, D)


def unpad_tiles(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pad_tiles`: ``[B, H, N, V, D]`` -> packed ``[B, H, L, D]`` (valid slots only)."""
    return x.flatten(2, 3).index_select(2, slots)


def vsa_topk(num_kv_tiles: int, sparsity: float) -> int:
    """Number of key tiles each query tile keeps: ``clamp(ceil((1 - sparsity) * N_kv), 1, N_kv)``.

    The product is rounded to 1e-9 before the ceiling, so float noise does not add a tile
    (``vsa_topk(10, 0.9) == 1``).

    Raises:
        ValueError: ``num_kv_tiles < 1`` or ``sparsity`` not in ``[0, 1)``.
    """
    if num_kv_tiles < 1:
        raise ValueError(f"num_kv_tiles must be >= 1, got {num_kv_tiles}")
    _check_sparsity(sparsity)
    keep = math.ceil(round((1.0 - sparsity) * num_kv_tiles, 9))
    return min(max(keep, 1), num_kv_tiles)


def block_lists(selected: torch.Tensor, keep: torch.Tensor, num_kv_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The selected tiles where ``keep`` holds, as a (count, indices) pair: the block-list format that
    flex_attention's ``BlockMask`` and FlashAttention-4's ``BlockSparseTensorsTorch`` share.

    ``selected``, ``keep``: ``[..., topk]``. Returns int32 ``[...]`` counts and int32
    ``[..., Nk]`` indices: the kept tiles in ascending order, then filler.
    """
    # Offsetting the others by Nk sorts every kept tile before them.
    ordered = torch.where(keep, selected, selected + num_kv_tiles).sort(dim=-1).values % num_kv_tiles
    indices = F.pad(ordered.to(torch.int32), (0, num_kv_tiles - selected.shape[-1]))
    return keep.sum(dim=-1, dtype=torch.int32), indices


def _check_sparsity(sparsity: float) -> None:
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")


def _three_positive_ints(name: str, values) -> tuple[int, int, int]:
    values = tuple(int(x) for x in values)
    if len(values) != 3 or any(x < 1 for x in values):
        raise ValueError(f"{name} must be three ints >= 1 (T, H, W order), got {values}")
    return values


def _normalize_dim(dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        raise ValueError(f"dim {dim} is out of range [{-ndim}, {ndim})")
    return dim % ndim
