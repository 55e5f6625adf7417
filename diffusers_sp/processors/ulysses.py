"""Ulysses sequence parallelism: all-to-all from sequence shards to head shards and back.

From DeepSpeed-Ulysses (Jacobs et al., "DeepSpeed Ulysses: System Optimizations for Enabling
Training of Extreme Long Sequence Transformer Models", arXiv 2309.14509). Each rank sends every
other rank that rank's heads of its Q, K, V shard (one all-to-all for the three), attends over the
full sequence for its own heads, and an all-to-all sends the output rows back to the ranks that own
those tokens. Heads that do not divide the world size are split unevenly (balanced), which is exact;
token shards may be uneven too.

Joint attention: the text tokens are replicated, so a rank takes its own head slice of the text
Q/K/V without communication and attends over ``[text; all image tokens]`` for its heads. The text
output rows of its heads travel in the same output all-to-all as the image rows (each rank sends its
text rows to every rank), so every rank ends with the text output of all heads, bit-identical across
ranks.
"""

from __future__ import annotations

import torch

from ..comm import all_to_all_flat
from ..kernels.sdpa import local_attention
from ..sharding import balanced_sizes
from .base import SequenceParallelAttnProcessor, join_text_image, split_text_image


def scatter_heads(tensors: list[torch.Tensor], sizes: list[int], group) -> list[torch.Tensor]:
    """Ulysses' first all-to-all: from token shards of all heads to all tokens of this rank's heads.

    Args:
        tensors: n tensors ``[B, H, S_r, D]`` (this rank's token shard, ``S_r = sizes[rank]``), same
            shape and dtype; sent together in one all-to-all.
        sizes: Tokens per rank, ``sum(sizes) = S``.
        group: :class:`~diffusers_sp.groups.SPGroup` of P ranks; heads are split balanced
            (the first ``H mod P`` ranks one head more).

    Returns:
        n tensors ``[B, h_r, S, D]``: this rank's heads over the full sequence, strided views of one
        token-major ``[S, n, B, h_r, D]`` buffer.

    Layout: the chunk for rank j is ``[S_r, n, B, h_j, D]`` (tokens outermost), written once from the
    inputs. The chunks a rank receives, in rank order, are then already the full sequence
    ``[S, n, B, h_r, D]``: no concatenation after the all-to-all. The local kernel takes the
    token-major views as they are and writes its output in the same order, so at batch 1 without
    joint text the rows of each rank are already contiguous for :func:`gather_heads` (no copy before
    the second all-to-all either; with text or B > 1 one copy remains there).
    On 2 H200s this layout took the Wan2.1-1.3B step from 344 to 335 ms (benchmarks/RESULTS.md).
    """
    n = len(tensors)
    B, H, S_r, D = tensors[0].shape
    heads = balanced_sizes(H, group.world_size)
    h_r = heads[group.rank]
    unit = n * B * D
    send_sizes = [S_r * unit * h for h in heads]
    send = tensors[0].new_empty(sum(send_sizes))
    start = 0
    for chunk, h in zip(send.split(send_sizes), heads):
        chunk = chunk.view(S_r, n, B, h, D)
        for i, t in enumerate(tensors):
            chunk[:, i].copy_(t[:, start:start + h].permute(2, 0, 1, 3))
        start += h
    recv = all_to_all_flat(send, send_sizes, [s * unit * h_r for s in sizes], group)
    full = recv.view(sum(sizes), n, B, h_r, D)  # chunks of ranks 0..P-1 = tokens in order
    return [full[:, i].permute(1, 2, 0, 3) for i in range(n)]


def gather_heads(out: torch.Tensor, sizes: list[int], group, *, num_heads: int,
                 text: torch.Tensor | None = None) -> torch.Tensor:
    """Ulysses' second all-to-all: from all tokens of this rank's heads back to token shards of all heads.

    Args:
        out: ``[B, h_r, S, D]``, this rank's heads over the full (image) sequence.
        sizes: Tokens per rank.
        group: The sequence-parallel group (same head split as :func:`scatter_heads`).
        num_heads: H, the total head count.
        text: ``None`` or ``[B, h_r, T, D]``: replicated rows (joint-attention text) that every rank
            needs for all heads; they travel in the same all-to-all.

    Returns:
        ``[S_r + T, B, H, D]``: this rank's token rows followed by the T text rows, all heads.
    """
    B, h_r, _, D = out.shape
    heads = balanced_sizes(num_heads, group.world_size)
    T = 0 if text is None else text.shape[2]
    S_r = sizes[group.rank]
    send_img = out.permute(2, 0, 1, 3)  # [S, B, h_r, D]: the rows owned by rank i are contiguous
    if T:
        send_txt = text.permute(2, 0, 1, 3)
        pieces = []
        for rows in send_img.split(sizes):
            pieces += [rows, send_txt]
        send = torch.cat(pieces)
    else:
        send = send_img.contiguous()
    rows = S_r + T
    recv_sizes = [rows * B * h * D for h in heads]
    recv = all_to_all_flat(send.reshape(-1), [(s + T) * B * h_r * D for s in sizes], recv_sizes, group)
    return torch.cat([c.view(rows, B, h, D) for c, h in zip(recv.split(recv_sizes), heads)], dim=2)


