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
:mod:`diffusers_sp.copy_engine`). Both give the same bits. Either can start with K and V alone
(:func:`start_ulysses`, :func:`finish_ulysses`), which the K/V-first family hooks (Wan) use so that
K and V travel while the query projection runs.
"""

from __future__ import annotations

import torch

from ..comm import all_to_all_flat, start_all_to_all_flat
from ..copy_engine import barrier_timeout_ms, copy_or_fallback, head_group_sizes, workspace
from ..kernels.sdpa import local_attention
from ..shards import balanced_sizes
from .base import PendingKV, SequenceParallelAttnProcessor
from .masks import join_text_image, split_text_image


def scatter_heads(tensors: list[torch.Tensor], sizes: list[int], group) -> list[torch.Tensor]:
    """Ulysses' first all-to-all; see :func:`start_scatter_heads` (which this calls and waits for)."""
    return start_scatter_heads(tensors, sizes, group)()


def start_scatter_heads(tensors: list[torch.Tensor], sizes: list[int], group):
    """Ulysses' first all-to-all, from token shards of all heads to all tokens of this rank's heads:
    issues it and returns a function that waits for it and returns its result (work queued on the
    current stream in between runs while it is in flight).

    Args:
        tensors: n tensors ``[B, H, S_r, D]`` (this rank's token shard, ``S_r = sizes[rank]``), same
            shape and dtype; sent together in one all-to-all.
        sizes: Tokens per rank, ``sum(sizes) = S``.
        group: :class:`~diffusers_sp.groups.SPGroup` of P ranks; heads are split balanced
            (the first ``H mod P`` ranks one head more).

    Returns:
        A function returning n tensors ``[B, h_r, S, D]``: this rank's heads over the full sequence,
        strided views of one token-major ``[S, n, B, h_r, D]`` buffer.

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
    start = offset = 0
    for size, h in zip(send_sizes, heads):
        # narrow, not split: a view from a multi-view op may not be written in place with grad on
        chunk = send.narrow(0, offset, size).view(S_r, n, B, h, D)
        for i, t in enumerate(tensors):
            chunk[:, i].copy_(t[:, start:start + h].permute(2, 0, 1, 3))
        start += h
        offset += size
    finish = start_all_to_all_flat(send, send_sizes, [s * unit * h_r for s in sizes], group)

    def views() -> list[torch.Tensor]:
        full = finish().view(sum(sizes), n, B, h_r, D)  # chunks of ranks 0..P-1 = tokens in order
        return [full[:, i].permute(1, 2, 0, 3) for i in range(n)]

    return views


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
        key_mask: ``None`` or a mask ``[B or 1, H or 1, 1 or T + S, T + S]`` over the full sequence in
            the same order (bool True = attend, or additive float): a key padding mask, or a
            query-dependent mask with the rows of every query (each rank attends all of them for its
            heads).

    Returns:
        ``[B, H, T + S_r, D]``: this rank's rows of softmax(Q Kᵀ·scale + mask) V over all T + S keys;
        the text rows are identical on every rank.

    Communication per rank: the image part of Q, K, V in one all-to-all (:func:`scatter_heads`); the
    output (this rank's heads of every rank's image rows, plus its heads of the T text rows for every
    rank) in a second (:func:`gather_heads`).
    """
    if group.world_size == 1:
        return local_attention(query, key, value, attn_mask=key_mask, scale=scale, kernel=kernel)
    parts = [split_text_image(t, text_len, text_layout) for t in (query, key, value)]
    full = scatter_heads([img for _, img in parts], sizes, group)
    return _attend_head_shard([txt for txt, _ in parts], full, sizes, group, query.shape[1], scale=scale,
                              kernel=kernel, text_len=text_len, text_layout=text_layout, key_mask=key_mask)


