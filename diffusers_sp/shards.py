"""Shard arithmetic: how S tokens (or H heads) fall on P ranks, and a reordering of the tokens.

Shards are balanced and may be uneven: with S tokens and P ranks, rank r gets
``S // P + (r < S % P)`` tokens, in rank order (the split of ``torch.tensor_split``). This module
depends on torch alone, so every layer may use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def balanced_sizes(total: int, parts: int) -> list[int]:
    """Sizes of ``parts`` balanced shards of ``total`` items: the first ``total % parts`` get one more.

    The same split as ``torch.tensor_split(x, parts)``; used for tokens and for Ulysses heads.
    """
    base, extra = divmod(int(total), int(parts))
    return [base + (1 if i < extra else 0) for i in range(parts)]


def shard(x: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    """This rank's balanced shard of ``x`` along ``dim`` (a view, no copy)."""
    sizes = balanced_sizes(x.shape[dim], world_size)
    return x.narrow(dim, sum(sizes[:rank]), sizes[rank])


@dataclass(frozen=True)
class TokenOrder:
    """A reordering of the sequence applied before it is sharded, and undone when it is gathered.

    Used by video sparse attention: tokens are put in tile order so that every rank owns whole
    tiles (see :mod:`diffusers_sp.processors.vsa`). Everything a transformer does outside attention
    is per token (norms, MLPs, modulation, RoPE with its tables reordered alike), so running the
    blocks on a reordered sequence is exact.

    Attributes:
        perm: ``LongTensor [S]``: ``perm[i]`` is the original (raster) index of the i-th token in the
            new order.
        inverse: ``LongTensor [S]``: the inverse permutation.
        sizes: Tokens held by each rank, in the new order (``sum(sizes) == S``).
    """

    perm: torch.Tensor
    inverse: torch.Tensor
    sizes: tuple[int, ...]
