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

Masks (boolean True = attend, or additive float, exactly as SDPA applies them). Two kinds are told
apart by their key length, which differs at every world size above 1 (``T + S_r < T + S``):

* a *local mask* over this call's ``T + S_r`` keys. A key padding mask (one value per batch element
  and key token, the same for every query; broadcastable to ``[B, H, 1, T + S_r]``): its text part is
  replicated, its image part is all-gathered with the same uneven sizes as the keys. A *padding mask
  over queries and keys*, ``M[q, k] = m[q] and m[k]`` for one padding vector ``m`` (boolean, or float
  ``m[q] * m[k]`` with ``m`` in {0, 1}: CogView4's ``attention_mask``): each row is then either ``m``
  (a key padding mask) or, for a padding query, constant, so the call runs as up to two
  key-padding-mask calls whose rows are merged (:func:`symmetric_padding_vector`). The *image identity
  mask* of perturbed-attention guidance (:func:`is_image_identity_mask`): every image query sees only
  its own image key and the text, which are all on its rank, and every text query sees every key.
* a *full-sequence mask* that the model built before its tokens were split, over all ``T + S`` keys:
  ``[B or 1, H or 1, 1 or T + S, T + S]`` (a key padding mask, or a query-dependent one such as
  SkyReels-V2's block-causal frame mask or Chroma's outer product of its text mask). Nothing is
  exchanged: K/V-gather, whose queries stay local, takes the rows of this rank's queries (the text
  rows and this rank's image rows, in the call's order), Ulysses, which attends every query of its
  heads, takes it whole (:func:`full_sequence_mask`, :func:`query_rows`).

The strategies then receive the mask over the full key sequence in the model's order. Any other mask
that varies along the query dimension but covers only this call's tokens would need the entries
between this rank's queries and the other ranks' keys, which no rank has: it raises
:class:`SequenceParallelConfigError`.
"""

from __future__ import annotations

import inspect
import types

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..comm import all_gather_along
from ..kernels.sdpa import local_attention
from ..sharding import SequenceState
from ..validation import SequenceParallelConfigError

_SDPA = F.scaled_dot_product_attention

#: Values of ``SequenceState.extra["joint_text"]``: where the text tokens sit in the joint sequence.
TEXT_LAYOUTS = (None, "prefix", "suffix")


def split_text_image(x: torch.Tensor, text_len: int, text_layout: str | None, dim: int = 2):
    """Splits a joint sequence into its text and image parts along ``dim``.

    Args:
        x: Tensor whose ``dim`` holds ``text_len`` text tokens and the image tokens.
        text_len: Number of text tokens T (0: no text).
        text_layout: ``"prefix"`` (text first), ``"suffix"`` (text last) or ``None`` (``text_len`` must be 0).

    Returns:
        ``(text, image)`` views; ``text`` has ``text_len`` entries along ``dim``.
    """
    n = x.shape[dim]
    if text_len == 0:
        return x.narrow(dim, 0, 0), x
    if text_layout == "prefix":
        return x.narrow(dim, 0, text_len), x.narrow(dim, text_len, n - text_len)
    if text_layout == "suffix":
        return x.narrow(dim, n - text_len, text_len), x.narrow(dim, 0, n - text_len)
    raise ValueError(f"text_layout must be 'prefix' or 'suffix' with text tokens, got {text_layout!r}")


def join_text_image(text: torch.Tensor, image: torch.Tensor, text_layout: str | None, dim: int = 2) -> torch.Tensor:
    """Inverse of :func:`split_text_image`: concatenates text and image parts in the family's order."""
    if text.shape[dim] == 0:
        return image
    parts = [text, image] if text_layout == "prefix" else [image, text]
    return torch.cat(parts, dim=dim)