def _attend_head_shard(texts, full, sizes, group, num_heads, *, scale, kernel, text_len, text_layout, key_mask):
    """Ulysses after the first all-to-all: attention of this rank's heads, then :func:`gather_heads`.

    ``texts``: the replicated text parts of Q, K, V (``[B, H, T, D]``, all heads); ``full``: this
    rank's heads of Q, K, V over all image tokens (``[B, h_r, S, D]``). Returns ``[B, H, T + S_r, D]``.
    """
    r = group.rank
    T, S_r = text_len, sizes[r]
    heads = balanced_sizes(num_heads, group.world_size)
    h_r, h0 = heads[r], sum(heads[:r])
    q, k, v = (join_text_image(txt[:, h0:h0 + h_r], img, text_layout) for txt, img in zip(texts, full))
    mask = key_mask
    if mask is not None and mask.shape[1] > 1:
        mask = mask[:, h0:h0 + h_r]
    out = local_attention(q, k, v, attn_mask=mask, scale=scale, kernel=kernel)  # [B, h_r, T + S, D]
    out_txt, out_img = split_text_image(out, T, text_layout)
    joined = gather_heads(out_img, sizes, group, num_heads=num_heads, text=out_txt if T else None)
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
        RuntimeError: surfacing at a later synchronization, a symmetric-memory barrier timed out (a
            peer did not arrive within the group's collective timeout,
            :func:`~diffusers_sp.copy_engine.barrier_timeout_ms`), which aborts the kernel.

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
    run = _UlyssesCopyEngine(query, sizes, group, head_groups)
    run.push({0: query, 1: key, 2: value}, arrive=True)
    return run.attend(scale=scale, kernel=kernel, key_mask=key_mask)


