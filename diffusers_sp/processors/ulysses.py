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

    Communication per rank: the image part of Q, K, V in one all-to-all; the output (this rank's
    heads of every rank's image rows, plus its heads of the T text rows for every rank) in a second.
    """
    P, r = group.world_size, group.rank
    B, H, L, D = query.shape
    if P == 1:
        return local_attention(query, key, value, attn_mask=key_mask, scale=scale, kernel=kernel)
    T, S_r = text_len, sizes[r]
    heads = balanced_sizes(H, P)
    h_r, h0 = heads[r], sum(heads[:r])
    parts = [split_text_image(t, T, text_layout) for t in (query, key, value)]
    # [H, 3, B, S_r, D]: heads outermost, so the chunk for rank j is contiguous (one copy).
    send = torch.stack([img.permute(1, 0, 2, 3) for _, img in parts], dim=1)
    unit = 3 * B * D
    recv = all_to_all_flat(send.reshape(-1), [h * unit * S_r for h in heads], [h_r * unit * s for s in sizes], group)
    # Chunk from rank i is [h_r, 3, B, S_i, D]; concatenating along the tokens gives [h_r, 3, B, S, D].
    chunks = [c.view(h_r, 3, B, s, D) for c, s in zip(recv.split([h_r * unit * s for s in sizes]), sizes)]
    full = torch.cat(chunks, dim=3)
    q, k, v = (join_text_image(txt[:, h0:h0 + h_r], full[:, i].permute(1, 0, 2, 3), text_layout)
               for i, (txt, _) in enumerate(parts))
    mask = key_mask
    if mask is not None and mask.shape[1] > 1:
        mask = mask[:, h0:h0 + h_r]
    out = local_attention(q, k, v, attn_mask=mask, scale=scale, kernel=kernel)  # [B, h_r, T + S, D]
    out_txt, out_img = split_text_image(out, T, text_layout)
    # Back: [tokens, B, h_r, D]; rank i gets its image rows followed by the text rows.
    send_img = out_img.permute(2, 0, 1, 3)
    if T:
        send_txt = out_txt.permute(2, 0, 1, 3)
        pieces = []
        for rows in send_img.split(sizes):
            pieces += [rows, send_txt]
        send_o = torch.cat(pieces)
    else:
        send_o = send_img.contiguous()
    rows = S_r + T
    recv_o = all_to_all_flat(send_o.reshape(-1), [(s + T) * B * h_r * D for s in sizes],
                             [rows * B * h * D for h in heads], group)
    got = [c.view(rows, B, h, D) for c, h in zip(recv_o.split([rows * B * h * D for h in heads]), heads)]
    joined = torch.cat(got, dim=2)  # [S_r + T, B, H, D]: image rows, then text rows
    result = join_text_image(joined[S_r:], joined[:S_r], text_layout, dim=0)
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
