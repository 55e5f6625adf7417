"""Shared machinery of the sequence-parallel attention processors.

A processor here wraps the model's own processor: projections, QK-norm, RoPE and any joint
concatenation stay the model's code. Only its attention call is taken over: while the wrapped
processor runs, a :class:`torch.overrides.TorchFunctionMode` catches
``torch.nn.functional.scaled_dot_product_attention`` (which Diffusers' ``dispatch_attention_fn``
ends in with the ``native`` backend, pinned on the inner processor, and which CogVideoX, Mochi and
SD3 processors call directly) and routes it through the strategy of the subclass.

Joint attention (text tokens inside the self-attention sequence: Flux, SD3, CogVideoX, QwenImage,
HunyuanVideo, Mochi). The text is replicated on every rank and only the image/video tokens are
sharded, so the attention call a rank makes sees ``T + S_r`` tokens: ``T`` text tokens (the same on
every rank) and this rank's ``S_r`` image tokens, text first (``"prefix"``) or last (``"suffix"``)
as the family declares (``SequenceState.extra["joint_text"]``). ``T`` is read from each call as
``L - S_r`` (so Mochi's per-sample calls with a different number of valid text tokens work).

IP-Adapter processors (Diffusers' ``FluxIPAdapterAttnProcessor``, ``SD3IPAdapterJointAttnProcessor2_0``,
``FluxIPAdapterJointAttnProcessor2_0``: any processor class named ``*IPAdapter*``) make one attention
call more per image prompt after the self-attention: from this rank's image queries to the image-prompt
tokens, which every rank holds whole (cross-attention over replicated keys: each query row needs no
other rank's data). Its operands cannot be told from a self-attention call in general (a rank's shard
may be as long as the image prompt), so the wrapper counts instead: for such a processor only the first
attention call of each invocation (the self-attention, which these processors make first) runs in
parallel; the later ones run locally as the model wrote them, with no communication.

Masks: see :mod:`diffusers_sp.processors.masks` (which masks a rank can apply exactly, and how).
The capture of the attention call: :mod:`diffusers_sp.processors.capture`.
"""

from __future__ import annotations

import inspect

import torch

from ..comm import all_gather_along
from ..errors import SequenceParallelConfigError
from ..kernels.sdpa import local_attention
from ..plan_entries import SequenceState
from .capture import _SDPA, PARALLEL_CALL, _AttentionCallIntercept, _specialize, _with_dispatch, _without_backward
from .masks import (full_sequence_mask, gather_key_padding_mask, is_image_identity_mask,
                    join_text_image, normalize_key_padding_mask, query_rows, split_text_image,
                    symmetric_padding_vector)


class PendingKV:
    """K and V of one attention call in flight, between a strategy's ``start_*`` and ``finish_*``
    functions (:func:`~diffusers_sp.processors.kv_gather.start_kv_gather`,
    :func:`~diffusers_sp.processors.ulysses.start_ulysses`); consumed once.

    Args:
        finish: ``(query, *, scale, kernel, key_mask) -> output``, the rest of the strategy's call.
    """

    def __init__(self, finish):
        self._finish = finish

    def finish(self, query: torch.Tensor, **kwargs) -> torch.Tensor:
        """Runs the rest of the call on ``query``; raises RuntimeError when called a second time."""
        finish, self._finish = self._finish, None
        if finish is None:
            raise RuntimeError("this K/V transfer was already consumed by an attention call")
        return finish(query, **kwargs)