class _UlyssesCopyEngine:
    """One :func:`ulysses_attention_copy_engine` call: the buffer layout and streams of its steps.

    :meth:`push` enqueues step 1 for some of Q (0), K (1), V (2), pushing group by group; with
    ``arrive`` each group ends in its barrier and events. :func:`ulysses_attention_copy_engine`
    pushes all three at once; the K/V-first path (:func:`start_ulysses`) pushes K and V (every
    group, no barrier) before the query exists, then Q with the barriers, so K and V travel under
    the query projection. :meth:`attend` is steps 2 and 3.
    """

    def __init__(self, like: torch.Tensor, sizes: list[int], group, head_groups):
        P, r = group.world_size, group.rank
        B, H, S_r, D = like.shape
        S = sum(sizes)
        self.sizes, self.r, self.B, self.H, self.S_r, self.D = sizes, r, B, H, S_r, D
        self.offsets = [sum(sizes[:i]) for i in range(P)]
        heads = balanced_sizes(H, P)
        self.head_starts = [sum(heads[:p]) for p in range(P)]
        self.G = len(head_group_sizes(min(heads), head_groups))
        self.groups = [balanced_sizes(h, self.G) for h in heads]  # groups[p][g]: heads of rank p's group g
        self.dtype, self.device = like.dtype, like.device
        unit = B * D
        # Element offsets in a rank's buffer; peers write into it, so they are functions of the owner
        # that every rank computes alike.
        self.recv_offset = lambda owner, i, g: S * unit * (i * heads[owner] + sum(self.groups[owner][:g]))
        out_size = max(sizes) * unit * H
        out_base = 3 * S * unit * max(heads)
        nbytes = (out_base + 2 * out_size) * like.element_size()  # the same on every rank
        self.ws = ws = workspace(group, nbytes, self.device)
        self.flat = ws.buffer[:nbytes].view(self.dtype)
        self.out_offset = out_base + (ws.calls % 2) * out_size  # the two output regions alternate
        ws.calls += 1
        self.S = S
        self.compute, self.side, self.local = torch.cuda.current_stream(self.device), ws.stream, ws.local
        self.peers = [(r + step) % P for step in range(1, P)]
        self.timeout = barrier_timeout_ms()
        self.opened = False

    def recv(self, i: int, g: int) -> torch.Tensor:  # this rank's gathered rows of its group g
        start, n = self.recv_offset(self.r, i, g), self.groups[self.r][g]
        return self.flat[start:start + self.S * self.B * n * self.D].view(self.S, self.B, n, self.D)

    def push(self, tensors: dict[int, torch.Tensor], *, arrive: bool) -> None:
        """Step 1 for ``tensors`` (``{0: Q, 1: K, 2: V}`` or a part, ``[B, H, S_r, D]``)."""
        if torch.cuda.current_stream(self.device) != self.compute:
            raise RuntimeError("a copy-engine Ulysses call must run on one stream from start to end")
        ws, side, local, r = self.ws, self.side, self.local, self.r
        lo, hi = self.offsets[r], self.offsets[r] + self.S_r
        ws.follow(self.compute, tensors.values())
        inputs = {i: t.permute(2, 0, 1, 3) for i, t in tensors.items()}  # [S_r, B, H, D] views
        with torch.cuda.stream(side):
            if not self.opened:
                ws.handle.barrier(channel=0, timeout_ms=self.timeout)
                self.opened = True
            for g in range(self.G):
                for p in self.peers:
                    n = self.groups[p][g]
                    h0 = self.head_starts[p] + sum(self.groups[p][:g])
                    for i, rows in inputs.items():
                        remote = ws.handle.get_buffer(p, (self.S, self.B, n, self.D), self.dtype,
                                                      self.recv_offset(p, i, g))
                        copy_or_fallback(remote[lo:hi], rows[:, :, h0:h0 + n])
                if arrive:
                    ws.handle.barrier(channel=0, timeout_ms=self.timeout)
                    ws.event(g).record(side)
        with torch.cuda.stream(local):  # own rows of own heads, on a copy engine beside the pushes
            h0 = self.head_starts[r]
            for g in range(self.G):
                for i, rows in inputs.items():
                    copy_or_fallback(self.recv(i, g)[lo:hi], rows[:, :, h0:h0 + self.groups[r][g]])
                if arrive:
                    ws.event(self.G + g).record(local)
                h0 += self.groups[r][g]

    def attend(self, *, scale, kernel, key_mask) -> torch.Tensor:
        """Steps 2 and 3, after a :meth:`push` with ``arrive``; returns ``[B, H, S_r, D]``."""
        ws, side, local, compute = self.ws, self.side, self.local, self.compute
        B, H, S_r, D, r = self.B, self.H, self.S_r, self.D, self.r
        lo, hi = self.offsets[r], self.offsets[r] + S_r
        out = self.flat[self.out_offset:][:B * S_r * H * D].view(B, S_r, H, D)
        per_head_mask = key_mask is not None and key_mask.shape[1] > 1
        h0 = self.head_starts[r]
        for g in range(self.G):
            n = self.groups[r][g]
            compute.wait_event(ws.event(g))
            compute.wait_event(ws.event(self.G + g))
            q, k, v = (self.recv(i, g).permute(1, 2, 0, 3) for i in range(3))  # [B, n, S, D]
            mask = key_mask[:, h0:h0 + n] if per_head_mask else key_mask
            o = local_attention(q, k, v, attn_mask=mask, scale=scale, kernel=kernel)  # [B, n, S, D]
            rows = o.permute(0, 2, 1, 3)  # [B, S, n, D]
            done = ws.event(2 * self.G + g)
            done.record(compute)
            for stream in (side, local):
                o.record_stream(stream)
            with torch.cuda.stream(local):
                local.wait_event(done)
                copy_or_fallback(out[:, :, h0:h0 + n], rows[:, lo:hi])
            with torch.cuda.stream(side):
                side.wait_event(done)
                for p in self.peers:
                    if self.sizes[p]:
                        peer_out = ws.handle.get_buffer(p, (B, self.sizes[p], H, D), self.dtype, self.out_offset)
                        start = self.offsets[p]
                        copy_or_fallback(peer_out[:, :, h0:h0 + n], rows[:, start:start + self.sizes[p]])
            h0 += n
        with torch.cuda.stream(side):
            ws.handle.barrier(channel=0, timeout_ms=self.timeout)
            ws.free.record(side)
        compute.wait_event(ws.free)
        compute.wait_stream(local)
        return out.permute(0, 2, 1, 3)