def normalize_key_padding_mask(attn_mask: torch.Tensor | None, batch: int, heads: int, length: int,
                               where: str) -> torch.Tensor | None:
    """Checks that ``attn_mask`` is a key padding mask and returns it as a 4-D tensor.

    Args:
        attn_mask: ``None`` or the ``attn_mask`` of an SDPA call over ``length`` local keys: boolean
            (True = attend) or additive float, broadcastable to ``[batch, heads, Lq, length]``.
        batch, heads, length: Shape of the call (``length`` = local query = local key length).
        where: Processor name for error messages.

    Returns:
        ``None`` or ``[B or 1, H or 1, 1, length]`` (same dtype).

    Raises:
        SequenceParallelConfigError: the mask varies along the query dimension (a query-dependent
            mask cannot be completed from the local shard) or does not broadcast to the call's shape.
    """
    if attn_mask is None:
        return None
    m = attn_mask
    while m.dim() < 4:
        m = m.unsqueeze(0)
    if m.dim() != 4 or m.shape[-1] != length or m.shape[0] not in (1, batch) or m.shape[1] not in (1, heads):
        raise SequenceParallelConfigError(
            f"{where}: attention mask of shape {tuple(attn_mask.shape)} is not a key padding mask over the "
            f"{length} local tokens (expected [B, 1 or H, 1, {length}]).")
    if m.shape[2] != 1:
        raise SequenceParallelConfigError(
            f"{where}: the attention mask depends on the query position (shape [B, H, Lq, Lk] with Lq > 1) "
            f"and covers only this rank's shard of the tokens. Under sequence parallelism such a mask lacks the "
            f"entries between this rank's queries and the other ranks' keys, so it cannot be applied exactly; "
            f"supported are key padding masks ([B, 1, 1, L], one value per key token), padding masks over "
            f"queries and keys (M[q, k] = m[q] and m[k]) and masks the model builds over the full sequence "
            f"before it is split ([B, H, L_full, L_full]) (modes 'ulysses' and 'kv_gather' alike).")
    return m


def symmetric_padding_vector(attn_mask: torch.Tensor | None, batch: int, heads: int,
                             length: int) -> torch.Tensor | None:
    """The padding vector ``m`` of a mask over queries and keys ``M[q, k] = m[q] and m[k]``, or ``None``.

    Padding applied to both sides of the attention (the padding queries' rows masked too) makes such
    a mask; CogView4's processor (Diffusers 0.42) builds its float form ``(m mᵀ > 0).to(dtype)`` from
    the transformer's ``attention_mask``: an additive bias of 1.0 on valid query-key pairs and 0.0
    elsewhere. Each row is ``m`` (a valid query) or constant (a padding query), and ``M[q, q] = m[q]``
    gives ``m`` back.

    Args:
        attn_mask: ``None`` or the ``attn_mask`` of an SDPA call over ``length`` local queries and keys.
        batch, heads, length: Shape of the call.

    Returns:
        ``m`` as a key padding mask ``[B or 1, H or 1, 1, length]`` (the mask's diagonal, same dtype)
        when ``attn_mask`` is ``[B or 1, H or 1, length, length]`` with ``length > 1`` and equals
        ``m[q] & m[k]`` (boolean) or ``m[q] * m[k]`` with every ``m`` in {0, 1} (float); else ``None``.
    """
    if attn_mask is None or attn_mask.dim() > 4:
        return None
    m = attn_mask
    while m.dim() < 4:
        m = m.unsqueeze(0)
    if (length < 2 or m.shape[-2:] != (length, length) or m.shape[0] not in (1, batch)
            or m.shape[1] not in (1, heads)):
        return None
    pad = m.diagonal(dim1=-2, dim2=-1)  # [B or 1, H or 1, L]: M[q, q] = m[q] and m[q] = m[q]
    if m.dtype == torch.bool:
        outer = pad[..., :, None] & pad[..., None, :]
    elif bool(((pad == 0) | (pad == 1)).all()):
        outer = pad[..., :, None] * pad[..., None, :]
    else:
        return None
    return pad.unsqueeze(-2) if torch.equal(m, outer) else None


def full_sequence_mask(attn_mask: torch.Tensor, batch: int, heads: int, full_length: int,
                       where: str) -> torch.Tensor:
    """Checks a mask over the full joint sequence and returns it as a 4-D tensor.

    Args:
        attn_mask: The ``attn_mask`` of an SDPA call whose last dim is ``full_length = T + S`` (every
            text and image token, in the model's order): a mask the model made before the split
            hooks cut its tokens. Boolean (True = attend) or additive float, broadcastable to
            ``[batch, heads, full_length, full_length]``.
        batch, heads: Shape of the call.
        full_length: ``T + S``.
        where: Processor name for error messages.

    Returns:
        ``[B or 1, H or 1, 1 or full_length, full_length]`` (a view, same dtype).

    Raises:
        SequenceParallelConfigError: a query dimension that is neither 1 nor ``full_length``, or a
            batch or head dimension that does not broadcast to the call's.
    """
    m = attn_mask
    while m.dim() < 4:
        m = m.unsqueeze(0)
    if (m.dim() != 4 or m.shape[-1] != full_length or m.shape[2] not in (1, full_length)
            or m.shape[0] not in (1, batch) or m.shape[1] not in (1, heads)):
        raise SequenceParallelConfigError(
            f"{where}: attention mask of shape {tuple(attn_mask.shape)} covers the {full_length} keys of the full "
            f"sequence but not as [B or 1, H or 1, 1 or {full_length}, {full_length}], so the rows of this rank's "
            f"queries cannot be found in it.")
    return m