class SequenceParallelAttnProcessor:
    """Base class: wraps a Diffusers attention processor and takes over its attention call.

    Args:
        inner: The model's own processor for this attention module (e.g. ``WanAttnProcessor``).
        state: The model's :class:`~diffusers_sp.plan_entries.SequenceState` (group, current image
            sequence length, and ``extra["joint_text"]``: ``None``, ``"prefix"`` or ``"suffix"``),
            shared with the sharding hooks.
        kernel: Local attention kernel, see :func:`diffusers_sp.kernels.sdpa.local_attention`.
        transport: ``"nccl"`` (the group's collectives; also gloo) or ``"copy_engine"``
            (:mod:`diffusers_sp.copy_engine`; resolved by ``enable_sequence_parallel``). Used by the
            dense strategies; see :meth:`use_copy_engine`.
        head_groups: G of the copy-engine pipeline (``"auto"`` or a positive int).
        kv_first: ``None`` or the family's self-attention with K and V made before the queries
            (:attr:`diffusers_sp.pipelines.FamilySpec.self_attention_kv_first`), called as
            ``kv_first(inner, attn, args, kwargs, start_kv, finish_kv)`` in place of the model's
            processor; it returns ``NotImplemented`` for calls it does not cover, which then run the
            model's processor. With :attr:`supports_kv_first` ``start_kv`` starts the K/V transfer,
            which then overlaps the query projection; other strategies (VSA) get a ``start_kv`` that
            holds K and V until the queries come (the family's rewrite may still run faster kernels
            of the same bits, Wan's RoPE).
        attention_scale: ``None`` or the family's
            :attr:`~diffusers_sp.pipelines.FamilySpec.attention_scale`: the softmax scale the model's
            processor would pass over the full sequence, for a processor that derives it from the
            length it sees (Lumina-Next's proportional attention); it replaces the scale of the call.
        streams: How many shards of the split sequence each call of the module joins, one after the
            other (this rank's shard of each, of the same length): 1, or 2 for attention over two streams
            of the same tokens (MotifVideo's decoder layers: ``[decoder tokens; encoder output]``). The
            call is then one of a sequence of ``streams * S`` tokens, this rank holding ``streams * S_r``
            of them; without a mask, attention does not depend on the order of the keys, so gathering
            them rank by rank (``[dec_0; enc_0; dec_1; enc_1; ...]``) is exact.

    Subclasses implement :meth:`parallel_attention`, and may implement :meth:`start_attention` and
    :meth:`finish_attention` (setting :attr:`supports_kv_first`). Tensors seen by it are ``[B, H, T + S_r, D]``
    (Diffusers' SDPA layout): ``T`` replicated text tokens (0 without joint text) and this rank's
    shard of ``S_r`` image tokens, in the family's order. In a forward that runs whole (fewer tokens than
    ranks: :func:`~diffusers_sp.plan_entries.run_whole`) the model's own processor runs instead.

    Inference only: with grad mode on and more than one rank, the call runs under ``torch.no_grad()``
    and its output, when any input or parameter requires grad, gets a backward that raises
    RuntimeError (outside ``torch.compile``; inside it the call is traced as it is, and a backward
    through the collectives gets no gradient from the other ranks).
    """

    strategy = "base"
    supports_kv_first = False
    #: Whether :meth:`parallel_attention` attends the queries of every rank (Ulysses: all tokens of its
    #: heads) rather than this rank's own (K/V-gather): which rows of a full-sequence mask it receives.
    attends_all_queries = False
    _inner_cls = None

    def __new__(cls, inner, *args, **kwargs):
        if cls._inner_cls is not type(inner):
            cls = _specialize(cls, type(inner))
        return object.__new__(cls)

    def __init__(self, inner, state: SequenceState, *, kernel: str = "auto", transport: str = "nccl",
                 head_groups: int | str = "auto", kv_first=None, dispatch: bool = False, attention_scale=None,
                 streams: int = 1):
        self.inner = inner
        self.state = state
        self.kernel = kernel
        self.transport = transport
        self.head_groups = head_groups
        self.kv_first = kv_first
        # IP-Adapter processors: only their first attention call per invocation is the self-attention
        # (module docstring); None: every intercepted call is.
        self.parallel_calls = 1 if "IPAdapter" in type(inner).__name__ else None
        self._calls_left = None
        self._seen = 0  # F.scaled_dot_product_attention calls caught in the current call (sdpa mode)
        self.attention_scale = attention_scale
        self.streams = streams
        self._scale = None  # the current call's full-sequence scale (attention_scale), None: the call's own
        self._dispatch_call = None
        if dispatch:
            call = type(inner).__call__
            if "dispatch_attention_fn" not in call.__globals__:
                raise SequenceParallelConfigError(
                    f"{type(inner).__name__} does not call Diffusers' dispatch_attention_fn, so the attention calls "
                    f"that its model marks for context parallelism cannot be found; the model needs a family "
                    f"module in diffusers_sp.pipelines.")
            self._dispatch_original = call.__globals__["dispatch_attention_fn"]
            self._dispatch_call = _with_dispatch(call, self._dispatch)

    def use_copy_engine(self, query: torch.Tensor) -> bool:
        """Whether this call moves its tensors by the copy engines: ``transport="copy_engine"``, CUDA
        tensors, and not under ``torch.compile`` (streams and events do not trace; the NCCL path's
        functional collectives do)."""
        return self.transport == "copy_engine" and query.is_cuda and not torch.compiler.is_compiling()

    def _run(self, attn, *args, **kwargs):
        if self.state.whole is not None:
            # The forward runs whole on every rank (fewer tokens than ranks: plan_entries.run_whole):
            # the model's own processor is what one process runs.
            return self.inner(attn, *args, **kwargs)
        if torch.is_grad_enabled() and self.state.group.world_size > 1 and not torch.compiler.is_compiling():
            # Inference only: the exchanges carry no gradient, so the call runs without autograd
            # (which also saves the memory of its graph), and the output gets a backward that raises.
            # Not at world size 1 (nothing is exchanged: autograd works as without us), and not inside
            # torch.compile, where a Function whose backward raises cannot be traced (a graph break
            # per layer); there the call is traced as it is.
            with torch.no_grad():
                out = self._run_parallel(attn, *args, **kwargs)
            return _without_backward(out, attn, args, kwargs)
        return self._run_parallel(attn, *args, **kwargs)

    def _run_parallel(self, attn, *args, **kwargs):
        self._calls_left = self.parallel_calls
        if self.attention_scale is not None:
            bound = inspect.signature(self.inner.__call__).bind(attn, *args, **kwargs)
            self._scale = self.attention_scale(attn, bound.arguments, self.state.seq_len)
        if self.kv_first is not None:
            start, finish = ((self._start_kv, self._finish_kv) if self.supports_kv_first
                             else (self._hold_kv, self._attend_held))
            out = self.kv_first(self.inner, attn, args, kwargs, start, finish)
            if out is not NotImplemented:
                return out
        if self._dispatch_call is not None:
            return self._dispatch_call(self.inner, attn, *args, **kwargs)
        self._seen = 0
        with _AttentionCallIntercept(self._intercepted):
            out = self.inner(attn, *args, **kwargs)
        if not self._seen and self.state.group.world_size > 1:
            # The processor attended without F.scaled_dot_product_attention: through another kernel of
            # Diffusers' attention dispatcher, chosen globally (attention_backend(...),
            # DIFFUSERS_ATTN_BACKEND) where the processor passes no backend of its own. Each rank would
            # then have attended to its own tokens only; every rank gets here alike.
            raise SequenceParallelConfigError(
                f"{type(self.inner).__name__} made no scaled_dot_product_attention call for sequence parallelism "
                f"to take over: its attention ran through another kernel (a Diffusers attention backend set "
                f"globally, with attention_backend(...) or DIFFUSERS_ATTN_BACKEND), so each rank would attend to "
                f"its own tokens only. Use Diffusers' native attention backend (the default) with sequence "
                f"parallelism; diffusers-sp's attention_kernel option chooses the local kernel.")
        return out

    def _dispatch(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False, attention_kwargs=None, *, backend=None, parallel_config=None):
        """``dispatch_attention_fn`` as the model's processor sees it in dispatch mode: calls marked
        :data:`PARALLEL_CALL` (``[B, S, H, D]``) run through the strategy, the others go to Diffusers'
        dispatcher unchanged (with no parallel config).

        A marked call made before the plan split any forward argument in this forward
        (``SequenceState.inputs_split``) also runs unchanged: its tokens are whole on every rank, so the
        call is the one a single process makes. Diffusers hands its context-parallel config to every
        attention processor of the model, whether or not its tokens are split, e.g. to the text refiner
        that MiniMax-H3 runs before its plan splits the packed sequence at the first block."""
        if parallel_config is not PARALLEL_CALL or not self.state.inputs_split or not self._take_call():
            return self._dispatch_original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                           is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                                           attention_kwargs=attention_kwargs, backend=backend, parallel_config=None)
        if attn_mask is not None and attn_mask.ndim == 2:  # [B, Lk], as Diffusers' native backend reads it
            attn_mask = attn_mask[:, None, None, :]
        out = self._attend(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=attn_mask,
                           dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)

    def _text_len(self, name: str, query_len: int, key_len: int, sizes: list[int]) -> int:
        """T of a call whose queries and keys have these lengths; raises if they are not this rank's shard."""
        layout = self.state.extra.get("joint_text")
        text_len = query_len - sizes[self.state.group.rank]
        if key_len == query_len and text_len > 0 and layout is None:
            # T is the same on every rank (S_r is not), so the message is: every rank raises it alike.
            owner = f"{self.state.owner}: " if self.state.owner else ""
            raise SequenceParallelConfigError(
                f"{owner}{name}: an attention call over the split sequence ({self.state.seq_len} tokens over "
                f"{len(sizes)} ranks) also holds {text_len} other tokens (text joined to the split tokens inside "
                f"the call, for instance), and the sharding plan does not say where they sit: for a model "
                f"without a family module, that is what its Diffusers _cp_plan lacks. Sequence parallelism "
                f"cannot run this call exactly; run the model without it (the model needs a family module "
                f"in diffusers_sp.pipelines).")
        if key_len != query_len or text_len < 0 or (text_len > 0 and layout is None):
            expected = (f"{sizes[self.state.group.rank]} image tokens" if layout is None
                        else f"{sizes[self.state.group.rank]} image tokens plus the text tokens ({layout})")
            raise SequenceParallelConfigError(
                f"{name}: expected this rank's shard of {expected} (image sequence {self.state.seq_len} over "
                f"{len(sizes)} ranks) in self-attention, got queries of {query_len} and keys of {key_len} "
                f"tokens. The sharding plan does not match the model's forward.")
        return text_len

    def _shard_sizes(self) -> list[int]:
        """Tokens of each rank in one call of this module: its shard of the split sequence, times :attr:`streams`."""
        return [size * self.streams for size in self.state.shard_sizes()]

    def _start_kv(self, key: torch.Tensor, value: torch.Tensor):
        """``start_kv`` of :attr:`kv_first`: checks K and V ``[B, H, T + S_r, D]`` and starts their transfer."""
        name = type(self.inner).__name__
        sizes = self._shard_sizes()
        if value.shape != key.shape:
            raise SequenceParallelConfigError(
                f"{name}: keys {tuple(key.shape)} and values {tuple(value.shape)} differ in shape.")
        text_len = self._text_len(name, key.shape[2], key.shape[2], sizes)
        self.state.group.check_device(key.device)
        pending = self.start_attention(key, value, sizes, text_len=text_len,
                                       text_layout=self.state.extra.get("joint_text"))
        return pending, tuple(key.shape), key.dtype

    def _finish_kv(self, started, query: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """``finish_kv`` of :attr:`kv_first`: attention of ``query`` (shaped like the keys) over the started K/V."""
        pending, shape, dtype = started
        if tuple(query.shape) != shape or query.dtype != dtype:
            raise SequenceParallelConfigError(
                f"{type(self.inner).__name__}: queries {tuple(query.shape)} {query.dtype} do not match the "
                f"keys {shape} {dtype}.")
        return self.finish_attention(pending, query, scale=scale)

    @staticmethod
    def _hold_kv(key: torch.Tensor, value: torch.Tensor):
        """``start_kv`` of :attr:`kv_first` for strategies without :attr:`supports_kv_first`: nothing starts."""
        return key, value

    def _attend_held(self, held, query: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """``finish_kv`` of :attr:`kv_first` for strategies without :attr:`supports_kv_first`: the attention
        call the model's processor would make, ``[B, H, S_r, D]`` each."""
        key, value = held
        return self._attend(query, key, value, scale=scale)

    def _take_call(self) -> bool:
        """Whether this attention call is the one to run in parallel (see ``parallel_calls``)."""
        if self._calls_left is None:
            return True
        if self._calls_left == 0:
            return False
        self._calls_left -= 1
        return True

    def _intercepted(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                     enable_gqa=False):
        """An ``F.scaled_dot_product_attention`` call caught inside the wrapped processor: the
        self-attention through the strategy, an IP-Adapter processor's later calls as they are (the
        interception mode is off inside its handler, so this is the plain function)."""
        self._seen += 1
        if not self._take_call():
            return _SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                         scale=scale, enable_gqa=enable_gqa)
        return self._attend(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa)

    def _check_call(self, name: str, query, key, dropout_p, is_causal, enable_gqa) -> None:
        """Raises SequenceParallelConfigError for what no strategy splits: causal attention, dropout,
        K/V heads that differ from the query heads (after :meth:`_expand_kv_heads`)."""
        if is_causal:
            raise SequenceParallelConfigError(
                f"{name}: causal attention depends on the query position and is not supported under "
                f"sequence parallelism ({self.strategy}).")
        if dropout_p:
            raise SequenceParallelConfigError(f"{name}: attention dropout is not supported under sequence parallelism.")
        if enable_gqa or key.shape[1] != query.shape[1]:
            raise SequenceParallelConfigError(
                f"{name}: queries of {query.shape[1]} heads over keys of {key.shape[1]} heads: grouped-query "
                f"attention needs the query heads a multiple of the K/V heads and enable_gqa=True.")

    @staticmethod
    def _expand_kv_heads(query, key, value, enable_gqa):
        """``(key, value, enable_gqa)`` with grouped-query K/V (``enable_gqa``, ``H_q`` a multiple of ``H_kv``)
        repeated to the query heads, as SDPA's own ``enable_gqa`` does (``repeat_interleave`` over dim 1), so the
        strategies see one K/V head per query head; anything else as it came (checked by :meth:`_check_call`)."""
        if enable_gqa and key.shape[1] != query.shape[1] and query.shape[1] % key.shape[1] == 0:
            groups = query.shape[1] // key.shape[1]
            return key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1), False
        return key, value, enable_gqa

    def _attend(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):
        name = type(self.inner).__name__
        key, value, enable_gqa = self._expand_kv_heads(query, key, value, enable_gqa)
        self._check_call(name, query, key, dropout_p, is_causal, enable_gqa)
        scale = scale if self._scale is None else self._scale
        sizes = self._shard_sizes()
        layout = self.state.extra.get("joint_text")
        length = query.shape[2]
        text_len = self._text_len(name, length, key.shape[2], sizes)
        group = self.state.group
        group.check_device(query.device)
        full_length = text_len + sum(sizes)
        if attn_mask is not None and attn_mask.shape[-1] == full_length and len(sizes) > 1:
            if self.streams > 1:  # its keys are in the model's order, not rank by rank (same on every rank)
                raise SequenceParallelConfigError(
                    f"{name}: a mask over the full sequence in attention over {self.streams} streams of the split "
                    f"tokens is not supported.")
            # Made by the model over the full sequence before its tokens were split (the key lengths of
            # the two kinds differ at every world size above 1): complete already, nothing to exchange.
            mask = full_sequence_mask(attn_mask, query.shape[0], query.shape[1], full_length, name)
            if not self.attends_all_queries:
                mask = query_rows(mask, text_len, layout, sizes, group.rank)
            return self.parallel_attention(query, key, value, sizes, scale=scale, text_len=text_len,
                                           text_layout=layout, key_mask=mask)
        # min(sizes) > 1: a 1 x 1 image block is the identity and open alike, so on a rank with one image
        # token an open query-dependent mask would pass for one, while the other ranks refuse it.
        if attn_mask is not None and min(sizes) > 1 and attn_mask.dim() >= 2 and attn_mask.shape[-2] > 1 and \
                is_image_identity_mask(attn_mask, text_len, layout):
            return self._identity_attention(query, key, value, attn_mask, sizes, scale=scale, text_len=text_len,
                                            text_layout=layout)
        padding = None
        if attn_mask is not None and attn_mask.dim() >= 2 and attn_mask.shape[-2] > 1:
            padding = symmetric_padding_vector(attn_mask, query.shape[0], query.shape[1], length)
            if group.world_size > 1:
                # Read from values, not shapes: every rank must take the same branch (a rank that
                # raised below while the others gathered would leave them waiting).
                flags = all_gather_along(torch.tensor([padding is not None], device=query.device).to(torch.uint8),
                                         0, [1] * group.world_size, group)
                padding = padding if bool(flags.all()) else None
        if padding is not None:
            return self._attend_padded(query, key, value, padding, sizes, scale=scale, text_len=text_len)
        mask = normalize_key_padding_mask(attn_mask, query.shape[0], query.shape[1], length, name)
        mask = gather_key_padding_mask(mask, text_len, layout, sizes, group)
        return self.parallel_attention(query, key, value, sizes, scale=scale, text_len=text_len,
                                       text_layout=layout, key_mask=mask)

    def _identity_attention(self, query, key, value, attn_mask, sizes, *, scale, text_len, text_layout):
        """The attention of a call masked by :func:`is_image_identity_mask` (PAG's perturbed pass).

        ``query``, ``key``, ``value``: ``[B, H, text_len + sizes[rank], D]``; ``attn_mask`` this rank's
        ``[.., L, L]`` part of the mask. The image rows attend here, to this rank's keys under the mask
        (their own image token and the replicated text); the text rows are those of the strategy's
        unmasked attention over the whole sequence (the mask leaves them open), computed with the image
        rows, which are dropped. Without text the pass is local: every token attends to itself.

        Returns:
            ``[B, H, text_len + sizes[rank], D]``.
        """
        mask = attn_mask if attn_mask.dim() == 4 else attn_mask[None, None]
        _, image_query = split_text_image(query, text_len, text_layout)
        _, image_mask = split_text_image(mask, text_len, text_layout, dim=2)
        image = local_attention(image_query, key, value, attn_mask=image_mask, scale=scale, kernel=self.kernel)
        if text_len == 0:
            return image
        self.state.group.check_device(query.device)
        full = self.parallel_attention(query, key, value, sizes, scale=scale, text_len=text_len,
                                       text_layout=text_layout, key_mask=None)
        text, _ = split_text_image(full, text_len, text_layout)
        return join_text_image(text, image, text_layout)

    def _attend_padded(self, query, key, value, padding, sizes, *, scale, text_len):
        """Attention under a padding mask over queries and keys (:func:`symmetric_padding_vector`):
        the rows of valid queries attend under the key padding mask ``padding`` (gathered over all
        keys), the rows of padding queries under the constant row the model's mask gives them (all
        False: fully masked, or all 0.0: unbiased), computed in a second call only when the batch has
        padding at all (the gathered mask tells, alike on every rank)."""
        layout = self.state.extra.get("joint_text")
        full = gather_key_padding_mask(padding, text_len, layout, sizes, self.state.group)
        out = self.parallel_attention(query, key, value, sizes, scale=scale, text_len=text_len,
                                      text_layout=layout, key_mask=full)
        if bool((full != 0).all()):
            return out
        constant = self.parallel_attention(query, key, value, sizes, scale=scale, text_len=text_len,
                                           text_layout=layout, key_mask=torch.zeros_like(full))
        return torch.where((padding != 0).transpose(-1, -2), out, constant)  # rows: [B or 1, H or 1, L, 1]

    def parallel_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           sizes: list[int], *, scale: float | None, text_len: int = 0,
                           text_layout: str | None = None, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of this rank's queries (text and image) over the full joint sequence.

        Args:
            query, key, value: ``[B, H, text_len + sizes[rank], D]``: the replicated text tokens and
                this rank's image shard, in the order given by ``text_layout``.
            sizes: Image tokens held by each rank (balanced shards of the full image sequence).
            scale: Softmax scale, ``None`` for ``1/sqrt(D)``.
            text_len: Text tokens T in the joint sequence (0: image tokens only).
            text_layout: ``"prefix"``, ``"suffix"``, or ``None`` when ``text_len == 0``.
            key_mask: ``None`` or a mask ``[B or 1, H or 1, Lq, text_len + sum(sizes)]`` over the full
                key sequence in the same order (bool True = attend, or additive float): ``Lq = 1`` (a
                key padding mask), or the rows of the queries the strategy attends: this rank's
                ``text_len + sizes[rank]`` when :attr:`attends_all_queries` is False, all
                ``text_len + sum(sizes)`` (in the model's order) when it is True.

        Returns:
            ``[B, H, text_len + sizes[rank], D]``: attention output of this rank's query rows; the
            text rows are the same on every rank.
        """
        raise NotImplementedError

    def start_attention(self, key: torch.Tensor, value: torch.Tensor, sizes: list[int], *, text_len: int = 0,
                        text_layout: str | None = None):
        """First half of :meth:`parallel_attention` for strategies with :attr:`supports_kv_first`:
        starts moving K and V (``[B, H, text_len + sizes[rank], D]``) before the queries exist, and
        returns an opaque object for :meth:`finish_attention` (no key mask: the family hooks run
        only unmasked calls)."""
        raise NotImplementedError

    def finish_attention(self, pending, query: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
        """Second half: attention of ``query`` (``[B, H, text_len + sizes[rank], D]``) over the K and V
        started by :meth:`start_attention`; returns ``[B, H, text_len + sizes[rank], D]``."""
        raise NotImplementedError
