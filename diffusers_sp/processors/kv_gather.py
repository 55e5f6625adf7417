"""K/V-gather sequence parallelism: all-gather K and V; queries and outputs never move.

Each rank keeps its query shard, all-gathers the keys and values of every rank (token-major, so
nothing is copied before the collectives at batch 1), and attends over the full sequence. Exact
for any head count and any sequence length; uneven shards are gathered padded and the padding
dropped. Joint attention: the replicated text K/V is joined once (not P times) to the gathered
image K/V, and each rank computes the text query rows itself (redundant across ranks, exact). Key
padding masks cover the full key sequence, so ragged (varlen) text batches are exact too. The same
scheme is used for long-context inference in, e.g., Meta's context parallelism for Llama 3
("all-gather based pass-KV", arXiv 2411.01783) and in sglang's diffusion runtime (which, unlike
this module, refuses varlen batches).
"""

from __future__ import annotations

import torch

from ..comm import all_gather_dim0
from ..kernels.sdpa import local_attention
from .base import SequenceParallelAttnProcessor, join_text_image, split_text_image


def gather_kv(key: torch.Tensor, value: torch.Tensor, sizes: list[int], group) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gathers K and V shards of ``[B, H, S_r, D]`` into full ``[B, H, S, D]`` tensors.

    K and V travel token-major (``[S_r, B, H, D]``), one all-gather each. Diffusers' models hand the
    attention K and V stored as ``[B, S, H, D]``, which for batch 1 is already token-major, so
    nothing is copied before the collectives (one copy each otherwise, and a padded copy on the
    ranks with the shorter shard when the shards are uneven). The returned tensors are
    ``[B, H, S, D]`` views of the gathered ``[S, B, H, D]`` buffers.
    """
    if group.world_size == 1:
        return key, value
    return tuple(all_gather_dim0(t.permute(2, 0, 1, 3), sizes, group).permute(1, 2, 0, 3) for t in (key, value))


def kv_gather_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sizes: list[int], group, *,
                        scale: float | None = None, kernel: str = "auto", text_len: int = 0,
                        text_layout: str | None = None, key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """K/V-gather attention over a sequence sharded across ``group``, with optional joint text tokens.

    Args:
        query, key, value: ``[B, H, T + S_r, D]``: ``T = text_len`` replicated text tokens and this
            rank's image shard (``S_r = sizes[rank]``) in the order of ``text_layout``.
        sizes: Image tokens per rank, ``sum(sizes) = S``.
        group: :class:`~diffusers_sp.groups.SPGroup` of P ranks (no constraint on H).
        scale: Softmax scale (``None``: ``1/sqrt(D)``).
        kernel: Local kernel name.
        text_len: T (0: no text in the sequence).
        text_layout: ``"prefix"`` (text first) or ``"suffix"`` (text last); ignored when T = 0.
        key_mask: ``None`` or a key padding mask ``[B or 1, H or 1, 1, T + S]`` over the full key
            sequence in the same order (bool True = attend, or additive float).

    Returns:
        ``[B, H, T + S_r, D]``: this rank's rows of softmax(Q Kᵀ·scale + mask) V over all T + S keys.
    """
    txt_k, img_k = split_text_image(key, text_len, text_layout)
    txt_v, img_v = split_text_image(value, text_len, text_layout)
    k, v = gather_kv(img_k, img_v, sizes, group)
    k, v = join_text_image(txt_k, k, text_layout), join_text_image(txt_v, v, text_layout)
    return local_attention(query, k, v, attn_mask=key_mask, scale=scale, kernel=kernel)


class KVGatherAttnProcessor(SequenceParallelAttnProcessor):
    """Attention processor running the model's own processor with K/V-gather sequence parallelism.

    See :func:`kv_gather_attention` for the algorithm and
    :class:`~diffusers_sp.processors.base.SequenceParallelAttnProcessor` for the arguments.
    """

    strategy = "kv_gather"

    def parallel_attention(self, query, key, value, sizes, *, scale, text_len=0, text_layout=None, key_mask=None):
        return kv_gather_attention(query, key, value, sizes, self.state.group, scale=scale, kernel=self.kernel,
                                   text_len=text_len, text_layout=text_layout, key_mask=key_mask)
