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

Two transports: NCCL's all-to-all (:func:`ulysses_attention`, any backend, gloo included) and, on
CUDA ranks of one host without joint text, the copy engines through symmetric memory, pipelined over
head groups so that both all-to-alls overlap the attention (:func:`ulysses_attention_copy_engine`,
:mod:`diffusers_sp.copy_engine`). Both give the same bits.
"""

from __future__ import annotations

import torch

from ..comm import all_to_all_flat
from ..copy_engine import barrier_timeout_ms, copy_or_fallback, head_group_sizes, workspace
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


def ulysses_attention_copy_engine(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sizes: list[int],
                                  group, *, scale: float | None = None, kernel: str = "auto",
                                  key_mask: torch.Tensor | None = None,
                                  head_groups: int | str = "auto") -> torch.Tensor:
    """:func:`ulysses_attention` with both all-to-alls on the copy engines, pipelined over head groups.

    Same result (bit-identical) for video/image tokens only (no joint text), CUDA tensors of one
    dtype on an NCCL group of one host (:func:`diffusers_sp.copy_engine.copy_engine_unavailable_reason`).

    Args:
        query, key, value: ``[B, H, S_r, D]``, this rank's token shard (``S_r = sizes[rank]``).
        sizes: Tokens per rank (any split).
        group: The sequence-parallel group (``H >= P``; heads split balanced as in
            :func:`scatter_heads`).
        scale, kernel, key_mask: As in :func:`ulysses_attention` (``key_mask`` over all S keys).
        head_groups: G (``"auto"`` or a positive int): each rank's heads are split into
            ``min(G, min_p h_p)`` balanced groups (the same count on every rank).

    Returns:
        ``[B, H, S_r, D]``, a view of a ``[B, S_r, H, D]`` region of the group's symmetric buffer,
        valid until the next copy-engine call on the group (consume it or copy it before then). Two
        output regions alternate, so a following Ulysses call of the same shapes leaves it intact,
        but a call of other shapes or a K/V-gather call may overwrite it.

    Raises:
        RuntimeError: the CUDA driver refused a 2-D copy; or, surfacing at a later synchronization,
            a symmetric-memory barrier timed out (a peer did not arrive within the group's collective
            timeout, :func:`~diffusers_sp.copy_engine.barrier_timeout_ms`), which aborts the kernel.

    Every rank pushes: no packing copies. Its symmetric buffer holds, written by itself and its
    peers, the gathered Q/K/V of its own heads ``[(Q, K, V), group g: [S, B, h_rg, D]]`` and two
    alternating output regions ``[B, S_r, H, D]``. Per call:

    1. side stream, after the compute stream's work so far (so every earlier read of this rank's
       buffer enqueued there is done: Q/K/V by the attention, an output region by the model's output
       projection): barrier (every rank may now be written to); per head group, 2-D copy-engine
       copies (:func:`~diffusers_sp.copy_engine.copy_rows`) of this rank's Q/K/V rows of each
       peer's heads of that group, straight from the model's token-major tensors into the peer's
       buffer, then a barrier (every peer's rows of this group have arrived) and an event;
       meanwhile a second stream copies this rank's own rows of its own heads on a copy engine,
       group by group;
    2. compute stream: per group, attention after both its events; after it, the second stream
       copies this rank's own output rows into its output region, and the side stream pushes every
       peer's rows of this group's output into that peer's output region at this rank's heads;
    3. a closing barrier (all output rows have arrived), which the compute stream waits for, as for
       the second stream.
    """
    P, r = group.world_size, group.rank
    B, H, S_r, D = query.shape
    S = sum(sizes)
    offsets = [sum(sizes[:i]) for i in range(P)]
    heads = balanced_sizes(H, P)
    head_starts = [sum(heads[:p]) for p in range(P)]
    G = len(head_group_sizes(min(heads), head_groups))
    groups = [balanced_sizes(h, G) for h in heads]  # groups[p][g]: heads of rank p's group g
    dtype, device = query.dtype, query.device
    unit = B * D

    # Element offsets in a rank's buffer; peers write into it, so they are functions of the owner
    # that every rank computes alike.
    def recv_offset(owner: int, i: int, g: int) -> int:
        return S * unit * (i * heads[owner] + sum(groups[owner][:g]))

    out_size = max(sizes) * unit * H
    out_base = 3 * S * unit * max(heads)
    nbytes = (out_base + 2 * out_size) * query.element_size()  # the same on every rank
    ws = workspace(group, nbytes, device)
    flat = ws.buffer[:nbytes].view(dtype)
    parity = ws.calls % 2
    ws.calls += 1

    def recv(i: int, g: int) -> torch.Tensor:  # this rank's gathered rows of its group g
        start = recv_offset(r, i, g)
        return flat[start:start + S * unit * groups[r][g]].view(S, B, groups[r][g], D)

    def peer_recv(p: int, i: int, g: int) -> torch.Tensor:
        return ws.handle.get_buffer(p, (S, B, groups[p][g], D), dtype, recv_offset(p, i, g))

    def peer_out(p: int) -> torch.Tensor:  # [B, S_p, H, D]
        return ws.handle.get_buffer(p, (B, sizes[p], H, D), dtype, out_base + parity * out_size)

    compute, side, local = torch.cuda.current_stream(device), ws.stream, ws.local
    inputs = [t.permute(2, 0, 1, 3) for t in (query, key, value)]  # [S_r, B, H, D] views
    lo, hi = offsets[r], offsets[r] + S_r
    peers = [(r + step) % P for step in range(1, P)]
    timeout = barrier_timeout_ms()
    for stream in (side, local):
        stream.wait_stream(compute)
        for t in (query, key, value):
            t.record_stream(stream)
    with torch.cuda.stream(side):
        ws.handle.barrier(channel=0, timeout_ms=timeout)
        for g in range(G):
            for p in peers:
                h0 = head_starts[p] + sum(groups[p][:g])
                for i, rows in enumerate(inputs):
                    copy_or_fallback(peer_recv(p, i, g)[lo:hi], rows[:, :, h0:h0 + groups[p][g]])
            ws.handle.barrier(channel=0, timeout_ms=timeout)
            ws.event(g).record(side)
    with torch.cuda.stream(local):  # own rows of own heads, on a copy engine beside the pushes
        h0 = head_starts[r]
        for g in range(G):
            for i, rows in enumerate(inputs):
                copy_or_fallback(recv(i, g)[lo:hi], rows[:, :, h0:h0 + groups[r][g]])
            ws.event(G + g).record(local)
            h0 += groups[r][g]

    out = flat[out_base + parity * out_size:][:B * S_r * H * D].view(B, S_r, H, D)
    per_head_mask = key_mask is not None and key_mask.shape[1] > 1
    h0 = head_starts[r]
    for g in range(G):
        n = groups[r][g]
        compute.wait_event(ws.event(g))
        compute.wait_event(ws.event(G + g))
        q, k, v = (recv(i, g).permute(1, 2, 0, 3) for i in range(3))  # [B, n, S, D]
        mask = key_mask[:, h0:h0 + n] if per_head_mask else key_mask
        o = local_attention(q, k, v, attn_mask=mask, scale=scale, kernel=kernel)  # [B, n, S, D]
        rows = o.permute(0, 2, 1, 3)  # [B, S, n, D]
        done = ws.event(2 * G + g)
        done.record(compute)
        for stream in (side, local):
            o.record_stream(stream)
        with torch.cuda.stream(local):
            local.wait_event(done)
            copy_or_fallback(out[:, :, h0:h0 + n], rows[:, lo:hi])
        with torch.cuda.stream(side):
            side.wait_event(done)
            for p in peers:
                if sizes[p]:
                    copy_or_fallback(peer_out(p)[:, :, h0:h0 + n], rows[:, offsets[p]:offsets[p] + sizes[p]])
        h0 += n
    with torch.cuda.stream(side):
        ws.handle.barrier(channel=0, timeout_ms=timeout)
        ws.free.record(side)
    compute.wait_event(ws.free)
    compute.wait_stream(local)
    return out.permute(0, 2, 1, 3)


class UlyssesAttnProcessor(SequenceParallelAttnProcessor):
    """Attention processor running the model's own processor with Ulysses sequence parallelism.

    Wraps ``inner`` (the model's processor); tensors in the taken-over attention call are
    ``[B, H, T + S_r, D]`` (replicated text tokens, if any, and this rank's image shard). See
    :func:`ulysses_attention` for the algorithm, and
    :class:`~diffusers_sp.processors.base.SequenceParallelAttnProcessor` for the arguments. With
    ``transport="copy_engine"``, calls without joint text run :func:`ulysses_attention_copy_engine`.
    """

    strategy = "ulysses"

    def parallel_attention(self, query, key, value, sizes, *, scale, text_len=0, text_layout=None, key_mask=None):
        if text_len == 0 and self.use_copy_engine(query):
            return ulysses_attention_copy_engine(query, key, value, sizes, self.state.group, scale=scale,
                                                 kernel=self.kernel, key_mask=key_mask, head_groups=self.head_groups)
        return ulysses_attention(query, key, value, sizes, self.state.group, scale=scale, kernel=self.kernel,
                                 text_len=text_len, text_layout=text_layout, key_mask=key_mask)
