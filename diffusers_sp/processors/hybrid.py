"""Hybrid sequence parallelism: Ulysses inside groups of U ranks, K/V-gather across them.

From USP (J. Fang, S. Zhao, "USP: A Unified Sequence Parallelism Approach for Long Context
Generative AI", arXiv 2405.07719), with K/V-gather (an all-gather of K and V, queries local) in the
place of its ring attention. The sequence-parallel group of ``P = U x R`` ranks is a
:class:`~diffusers_sp.groups.HybridMesh`: rank ``p = o * U + u`` is rank ``u`` of the Ulysses group
``o`` (``U`` consecutive ranks: one host when the launch numbers ranks host by host) and rank ``o`` of
the K/V-gather group ``u`` (the ``R`` ranks with the same ``u``). Per attention call:

1. Ulysses' all-to-all inside the inner group (:func:`~diffusers_sp.processors.ulysses.scatter_heads`):
   from this rank's token shard of all heads to the inner group's token chunk (its ``U`` shards, in
   order) of this rank's ``h_u`` heads (heads split balanced over ``U``, uneven allowed);
2. K/V-gather's all-gather of K and V across the outer group
   (:func:`~diffusers_sp.processors.kv_gather.gather_kv`), on those ``h_u`` heads: the ``R`` chunks in
   order of ``o`` are the whole sequence, uneven chunks gathered padded;
3. attention of the chunk's queries (and, with joint text, the replicated text queries of its heads)
   over all keys, then Ulysses' all-to-all back inside the inner group
   (:func:`~diffusers_sp.processors.ulysses.gather_heads`), which also hands every rank the text rows
   of all heads.

Every rank of an outer group holds the same heads, so the all-gather's operands have one shape
except along the tokens. Each step is one of the two modes' own exact steps, so the result is
exact for any token count, head count (at least one head per rank of a Ulysses group), joint text,
key padding mask and mask over the full sequence, as either mode alone. U = P is Ulysses, U = 1
K/V-gather.

Per layer and rank the all-to-alls move about ``4·B·S·H·D·(U−1)/(U·P)`` elements inside a host and
the all-gather ``2·B·S·H·D·(R−1)/(R·U)`` across hosts: with the Ulysses groups as the hosts, 1/U of
what K/V-gather alone sends between hosts (``2·B·S·H·D·(R−1)/R``).
The transfers use the groups' collectives (NCCL, gloo on CPU); the copy-engine transport runs the
two single-level modes only.
"""

from __future__ import annotations

import torch

from ..groups import HybridMesh
from ..kernels.sdpa import local_attention
from .base import PendingKV, SequenceParallelAttnProcessor
from .masks import query_rows, split_text_image
from .kv_gather import start_gather_kv
from .ulysses import _attend_head_shard, scatter_heads, start_scatter_heads


def _chunk_mask(key_mask, text_len, text_layout, outer_sizes, mesh: HybridMesh):
    """The rows of ``key_mask`` (``[B or 1, H or 1, 1 or T + S, T + S]``) for this inner group's queries:
    the text rows and the rows of its token chunk (a key padding mask, one row, as it is)."""
    if key_mask is None:
        return None
    return query_rows(key_mask, text_len, text_layout, outer_sizes, mesh.kv_gather.rank)


