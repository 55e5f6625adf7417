"""Ulysses sequence parallelism: all-to-all from sequence shards to head shards and back.

From DeepSpeed-Ulysses (Jacobs et al., "DeepSpeed Ulysses: System Optimizations for Enabling
Training of Extreme Long Sequence Transformer Models", arXiv 2309.14509). Each rank sends every
other rank that rank's heads of its Q, K, V shard (one all-to-all for the three), attends over the
full sequence for its own heads, and an all-to-all sends the output rows back to the ranks that own
those tokens. Heads that do not divide the world size are split unevenly (balanced), which is exact;
token shards may be uneven too.
"""

from __future__ import annotations

import torch

from ..comm import all_to_all_flat
from ..kernels.sdpa import local_attention
from ..sharding import balanced_sizes
from .base import SequenceParallelAttnProcessor


def ulysses_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sizes: list[int], group, *,
                      scale: float | None = None, kernel: str = "auto") -> torch.Tensor:
    """Ulysses attention over a sequence sharded across ``group``.

    Args:
        query, key, value: ``[B, H, S_r, D]``, this rank's token shard (``S_r = sizes[rank]``),
            any float dtype; same on every rank except ``S_r``.
        sizes: Tokens per rank, ``sum(sizes) = S``.
        group: :class:`~diffusers_sp.groups.SPGroup` of P ranks, ``H >= P``.
        scale: Softmax scale (``None``: ``1/sqrt(D)``).
        kernel: Local kernel name (see :func:`~diffusers_sp.kernels.sdpa.local_attention`).

    Returns:
        ``[B, H, S_r, D]``: this rank's rows of softmax(Q Kᵀ·scale) V over all S tokens.

    Communication per rank: Q, K, V in one all-to-all, O in a second.
    """
    P, r = group.world_size, group.rank
    B, H, S_r, D = query.shape
    if P == 1:
        return local_attention(query, key, value, scale=scale, kernel=kernel)
    heads = balanced_sizes(H, P)
    h_r = heads[r]
    # [H, 3, B, S_r, D]: heads outermost, so the chunk for rank j is contiguous (one copy).
    send = torch.stack([t.permute(1, 0, 2, 3) for t in (query, key, value)], dim=1)
    unit = 3 * B * D
    recv = all_to_all_flat(send.reshape(-1), [h * unit * S_r for h in heads], [h_r * unit * s for s in sizes], group)
    # Chunk from rank i is [h_r, 3, B, S_i, D]; concatenating along the tokens gives [h_r, 3, B, S, D].
    chunks = [c.view(h_r, 3, B, s, D) for c, s in zip(recv.split([h_r * unit * s for s in sizes]), sizes)]
    full = torch.cat(chunks, dim=3)
    q, k, v = (full[:, i].permute(1, 0, 2, 3) for i in range(3))
    out = local_attention(q, k, v, scale=scale, kernel=kernel)  # [B, h_r, S, D]
    # Back: [S, B, h_r, D] so that the rows owned by rank i are contiguous.
    send_o = out.permute(2, 0, 1, 3).contiguous()
    recv_o = all_to_all_flat(send_o.reshape(-1), [s * B * h_r * D for s in sizes], [S_r * B * h * D for h in heads],
                             group)
    parts = [c.view(S_r, B, h, D) for c, h in zip(recv_o.split([S_r * B * h * D for h in heads]), heads)]
    return torch.cat(parts, dim=2).permute(1, 2, 0, 3)  # [B, H, S_r, D]


class UlyssesAttnProcessor(SequenceParallelAttnProcessor):
    """Attention processor running the model's own processor with Ulysses sequence parallelism.

    Wraps ``inner`` (the model's processor); tensors in the taken-over attention call are
    ``[B, H, S_r, D]`` this rank's token shard. See :func:`ulysses_attention` for the algorithm,
    and :class:`~diffusers_sp.processors.base.SequenceParallelAttnProcessor` for the arguments.
    """

    strategy = "ulysses"

    def parallel_attention(self, query, key, value, sizes, *, scale):
        return ulysses_attention(query, key, value, sizes, self.state.group, scale=scale, kernel=self.kernel)
