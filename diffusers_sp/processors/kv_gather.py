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

Two transports move K and V: NCCL's all-gather (:func:`gather_kv`, any backend, gloo included) and,
on CUDA ranks of one host, the copy engines through symmetric memory with the attention split into
head groups so that each group's transfer overlaps the previous group's attention
(:func:`kv_gather_attention_copy_engine`, :mod:`diffusers_sp.copy_engine`). Both give the same bits.
Either can start before the queries exist (:func:`start_kv_gather`, :func:`finish_kv_gather`),
which the K/V-first family hooks (Wan) use so that K and V travel while the query projection runs.

The same gather serves attention calls whose queries are whole on every rank and whose keys and
values are split (LTX-2's video-to-audio attention), in every mode: :class:`SplitKVAttnProcessor`; and
the calls of a model whose processor attends the split tokens over whole tokens before them besides
calls among those whole tokens alone (QwenImage 2.1), in every mode: :class:`PrefixKVAttnProcessor`.
"""

from __future__ import annotations

import torch

from ..comm import start_all_gather_dim0
from ..copy_engine import barrier_timeout_ms, copy_or_fallback, head_group_sizes, workspace
from ..kernels.sdpa import local_attention
from ..errors import SequenceParallelConfigError
from .base import PendingKV, SequenceParallelAttnProcessor
from .capture import _SDPA
from .masks import gather_key_padding_mask, join_text_image, normalize_key_padding_mask, split_text_image


def gather_kv(key: torch.Tensor, value: torch.Tensor, sizes: list[int], group) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gathers K and V shards of ``[B, H, S_r, D]`` into full ``[B, H, S, D]`` tensors.

    K and V travel token-major (``[S_r, B, H, D]``), one all-gather each. Diffusers' models hand the
    attention K and V stored as ``[B, S, H, D]``, which for batch 1 is already token-major, so
    nothing is copied before the collectives (one copy each otherwise, and a padded copy on the
    ranks with the shorter shard when the shards are uneven). The returned tensors are
    ``[B, H, S, D]`` views of the gathered ``[S, B, H, D]`` buffers.
    """
    return start_gather_kv(key, value, sizes, group)()


def start_gather_kv(key: torch.Tensor, value: torch.Tensor, sizes: list[int], group):
    """Issues :func:`gather_kv` and returns a function that waits for it and returns ``(K, V)``.

    Work queued between the two calls (the query projection, with ``overlap_query_projection``)
    runs while the all-gathers are in flight; same arguments and result as :func:`gather_kv`.
    """
    if group.world_size == 1:
        return lambda: (key, value)
    pending = [start_all_gather_dim0(t.permute(2, 0, 1, 3), sizes, group) for t in (key, value)]
    return lambda: tuple(finish().permute(1, 2, 0, 3) for finish in pending)


def start_kv_gather(key: torch.Tensor, value: torch.Tensor, sizes: list[int], group, *, copy_engine: bool = False,
                    head_groups: int | str = "auto", text_len: int = 0, text_layout: str | None = None) -> PendingKV:
    """Starts moving K and V for :func:`finish_kv_gather`, before the queries exist.

    Args:
        key, value: ``[B, H, T + S_r, D]``: ``T = text_len`` replicated text tokens and this rank's
            image shard (``S_r = sizes[rank]``) in the order of ``text_layout``.
        sizes: Image tokens per rank, ``sum(sizes) = S``.
        group: :class:`~diffusers_sp.groups.SPGroup` of P ranks (no constraint on H).
        copy_engine: Move K and V by the copy engines (:func:`kv_gather_attention_copy_engine`;
            CUDA tensors on an NCCL group of one host) instead of NCCL's all-gather.
        head_groups: G of the copy-engine pipeline (see :func:`~diffusers_sp.copy_engine.head_group_sizes`).
        text_len: T (0: no text in the sequence).
        text_layout: ``"prefix"`` (text first) or ``"suffix"`` (text last); ignored when T = 0.

    Returns:
        A :class:`~diffusers_sp.processors.base.PendingKV`. Work enqueued on the current stream
        before :func:`finish_kv_gather` (for Wan, the query projection, QK-norm and RoPE) runs while
        K and V are in flight. With the copy engines, no other copy-engine call may run on ``group``
        in between.
    """
    txt_k, img_k = split_text_image(key, text_len, text_layout)
    txt_v, img_v = split_text_image(value, text_len, text_layout)
    if copy_engine:
        finish = _start_copy_engine(img_k, img_v, sizes, group, head_groups, txt_k, txt_v, text_layout)
    else:
        gathered = start_gather_kv(img_k, img_v, sizes, group)

        def finish(query, *, scale=None, kernel="auto", key_mask=None):
            k, v = gathered()
            k, v = join_text_image(txt_k, k, text_layout), join_text_image(txt_v, v, text_layout)
            return local_attention(query, k, v, attn_mask=key_mask, scale=scale, kernel=kernel)
    return PendingKV(finish)


def finish_kv_gather(pending: PendingKV, query: torch.Tensor, *, scale: float | None = None, kernel: str = "auto",
                     key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of this rank's queries over the K and V that :func:`start_kv_gather` moved.

    Args:
        pending: From :func:`start_kv_gather` (on the same stream; consumed).
        query: ``[B, H, T + S_r, D]``, same layout as the keys given to :func:`start_kv_gather`.
        scale: Softmax scale (``None``: ``1/sqrt(D)``).
        kernel: Local kernel name.
        key_mask: ``None`` or a mask ``[B or 1, H or 1, 1 or T + S_r, T + S]`` over the full key
            sequence (bool True = attend, or additive float): a key padding mask, or the rows of this
            rank's queries of a query-dependent mask.

    Returns:
        ``[B, H, T + S_r, D]``: this rank's rows of softmax(Q Kᵀ·scale + mask) V over all T + S keys.

    Raises:
        RuntimeError: ``pending`` was already consumed.
    """
    return pending.finish(query, scale=scale, kernel=kernel, key_mask=key_mask)


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
        key_mask: ``None`` or a mask ``[B or 1, H or 1, 1 or T + S_r, T + S]`` over the full key
            sequence in the same order (bool True = attend, or additive float): a key padding mask, or
            the rows of this rank's queries of a query-dependent mask.

    Returns:
        ``[B, H, T + S_r, D]``: this rank's rows of softmax(Q Kᵀ·scale + mask) V over all T + S keys.
    """
    pending = start_kv_gather(key, value, sizes, group, text_len=text_len, text_layout=text_layout)
    return finish_kv_gather(pending, query, scale=scale, kernel=kernel, key_mask=key_mask)


def kv_gather_attention_copy_engine(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sizes: list[int],
                                    group, *, scale: float | None = None, kernel: str = "auto", text_len: int = 0,
                                    text_layout: str | None = None, key_mask: torch.Tensor | None = None,
                                    head_groups: int | str = "auto") -> torch.Tensor:
    """:func:`kv_gather_attention` with K and V moved by the copy engines, pipelined over head groups.

    Same arguments, result (bit-identical) and output shape ``[B, H, T + S_r, D]``; CUDA tensors of
    one dtype on an NCCL group of one host (:func:`diffusers_sp.copy_engine.copy_engine_unavailable_reason`).
    ``head_groups`` (G, see :func:`head_group_sizes`): the attention runs as G calls over balanced
    head groups; the transfer of group g + 1 runs while group g attends, so about 1/G of the
    transfer stays exposed (less when the query's projection, norm and RoPE run in between, as
    :func:`start_kv_gather` allows).

    Raises:
        RuntimeError: surfacing at a later synchronization, a symmetric-memory barrier timed out (a
            peer did not arrive within the group's collective timeout,
            :func:`~diffusers_sp.copy_engine.barrier_timeout_ms`), which aborts the kernel.

    Every rank pushes: its buffer, laid out ``[(K, V), group g: [S, B, h_g, D]]`` (rows of rank p at
    ``sum(sizes[:p])``), is written by itself and its peers. Per call:

    1. side stream, after the compute stream's work so far (this rank's previous attention has read
       its buffer): barrier (every rank may now be written to); per head group, 2-D copy-engine
       copies (:func:`~diffusers_sp.copy_engine.copy_rows`) of this rank's K and V rows of that
       group, straight from the model's token-major tensors into every peer's buffer, then a barrier
       (every peer's rows of this group have arrived) and an event; meanwhile a second stream copies
       this rank's own rows into its own buffer on a copy engine, group by group;
    2. compute stream: attention of group g after both its events, over ``[B, h_g, S, D]`` views of
       the buffer; the second stream copies each group's output into one ``[B, T + S_r, H, D]``
       buffer (under the next group's attention), which the compute stream waits for at the end
       (with G = 1 the attention output itself is returned).
    """
    pending = start_kv_gather(key, value, sizes, group, copy_engine=True, head_groups=head_groups,
                              text_len=text_len, text_layout=text_layout)
    return finish_kv_gather(pending, query, scale=scale, kernel=kernel, key_mask=key_mask)


def _start_copy_engine(img_k, img_v, sizes, group, head_groups, txt_k, txt_v, text_layout):
    """Step 1 of :func:`kv_gather_attention_copy_engine`; returns its step 2 as a function of the query."""
    P, r = group.world_size, group.rank
    B, H, D = img_k.shape[0], img_k.shape[1], img_k.shape[3]
    heads = head_group_sizes(H, head_groups)
    G, S = len(heads), sum(sizes)
    offsets = [sum(sizes[:i]) for i in range(P)]
    dtype, device = img_k.dtype, img_k.device
    # Region of (tensor i, group g): [S, B, h_g, D] at element offset base[i][g], alike on every rank.
    per_tensor = S * B * H * D
    base = [[i * per_tensor + S * B * sum(heads[:g]) * D for g in range(G)] for i in range(2)]
    ws = workspace(group, 2 * per_tensor * img_k.element_size(), device)
    flat = ws.buffer[:2 * per_tensor * img_k.element_size()].view(dtype)

    def region(i: int, g: int) -> torch.Tensor:
        return flat[base[i][g]:base[i][g] + S * B * heads[g] * D].view(S, B, heads[g], D)

    compute, local = torch.cuda.current_stream(device), ws.local
    inputs = [t.permute(2, 0, 1, 3) for t in (img_k, img_v)]  # [S_r, B, H, D] views
    starts = [sum(heads[:g]) for g in range(G)]
    _push_rows(ws, compute, inputs, region, base, heads, starts, (offsets[r], offsets[r] + sizes[r]), P, r)

    def attend(query, *, scale=None, kernel="auto", key_mask=None):
        if torch.cuda.current_stream(device) != compute:
            raise RuntimeError("the copy-engine K/V transfer must be finished on the stream that started it")
        L = query.shape[2]
        per_head_mask = key_mask is not None and key_mask.shape[1] > 1
        out = query.new_empty(B, L, H, D).permute(0, 2, 1, 3) if G > 1 else None
        for g in range(G):
            hs = slice(starts[g], starts[g] + heads[g])
            compute.wait_event(ws.event(g))
            compute.wait_event(ws.event(G + g))
            k = join_text_image(txt_k[:, hs], region(0, g).permute(1, 2, 0, 3), text_layout)
            v = join_text_image(txt_v[:, hs], region(1, g).permute(1, 2, 0, 3), text_layout)
            o = local_attention(query[:, hs], k, v, attn_mask=key_mask[:, hs] if per_head_mask else key_mask,
                                scale=scale, kernel=kernel)
            if out is None:
                return o
            done = ws.event(2 * G + g)
            done.record(compute)
            o.record_stream(local)
            with torch.cuda.stream(local):  # into the joined output on a copy engine, under the next group
                local.wait_event(done)
                copy_or_fallback(out[:, hs], o)
        compute.wait_stream(local)
        return out

    return attend


def _push_rows(ws, compute, inputs, region, base, heads, starts, rows_range, P, r) -> None:
    """The transfers of :func:`_start_copy_engine`: this rank's rows of K and V (``inputs``,
    ``[S_r, B, H, D]`` views) pushed into every peer's symmetric buffer, head group by head group, on
    the workspace's side stream (event ``g`` when group ``g`` has arrived everywhere), and into its own
    buffer on a copy engine beside the pushes (event ``G + g``)."""
    G, (lo, hi) = len(heads), rows_range
    S, B, _, D = region(0, 0).shape
    dtype, timeout = inputs[0].dtype, barrier_timeout_ms()
    ws.follow(compute, inputs)
    with torch.cuda.stream(ws.stream):
        ws.handle.barrier(channel=0, timeout_ms=timeout)
        for g in range(G):
            for step in range(1, P):
                p = (r + step) % P
                for i, rows in enumerate(inputs):
                    remote = ws.handle.get_buffer(p, (S, B, heads[g], D), dtype, base[i][g])[lo:hi]
                    copy_or_fallback(remote, rows[:, :, starts[g]:starts[g] + heads[g]])
            ws.handle.barrier(channel=0, timeout_ms=timeout)
            ws.event(g).record(ws.stream)
        ws.free.record(ws.stream)
    with torch.cuda.stream(ws.local):  # own rows, on a copy engine beside the pushes
        for g in range(G):
            for i, rows in enumerate(inputs):
                copy_or_fallback(region(i, g)[lo:hi], rows[:, :, starts[g]:starts[g] + heads[g]])
            ws.event(G + g).record(ws.local)


class KVGatherAttnProcessor(SequenceParallelAttnProcessor):
    """Attention processor running the model's own processor with K/V-gather sequence parallelism.

    See :func:`kv_gather_attention` (NCCL) and :func:`kv_gather_attention_copy_engine` (copy
    engines) for the algorithm. With a family's ``kv_first`` hook (Wan), K and V are started by
    :func:`start_kv_gather` before the query projection runs, which then overlaps their transfer.
    See :class:`~diffusers_sp.processors.base.SequenceParallelAttnProcessor` for the arguments.
    """

    strategy = "kv_gather"
    supports_kv_first = True

    def start_attention(self, key, value, sizes, *, text_len=0, text_layout=None):
        return start_kv_gather(key, value, sizes, self.state.group, copy_engine=self.use_copy_engine(key),
                               head_groups=self.head_groups, text_len=text_len, text_layout=text_layout)

    def finish_attention(self, pending, query, *, scale=None):
        return finish_kv_gather(pending, query, scale=scale, kernel=self.kernel)

    def parallel_attention(self, query, key, value, sizes, *, scale, text_len=0, text_layout=None, key_mask=None):
        pending = self.start_attention(key, value, sizes, text_len=text_len, text_layout=text_layout)
        return finish_kv_gather(pending, query, scale=scale, kernel=self.kernel, key_mask=key_mask)


def key_split_mask(attn_mask: torch.Tensor | None, batch: int, heads: int, query_len: int, key_len: int,
                   where: str) -> torch.Tensor | None:
    """Checks the mask of a call with whole queries over this rank's ``key_len`` keys; returns it 4-D.

    Args:
        attn_mask: ``None`` or an SDPA mask (boolean, True = attend, or additive float) broadcastable
            to ``[batch, heads, query_len, key_len]`` (fewer dims are aligned right, as SDPA does).
        where: Processor name for error messages.

    Returns:
        ``None`` or ``[B or 1, H or 1, query_len or 1, key_len]``. A mask that varies with the query is
        fine here: every rank holds every query row, and its own keys' columns of each.

    Raises:
        SequenceParallelConfigError: the mask does not broadcast to the call's shape.
    """
    if attn_mask is None:
        return None
    m = attn_mask
    while m.dim() < 4:
        m = m.unsqueeze(0)
    if (m.dim() != 4 or m.shape[-1] != key_len or m.shape[0] not in (1, batch) or m.shape[1] not in (1, heads)
            or m.shape[2] not in (1, query_len)):
        raise SequenceParallelConfigError(
            f"{where}: attention mask of shape {tuple(attn_mask.shape)} does not broadcast over the call's queries "
            f"and this rank's {key_len} keys (expected [B or 1, H or 1, {query_len} or 1, {key_len}]).")
    return m


class SplitKVAttnProcessor(SequenceParallelAttnProcessor):
    """Attention processor for calls whose queries are whole on every rank while their keys and
    values are this rank's shard of the split sequence: LTX-2's video-to-audio attention, whose audio
    queries stay replicated while the video tokens are split (see
    :attr:`~diffusers_sp.pipelines.FamilySpec.split_kv_attention_modules`).

    Whatever the mode, the keys and values ``[B, H, S_r, D]`` are all-gathered
    (:func:`kv_gather_attention`, over the group's collectives) and every rank attends all its
    queries ``[B, H, Lq, D]`` over the full ``S`` keys, so the output ``[B, H, Lq, D]`` is the same on
    every rank, as the replicated tokens it updates must be. Ulysses cannot run such a call: it
    exchanges query rows split along the sequence, and these queries are not split. A mask's key
    columns are gathered with the keys (:func:`key_split_mask`); one that varies with the query is
    exact too, since every rank holds every query row.

    See :class:`~diffusers_sp.processors.base.SequenceParallelAttnProcessor` for the arguments
    (``transport``, ``head_groups`` and ``kv_first`` do not apply).
    """

    strategy = "kv_gather"

    def _attend(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):
        name = type(self.inner).__name__
        key, value, enable_gqa = self._expand_kv_heads(query, key, value, enable_gqa)
        self._check_call(name, query, key, dropout_p, is_causal, enable_gqa)
        sizes = self.state.shard_sizes()
        local = sizes[self.state.group.rank]
        if key.shape[2] != local or value.shape[2] != local:
            raise SequenceParallelConfigError(  # the rank's own shard size left out: the same text on every rank
                f"{name}: expected keys and values of this rank's shard of the split sequence ({self.state.seq_len} "
                f"tokens in shards of {sizes} over {len(sizes)} ranks), got keys of {key.shape[2]} and values of "
                f"{value.shape[2]} tokens. The sharding plan does not match the model's forward.")
        mask = key_split_mask(attn_mask, query.shape[0], query.shape[1], query.shape[2], local, name)
        self.state.group.check_device(query.device)
        mask = gather_key_padding_mask(mask, 0, None, sizes, self.state.group)
        return kv_gather_attention(query, key, value, sizes, self.state.group, scale=scale, kernel=self.kernel,
                                   key_mask=mask)


class PrefixKVAttnProcessor(KVGatherAttnProcessor):
    """Attention processor for models whose sequence is ``[W whole tokens; the split sequence]`` and
    whose processor makes several attention calls over parts of it, each classified by its shapes:

    * keys and queries among the whole tokens only (``L_k <= W``): run as they are, on every rank alike
      (QwenImage 2.1's block-causal prefix: text and condition images, one call per block of them, with
      the causal mask of the text);
    * this rank's split tokens as queries over ``[W_k whole; this rank's shard]`` keys (``L_q = S_r``):
      K/V-gather, the whole keys joined once to the gathered shard keys (QwenImage 2.1's target image
      over everything before it; in its cached steps ``W_k`` are the prefix keys its K/V cache holds);
    * queries and keys of the same ``[whole; shard]`` tokens: joint attention, K/V-gather.

    ``W`` is read per call from the processor's input (``hidden_states`` ``[B, W + S_r, C]``). K/V-gather
    runs whatever the mode: Ulysses exchanges query rows along with the keys, and these queries hold
    only part of the keys' tokens. A key padding mask over the call's keys is gathered with them; a mask
    that varies with the query is refused on the split calls, and a non-tensor mask (a flex
    ``BlockMask``) on any. See :class:`~diffusers_sp.processors.base.SequenceParallelAttnProcessor` for
    the arguments (``transport``, ``head_groups`` and ``kv_first`` do not apply).
    """

    supports_kv_first = False
    #: Where the whole keys of a split-query call sit: before the shard's keys (``"prefix"``) or after them.
    key_layout = "prefix"

    def _run_parallel(self, attn, *args, **kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        self._whole = hidden.shape[1] - self.state.shard_sizes()[self.state.group.rank]
        return super()._run_parallel(attn, *args, **kwargs)

    def _attend(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):
        name = type(self.inner).__name__
        if attn_mask is not None and not torch.is_tensor(attn_mask):
            raise SequenceParallelConfigError(
                f"{name}: an attention call with a {type(attn_mask).__name__} mask (flex attention's block mask over "
                f"the whole sequence); under sequence parallelism each rank holds only its part of the sequence. "
                f"Use the model's default processor (for QwenImage 2.1, QwenImage21AttnProcessor).")
        sizes = self.state.shard_sizes()
        local, whole = sizes[self.state.group.rank], self._whole
        q_len, k_len = query.shape[2], key.shape[2]
        if k_len <= whole and q_len <= whole:  # whole tokens only: what one process computes
            return _SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                         scale=scale, enable_gqa=enable_gqa)
        if q_len != local or k_len < local:  # [whole; shard] queries too: joint attention (checked there)
            return super()._attend(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                   is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        key, value, enable_gqa = self._expand_kv_heads(query, key, value, enable_gqa)
        self._check_call(name, query, key, dropout_p, is_causal, enable_gqa)
        whole_keys = k_len - local  # whole keys beside this rank's shard, on the side of key_layout
        mask = normalize_key_padding_mask(attn_mask, query.shape[0], query.shape[1], k_len, name)
        self.state.group.check_device(query.device)
        mask = gather_key_padding_mask(mask, whole_keys, self.key_layout, sizes, self.state.group)
        pending = start_kv_gather(key, value, sizes, self.state.group, text_len=whole_keys, text_layout=self.key_layout)
        return finish_kv_gather(pending, query, scale=scale, kernel=self.kernel, key_mask=mask)


class SuffixKVAttnProcessor(PrefixKVAttnProcessor):
    """:class:`PrefixKVAttnProcessor` for calls whose keys are ``[this rank's shard; W_k whole]``: each rank's
    image queries over its image keys followed by the text's (NucleusMoE-Image joins ``[image; text]`` keys
    and values for image-only queries). The same K/V-gather, the whole keys joined after the gathered
    shards; a key padding mask over the call's keys is gathered with them."""

    key_layout = "suffix"