def hybrid_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sizes: list[int],
                     mesh: HybridMesh, *, scale: float | None = None, kernel: str = "auto", text_len: int = 0,
                     text_layout: str | None = None, key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Hybrid (USP) attention over a sequence sharded across the ``U x R`` ranks of ``mesh``.

    Args:
        query, key, value: ``[B, H, T + S_r, D]``: ``T = text_len`` replicated text tokens and this
            rank's image shard (``S_r = sizes[p]``, ``p`` its rank in the whole group) in the order of
            ``text_layout``; any float dtype; the same shape on every rank except ``S_r``.
        sizes: Image tokens per rank of the whole group (``P = U x R`` entries, ``sum(sizes) = S``).
        mesh: The :class:`~diffusers_sp.groups.HybridMesh`; ``H >= U`` (heads split balanced over the
            ``U`` ranks of an inner group, the first ``H mod U`` one head more).
        scale: Softmax scale (``None``: ``1/sqrt(D)``).
        kernel: Local kernel name (see :func:`~diffusers_sp.kernels.sdpa.local_attention`).
        text_len: T (0: no text in the sequence).
        text_layout: ``"prefix"`` (text first) or ``"suffix"`` (text last); ignored when T = 0.
        key_mask: ``None`` or a mask ``[B or 1, H or 1, 1 or T + S, T + S]`` over the full sequence in
            the same order (bool True = attend, or additive float): a key padding mask, or a
            query-dependent mask with the rows of every query (this function takes the rows of its
            inner group's queries).

    Returns:
        ``[B, H, T + S_r, D]``: this rank's rows of softmax(Q Kᵀ·scale + mask) V over all T + S keys;
        the text rows are identical on every rank.
    """
    pending = start_hybrid(key, value, sizes, mesh, text_len=text_len, text_layout=text_layout)
    return pending.finish(query, scale=scale, kernel=kernel, key_mask=key_mask)


def start_hybrid(key: torch.Tensor, value: torch.Tensor, sizes: list[int], mesh: HybridMesh, *, text_len: int = 0,
                 text_layout: str | None = None) -> PendingKV:
    """Starts the hybrid call with K and V alone (Ulysses' K/V all-to-all inside the inner group),
    before the queries exist; ``pending.finish(query, scale=, kernel=, key_mask=)`` completes it.

    Args:
        key, value: ``[B, H, T + S_r, D]`` as in :func:`hybrid_attention`.
        sizes, mesh, text_len, text_layout: As in :func:`hybrid_attention`.

    Returns:
        A :class:`~diffusers_sp.processors.base.PendingKV` whose ``finish`` takes the queries
        ``[B, H, T + S_r, D]`` and returns what :func:`hybrid_attention` returns. Work enqueued on the
        current stream in between (Wan's query projection, QK-norm and RoPE) runs while K and V
        travel (on NCCL; gloo completes each collective before returning).
    """
    inner, outer = mesh.ulysses, mesh.kv_gather
    inner_sizes, outer_sizes = mesh.split_sizes(sizes)
    num_heads = key.shape[1]
    if inner.world_size * outer.world_size == 1:
        return PendingKV(lambda query, *, scale=None, kernel="auto", key_mask=None: local_attention(
            query, key, value, attn_mask=key_mask, scale=scale, kernel=kernel))
    (txt_k, img_k), (txt_v, img_v) = (split_text_image(t, text_len, text_layout) for t in (key, value))
    kv = start_scatter_heads([img_k, img_v], inner_sizes, inner)  # [B, h_u, S_o, D]: the inner chunk

    def finish(query, *, scale=None, kernel="auto", key_mask=None):
        txt_q, img_q = split_text_image(query, text_len, text_layout)
        chunk_k, chunk_v = kv()
        gathered = start_gather_kv(chunk_k, chunk_v, outer_sizes, outer)  # [B, h_u, S, D] when waited for
        (chunk_q,) = scatter_heads([img_q], inner_sizes, inner)
        full_k, full_v = gathered()
        mask = _chunk_mask(key_mask, text_len, text_layout, outer_sizes, mesh)
        return _attend_head_shard((txt_q, txt_k, txt_v), (chunk_q, full_k, full_v), inner_sizes, inner, num_heads,
                                  scale=scale, kernel=kernel, text_len=text_len, text_layout=text_layout,
                                  key_mask=mask)

    return PendingKV(finish)


class HybridAttnProcessor(SequenceParallelAttnProcessor):
    """Attention processor running the model's own processor with hybrid (Ulysses x K/V-gather)
    sequence parallelism over ``state.mesh`` (a :class:`~diffusers_sp.groups.HybridMesh`).

    See :func:`hybrid_attention` for the algorithm and
    :class:`~diffusers_sp.processors.base.SequenceParallelAttnProcessor` for the arguments; tensors in
    the taken-over attention call are ``[B, H, T + S_r, D]``. With a family's ``kv_first`` hook (Wan),
    K and V are started by :func:`start_hybrid` before the query projection runs. The transfers use
    the groups' collectives whatever ``transport`` says (the copy engines serve one-level groups).
    """

    strategy = "hybrid"
    supports_kv_first = True
    # Receives every query row of a full-sequence mask; hybrid_attention takes its inner group's.
    attends_all_queries = True

    @property
    def mesh(self) -> HybridMesh:
        return self.state.mesh

    def start_attention(self, key, value, sizes, *, text_len=0, text_layout=None):
        return start_hybrid(key, value, sizes, self.mesh, text_len=text_len, text_layout=text_layout)

    def finish_attention(self, pending, query, *, scale=None):
        return pending.finish(query, scale=scale, kernel=self.kernel)

    def parallel_attention(self, query, key, value, sizes, *, scale, text_len=0, text_layout=None, key_mask=None):
        return hybrid_attention(query, key, value, sizes, self.mesh, scale=scale, kernel=self.kernel,
                                text_len=text_len, text_layout=text_layout, key_mask=key_mask)