def start_ulysses(key: torch.Tensor, value: torch.Tensor, sizes: list[int], group, *, copy_engine: bool = False,
                  head_groups: int | str = "auto", text_len: int = 0, text_layout: str | None = None) -> PendingKV:
    """Starts Ulysses' K/V all-to-all before the queries exist; :func:`finish_ulysses` completes the call.

    Args:
        key, value: ``[B, H, T + S_r, D]`` as in :func:`ulysses_attention`.
        sizes, group: As in :func:`ulysses_attention`.
        copy_engine: Move them by the copy engines (:func:`ulysses_attention_copy_engine`; CUDA
            tensors on an NCCL group of one host; ``text_len`` must be 0).
        head_groups: G of the copy-engine pipeline.
        text_len, text_layout: As in :func:`ulysses_attention`.

    Returns:
        A :class:`~diffusers_sp.processors.base.PendingKV`. Work enqueued on the current stream
        before :func:`finish_ulysses` (the query projection, QK-norm and RoPE) runs while K and V
        travel; the queries then take a second all-to-all of their own (NCCL) or are pushed group by
        group (copy engines). Same result as :func:`ulysses_attention`. With the copy engines, no
        other copy-engine call may run on ``group`` in between.

    Raises:
        ValueError: ``copy_engine`` with joint text (``text_len > 0``).
    """
    P = group.world_size
    if P == 1:
        return PendingKV(lambda query, *, scale=None, kernel="auto", key_mask=None: local_attention(
            query, key, value, attn_mask=key_mask, scale=scale, kernel=kernel))
    if copy_engine:
        if text_len:
            raise ValueError("the copy-engine Ulysses transport does not take joint text tokens")
        run = _UlyssesCopyEngine(key, sizes, group, head_groups)
        run.push({1: key, 2: value}, arrive=False)

        def finish(query, *, scale=None, kernel="auto", key_mask=None):
            run.push({0: query}, arrive=True)
            return run.attend(scale=scale, kernel=kernel, key_mask=key_mask)

        return PendingKV(finish)
    (txt_k, img_k), (txt_v, img_v) = (split_text_image(t, text_len, text_layout) for t in (key, value))
    kv = start_scatter_heads([img_k, img_v], sizes, group)

    def finish(query, *, scale=None, kernel="auto", key_mask=None):
        txt_q, img_q = split_text_image(query, text_len, text_layout)
        (full_q,) = scatter_heads([img_q], sizes, group)
        full_k, full_v = kv()
        return _attend_head_shard((txt_q, txt_k, txt_v), (full_q, full_k, full_v), sizes, group, query.shape[1],
                                  scale=scale, kernel=kernel, text_len=text_len, text_layout=text_layout,
                                  key_mask=key_mask)

    return PendingKV(finish)


def finish_ulysses(pending: PendingKV, query: torch.Tensor, *, scale: float | None = None, kernel: str = "auto",
                   key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Completes a :func:`start_ulysses` call with the queries ``[B, H, T + S_r, D]``.

    Returns:
        ``[B, H, T + S_r, D]``, as :func:`ulysses_attention` (with the copy engines, the view
        described in :func:`ulysses_attention_copy_engine`).

    Raises:
        RuntimeError: ``pending`` was already consumed.
    """
    return pending.finish(query, scale=scale, kernel=kernel, key_mask=key_mask)


class UlyssesAttnProcessor(SequenceParallelAttnProcessor):
    """Attention processor running the model's own processor with Ulysses sequence parallelism.

    Wraps ``inner`` (the model's processor); tensors in the taken-over attention call are
    ``[B, H, T + S_r, D]`` (replicated text tokens, if any, and this rank's image shard). See
    :func:`ulysses_attention` for the algorithm, and
    :class:`~diffusers_sp.processors.base.SequenceParallelAttnProcessor` for the arguments. With
    ``transport="copy_engine"``, calls without joint text run :func:`ulysses_attention_copy_engine`.
    With a family's ``kv_first`` hook (Wan), K and V are started by :func:`start_ulysses` before
    the query projection runs, which then overlaps their transfer.
    """

    strategy = "ulysses"
    supports_kv_first = True
    attends_all_queries = True  # every rank attends all T + S queries of its heads

    def start_attention(self, key, value, sizes, *, text_len=0, text_layout=None):
        return start_ulysses(key, value, sizes, self.state.group, copy_engine=text_len == 0 and self.use_copy_engine(key),
                             head_groups=self.head_groups, text_len=text_len, text_layout=text_layout)

    def finish_attention(self, pending, query, *, scale=None):
        return finish_ulysses(pending, query, scale=scale, kernel=self.kernel)

    def parallel_attention(self, query, key, value, sizes, *, scale, text_len=0, text_layout=None, key_mask=None):
        if text_len == 0 and self.use_copy_engine(query):
            return ulysses_attention_copy_engine(query, key, value, sizes, self.state.group, scale=scale,
                                                 kernel=self.kernel, key_mask=key_mask, head_groups=self.head_groups)
        return ulysses_attention(query, key, value, sizes, self.state.group, scale=scale, kernel=self.kernel,
                                 text_len=text_len, text_layout=text_layout, key_mask=key_mask)