def query_rows(mask: torch.Tensor, text_len: int, text_layout: str | None, sizes: list[int], rank: int) -> torch.Tensor:
    """The rows of a full-sequence mask for the queries of one rank's attention call.

    Args:
        mask: ``[B or 1, H or 1, 1 or T + S, T + S]`` (:func:`full_sequence_mask`), rows and columns
            in the model's order (text first for ``"prefix"``, last for ``"suffix"``, then the image
            tokens in rank order).
        text_len, text_layout: The joint layout (T text tokens, replicated on every rank).
        sizes: Image tokens per rank.
        rank: The rank whose queries are wanted.

    Returns:
        ``mask`` itself when it has one row (a key padding mask); else ``[B or 1, H or 1, T + S_r, T + S]``:
        the T text rows and the rows of ``rank``'s image shard, in the order of the call's queries (a
        view without text, one copy with it).
    """
    if mask.shape[2] == 1:
        return mask
    text, image = split_text_image(mask, text_len, text_layout, dim=2)
    mine = image.narrow(2, sum(sizes[:rank]), sizes[rank])
    return join_text_image(text, mine, text_layout, dim=2)


def gather_key_padding_mask(mask: torch.Tensor | None, text_len: int, text_layout: str | None, sizes: list[int],
                            group) -> torch.Tensor | None:
    """Completes a local key padding mask to the full key sequence.

    Args:
        mask: ``None`` or ``[B or 1, H or 1, 1, text_len + sizes[rank]]``: replicated text part and
            this rank's image part, in the family's order (see :func:`split_text_image`). Dim 2 may
            also hold every query row (whole queries over split keys,
            :class:`~diffusers_sp.processors.kv_gather.SplitKVAttnProcessor`): only dim 3 is gathered.
        text_len, text_layout: The joint layout.
        sizes: Image tokens per rank.
        group: The sequence-parallel group.

    Returns:
        ``None`` or ``[B or 1, H or 1, 1, text_len + sum(sizes)]`` (dim 2 as given) with the image
        part of every rank in rank order (one small all-gather; booleans travel as uint8), same dtype
        as ``mask``.
    """
    if mask is None or group.world_size == 1:
        return mask
    text, image = split_text_image(mask, text_len, text_layout, dim=3)
    is_bool = image.dtype == torch.bool
    payload = image.to(torch.uint8) if is_bool else image
    full = all_gather_along(payload.contiguous(), 3, sizes, group)
    if is_bool:
        full = full.bool()
    return join_text_image(text, full, text_layout, dim=3)


def is_image_identity_mask(attn_mask: torch.Tensor, text_len: int, text_layout: str | None) -> bool:
    """Whether ``attn_mask`` is the mask of perturbed-attention guidance (PAG) over a joint sequence.

    Diffusers' ``PAGJointAttnProcessor2_0`` and ``PAGCFGJointAttnProcessor2_0`` (SD3 PAG pipelines) run a
    perturbed pass whose image-image attention is the identity: an additive ``[1, 1, L, L]`` mask, 0 on
    the diagonal of the image block and -inf elsewhere in it, 0 in the image-text and text rows. Built
    by the processor from the sequence it is given, under sequence parallelism it is this rank's part:
    ``L = text_len + S_r``. Its image rows need only keys this rank holds (its own token, the text), and
    its text rows are unmasked; so the pass is exact (:meth:`SequenceParallelAttnProcessor._attend`).

    Args:
        attn_mask: An SDPA ``attn_mask``, ``[L, L]`` or ``[1 or B, 1 or H, L, L]``: boolean (True =
            attend) or additive float.
        text_len, text_layout: The joint layout (see :func:`split_text_image`); ``text_layout`` is where
            the text sits, the image tokens are the rest.

    Returns:
        True when the mask is exactly that pattern (and ``L`` > 1); False otherwise. With one image token
        the pattern cannot be told from an open mask: the caller asks only when every rank has two or more.
    """
    if attn_mask.dim() not in (2, 4) or attn_mask.shape[-1] != attn_mask.shape[-2] or attn_mask.shape[-1] < 2:
        return False
    length = attn_mask.shape[-1]
    if attn_mask.dtype == torch.bool:
        open_, closed = attn_mask, ~attn_mask
    else:
        open_, closed = attn_mask == 0, attn_mask == float("-inf")
    expected = torch.ones(length, length, dtype=torch.bool, device=attn_mask.device)
    _, image_rows = split_text_image(expected, text_len, text_layout, dim=0)
    _, image_block = split_text_image(image_rows, text_len, text_layout, dim=1)
    image_block.copy_(torch.eye(image_block.shape[0], dtype=torch.bool, device=attn_mask.device))
    return bool(torch.equal(open_ | closed, torch.ones_like(open_)) and (open_ == expected).all())


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


