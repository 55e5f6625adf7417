"""K/V-gather sequence parallelism: all-gather K and V; queries and outputs never move.

Each rank keeps its query shard, all-gathers the keys and values of every rank (one collective
for both), and attends over the full sequence. Exact for any head count and any sequence length;
uneven shards are gathered padded and the padding dropped. The same scheme is used for long-context
inference in, e.g., Meta's context parallelism for Llama 3 ("all-gather based pass-KV", arXiv
2411.01783) and in sglang's diffusion runtime.
"""

from __future__ import annotations

import torch

from ..comm import all_gather_dim0
from ..kernels.sdpa import local_attention
from .base import SequenceParallelAttnProcessor


def gather_kv(key: torch.Tensor, value: torch.Tensor, sizes: list[int], group) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gathers K and V shards of ``[B, H, S_r, D]`` into full ``[B, H, S, D]`` tensors (one collective).

    The returned tensors are views with a contiguous last dim (token-major storage).
    """
    if group.world_size == 1:
        return key, value
    kv = torch.stack([key.permute(2, 0, 1, 3), value.permute(2, 0, 1, 3)], dim=1)  # [S_r, 2, B, H, D]
    full = all_gather_dim0(kv, sizes, group)  # [S, 2, B, H, D]
    return full[:, 0].permute(1, 2, 0, 3), full[:, 1].permute(1, 2, 0, 3)


def kv_gather_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sizes: list[int], group, *,
                        scale: float | None = None, kernel: str = "auto") -> torch.Tensor:
    """K/V-gather attention over a sequence sharded across ``group``.

    Args:
        query, key, value: ``[B, H, S_r, D]``, this rank's token shard (``S_r = sizes[rank]``).
        sizes: Tokens per rank, ``sum(sizes) = S``.
        group: :class:`~diffusers_sp.groups.SPGroup` of P ranks (no constraint on H).
        scale: Softmax scale (``None``: ``1/sqrt(D)``).
        kernel: Local kernel name.

    Returns:
        ``[B, H, S_r, D]``: this rank's rows of softmax(Q Kᵀ·scale) V over all S tokens.
    """
    k, v = gather_kv(key, value, sizes, group)
    return local_attention(query, k, v, scale=scale, kernel=kernel)


class KVGatherAttnProcessor(SequenceParallelAttnProcessor):
    """Attention processor running the model's own processor with K/V-gather sequence parallelism.

    See :func:`kv_gather_attention` for the algorithm and
    :class:`~diffusers_sp.processors.base.SequenceParallelAttnProcessor` for the arguments.
    """

    strategy = "kv_gather"

    def parallel_attention(self, query, key, value, sizes, *, scale):
        return kv_gather_attention(query, key, value, sizes, self.state.group, scale=scale, kernel=self.kernel)