def ulysses_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sizes: list[int], group, *,
                      scale: float | None = None, kernel: str = "auto", text_len: int = 0,
                      text_layout: str | None = None, key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Ulysses attention over a sequence sharded across ``group``, with optional joint text tokens.

    Args:
        query, key, value: ``[B, H, T + S_r, D]``: ``T = text_len`` replicated text tokens and this
            rank's image shard (``S_r = sizes[rank]``) in the order of ``text_layout``; any float
            dtype; the same shape on every rank except ``S_r``.
        sizes: Image tokens per rank, ``sum(sizes) = S``.
        group: :class:`~diffusers_sp.groups.SPGroup` of P ranks, ``H >= P`` (heads split balanced,
            the first ``H mod P`` ranks one head more).
        scale: Softmax scale (``None``: ``1/sqrt(D)``).
        kernel: Local kernel name (see :func:`~diffusers_sp.kernels.sdpa.local_attention`).
        text_len: T (0: no text in the sequence).
        text_layout: ``"prefix"`` (text first) or ``"suffix"`` (text last); ignored when T = 0.
        key_mask: ``None`` or a key padding mask ``[B or 1, H or 1, 1, T + S]`` over the full key
            sequence in the same order (bool True = attend, or additive float).

    Returns:
        ``[B, H, T + S_r, D]``: this rank's rows of softmax(Q Kᵀ·scale + mask) V over all T + S keys;
        the text rows are identical on every rank.

    Communication per rank: the image part of Q, K, V in one all-to-all (:func:`scatter_heads`); the
    output (this rank's heads of every rank's image rows, plus its heads of the T text rows for every
    rank) in a second (:func:`gather_heads`).
    """
    P, r = group.world_size, group.rank
    H = query.shape[1]
    if P == 1:
        return local_attention(query, key, value, attn_mask=key_mask, scale=scale, kernel=kernel)
    T, S_r = text_len, sizes[r]
    heads = balanced_sizes(H, P)
    h_r, h0 = heads[r], sum(heads[:r])
    parts = [split_text_image(t, T, text_layout) for t in (query, key, value)]
    full = scatter_heads([img for _, img in parts], sizes, group)
    q, k, v = (join_text_image(txt[:, h0:h0 + h_r], img, text_layout) for (txt, _), img in zip(parts, full))
    mask = key_mask
    if mask is not None and mask.shape[1] > 1:
        mask = mask[:, h0:h0 + h_r]
    out = local_attention(q, k, v, attn_mask=mask, scale=scale, kernel=kernel)  # [B, h_r, T + S, D]
    out_txt, out_img = split_text_image(out, T, text_layout)
    joined = gather_heads(out_img, sizes, group, num_heads=H, text=out_txt if T else None)
    result = join_text_image(joined[S_r:], joined[:S_r], text_layout, dim=0)  # image rows, then text rows
    return result.permute(1, 2, 0, 3)  # [B, H, T + S_r, D]


class UlyssesAttnProcessor(SequenceParallelAttnProcessor):
    """Attention processor running the model's own processor with Ulysses sequence parallelism.

    Wraps ``inner`` (the model's processor); tensors in the taken-over attention call are
    ``[B, H, T + S_r, D]`` (replicated text tokens, if any, and this rank's image shard). See
    :func:`ulysses_attention` for the algorithm, and
    :class:`~diffusers_sp.processors.base.SequenceParallelAttnProcessor` for the arguments.
    """

    strategy = "ulysses"

    def parallel_attention(self, query, key, value, sizes, *, scale, text_len=0, text_layout=None, key_mask=None):
        return ulysses_attention(query, key, value, sizes, self.state.group, scale=scale, kernel=self.kernel,
                                 text_len=text_len, text_layout=text_layout, key_mask=key_mask)