class _ParallelCall:
    """What a dispatch-mode processor's model processor gets as ``_parallel_config``: Diffusers'
    processors pass their ``_parallel_config`` to ``dispatch_attention_fn`` for exactly the attention
    calls that context parallelism splits (self-attention over the sequence; ``None`` for
    cross-attention over the text), so the calls that carry this marker are the ones to run in
    parallel. Processors never read the object; only :class:`SequenceParallelAttnProcessor` does."""

    def __repr__(self):
        return "diffusers_sp.PARALLEL_CALL"


#: The marker of :class:`_ParallelCall`.
PARALLEL_CALL = _ParallelCall()


def _with_dispatch(function, dispatch):
    """A copy of ``function`` (a processor's ``__call__``) whose global ``dispatch_attention_fn`` is
    ``dispatch``: the model's own code, unchanged, with its attention dispatcher replaced for this
    wrapper only (the model's module and other instances keep Diffusers' function)."""
    copy = types.FunctionType(function.__code__, {**function.__globals__, "dispatch_attention_fn": dispatch},
                              function.__name__, function.__defaults__, function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    return copy


class _AttentionCallIntercept(TorchFunctionMode):
    """Routes ``F.scaled_dot_product_attention`` calls to ``handler``; every other call passes through."""

    def __init__(self, handler):
        super().__init__()
        self.handler = handler

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            return self.handler(*args, **kwargs)
        if args and isinstance(args[0], torch.Tensor) and getattr(torch.Tensor, func.__name__, None) is func:
            # A Tensor method: call it on the tensor. Calling `func` itself would run Python wrappers
            # such as Tensor.unflatten, whose `super()` call torch.compile cannot trace (a graph break
            # per call). The mode is off inside its own handler, so this does not recurse.
            return getattr(args[0], func.__name__)(*args[1:], **kwargs)
        return func(*args, **kwargs)


def _specialize(cls, inner_cls):
    """A subclass of ``cls`` whose ``__call__`` shows the parameters of ``inner_cls.__call__``.

    Diffusers' attention modules pass a processor only the keyword arguments its ``__call__``
    declares (``Attention.forward`` filters them by ``inspect.signature``), so a wrapper declared as
    ``(attn, *args, **kwargs)`` would silently lose ``image_rotary_emb``, masks and the like.
    """
    cache = cls.__dict__.get("_specialized")
    if cache is None:
        cache = {}
        setattr(cls, "_specialized", cache)
    if inner_cls not in cache:
        def __call__(self, *args, **kwargs):
            return self._run(*args, **kwargs)

        __call__.__signature__ = inspect.signature(inner_cls.__call__)
        cache[inner_cls] = type(cls.__name__, (cls,), {
            "__call__": __call__, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
            "_inner_cls": inner_cls, "__doc__": cls.__doc__,
        })
    return cache[inner_cls]


_NO_BACKWARD = (
    "diffusers-sp's sequence-parallel attention is inference-only: no gradient flows through its "
    "all-to-all / all-gather exchanges. Run the model under torch.no_grad() or torch.inference_mode() "
    "(pipelines do), or call disable() on the handle of enable_sequence_parallel to train.")


class _NoBackward(torch.autograd.Function):
    """Identity on ``outputs`` whose backward raises: marks a processor output computed without
    autograd as depending on ``anchors`` (the inputs and parameters that require grad), so that a
    backward pass through it fails loudly instead of returning wrong gradients."""

    @staticmethod
    def forward(ctx, count, *tensors):
        return tuple(t.clone() for t in tensors[:count])

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(_NO_BACKWARD)


def _without_backward(out, attn, args, kwargs):
    """``out`` (a tensor or a tuple holding tensors) passed through :class:`_NoBackward` when any
    tensor input (also inside tuples and lists, such as RoPE tables) or parameter of ``attn`` requires
    grad; else ``out`` unchanged."""
    anchors = [p for p in attn.parameters() if p.requires_grad]
    for value in list(args) + list(kwargs.values()):
        for t in (value if isinstance(value, (tuple, list)) else (value,)):
            if torch.is_tensor(t) and t.requires_grad:
                anchors.append(t)
    if not anchors:
        return out
    items = [out] if torch.is_tensor(out) else list(out)
    where = [i for i, t in enumerate(items) if torch.is_tensor(t)]
    marked = _NoBackward.apply(len(where), *[items[i] for i in where], *anchors)
    for i, t in zip(where, marked):
        items[i] = t
    return items[0] if torch.is_tensor(out) else type(out)(items)


class SequenceParallelAttnProcessor:
    """Base class: wraps a Diffusers attention processor and takes over its attention call.

    Args:
        inner: The model's own processor for this attention module (e.g. ``WanAttnProcessor``).
        state: The model's :class:`~diffusers_sp.sharding.SequenceState` (group, current image
            sequence length, and ``extra["joint_text"]``: ``None``, ``"prefix"`` or ``"suffix"``),
            shared with the sharding hooks.
        kernel: Local attention kernel, see :func:`diffusers_sp.kernels.sdpa.local_attention`.
        transport: ``"nccl"`` (the group's collectives; also gloo) or ``"copy_engine"``
            (:mod:`diffusers_sp.copy_engine`; resolved by ``enable_sequence_parallel``). Used by the
            dense strategies; see :meth:`use_copy_engine`.
        head_groups: G of the copy-engine pipeline (``"auto"`` or a positive int).
        kv_first: ``None`` or the family's self-attention with K and V made before the queries
            (:attr:`diffusers_sp.pipelines.FamilySpec.self_attention_kv_first`), called as
            ``kv_first(inner, attn, args, kwargs, start_kv, finish_kv)``; it returns
            ``NotImplemented`` for calls it does not cover, which then run the model's processor.
            Used only by strategies with :attr:`supports_kv_first` (the K/V transfer then overlaps
            the query projection).

    Subclasses implement :meth:`parallel_attention`, and may implement :meth:`start_attention` and
    :meth:`finish_attention` (setting :attr:`supports_kv_first`). Tensors seen by it are ``[B, H, T + S_r, D]``
    (Diffusers' SDPA layout): ``T`` replicated text tokens (0 without joint text) and this rank's
    shard of ``S_r`` image tokens, in the family's order.

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
                 head_groups: int | str = "auto", kv_first=None, dispatch: bool = False):
        self.inner = inner
        self.state = state
        self.kernel = kernel
        self.transport = transport
        self.head_groups = head_groups
        self.kv_first = kv_first if self.supports_kv_first else None
        # IP-Adapter processors: only their first attention call per invocation is the self-attention
        # (module docstring); None: every intercepted call is.
        self.parallel_calls = 1 if "IPAdapter" in type(inner).__name__ else None
        self._calls_left = None
        self._seen = 0  # F.scaled_dot_product_attention calls caught in the current call (sdpa mode)
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
        if self.kv_first is not None:
            out = self.kv_first(self.inner, attn, args, kwargs, self._start_kv, self._finish_kv)
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

    def _start_kv(self, key: torch.Tensor, value: torch.Tensor):
        """``start_kv`` of :attr:`kv_first`: checks K and V ``[B, H, T + S_r, D]`` and starts their transfer."""
        name = type(self.inner).__name__
        sizes = self.state.shard_sizes()
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
        grouped-query attention."""
        if is_causal:
            raise SequenceParallelConfigError(
                f"{name}: causal attention depends on the query position and is not supported under "
                f"sequence parallelism ({self.strategy}).")
        if dropout_p:
            raise SequenceParallelConfigError(f"{name}: attention dropout is not supported under sequence parallelism.")
        if enable_gqa or key.shape[1] != query.shape[1]:
            raise SequenceParallelConfigError(
                f"{name}: grouped-query attention (fewer K/V heads than query heads) is not supported.")

    def _attend(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):
        name = type(self.inner).__name__
        self._check_call(name, query, key, dropout_p, is_causal, enable_gqa)
        sizes = self.state.shard_sizes()
        layout = self.state.extra.get("joint_text")
        length = query.shape[2]
        text_len = self._text_len(name, length, key.shape[2], sizes)
        group = self.state.group
        group.check_device(query.device)
        full_length = text_len + sum(sizes)
        if attn_mask is not None and attn_mask.shape[-1] == full_length and len(sizes) > 1:
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
