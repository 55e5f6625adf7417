"""Shared machinery of the sequence-parallel attention processors.

A processor here wraps the model's own processor: projections, QK-norm, RoPE and any joint
concatenation stay the model's code. Only its attention call is taken over: while the wrapped
processor runs, a :class:`torch.overrides.TorchFunctionMode` catches
``torch.nn.functional.scaled_dot_product_attention`` (which Diffusers' ``dispatch_attention_fn``
ends in with the ``native`` backend, pinned on the inner processor, and which CogVideoX, Mochi and
SD3 processors call directly) and routes it through the strategy of the subclass.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..sharding import SequenceState
from ..validation import SequenceParallelConfigError

_SDPA = F.scaled_dot_product_attention


class _AttentionCallIntercept(TorchFunctionMode):
    """Routes ``F.scaled_dot_product_attention`` calls to ``handler``; every other call passes through."""

    def __init__(self, handler):
        super().__init__()
        self.handler = handler

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is _SDPA:
            return self.handler(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


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


class SequenceParallelAttnProcessor:
    """Base class: wraps a Diffusers attention processor and takes over its attention call.

    Args:
        inner: The model's own processor for this attention module (e.g. ``WanAttnProcessor``).
        state: The model's :class:`~diffusers_sp.sharding.SequenceState` (group and current
            sequence length), shared with the sharding hooks.
        kernel: Local attention kernel, see :func:`diffusers_sp.kernels.sdpa.local_attention`.

    Subclasses implement :meth:`parallel_attention`. Tensors seen by it are ``[B, H, S_local, D]``
    (Diffusers' SDPA layout), where ``S_local`` is this rank's shard of the sequence.
    """

    strategy = "base"
    _inner_cls = None

    def __new__(cls, inner, *args, **kwargs):
        if cls._inner_cls is not type(inner):
            cls = _specialize(cls, type(inner))
        return object.__new__(cls)

    def __init__(self, inner, state: SequenceState, *, kernel: str = "auto"):
        self.inner = inner
        self.state = state
        self.kernel = kernel

    def _run(self, attn, *args, **kwargs):
        with _AttentionCallIntercept(self._attend):
            return self.inner(attn, *args, **kwargs)

    def _attend(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):
        name = type(self.inner).__name__
        if is_causal:
            raise SequenceParallelConfigError(
                f"{name}: causal attention depends on the query position and is not supported under "
                f"sequence parallelism ({self.strategy}).")
        if dropout_p:
            raise SequenceParallelConfigError(f"{name}: attention dropout is not supported under sequence parallelism.")
        if enable_gqa or key.shape[1] != query.shape[1]:
            raise SequenceParallelConfigError(
                f"{name}: grouped-query attention (fewer K/V heads than query heads) is not supported.")
        if attn_mask is not None:
            raise SequenceParallelConfigError(
                f"{name}: an attention mask reached the {self.strategy} processor, but this model's plan "
                f"declares none. Masks are supported for the model families that declare them.")
        sizes = self.state.shard_sizes()
        rank = self.state.group.rank
        if query.shape[2] != sizes[rank] or key.shape[2] != sizes[rank]:
            raise SequenceParallelConfigError(
                f"{name}: expected this rank's shard of {sizes[rank]} tokens (sequence {self.state.seq_len} "
                f"over {len(sizes)} ranks) in self-attention, got queries of {query.shape[2]} and keys of "
                f"{key.shape[2]} tokens. The sharding plan does not match the model's forward.")
        self.state.group.check_device(query.device)
        return self.parallel_attention(query, key, value, sizes, scale=scale)

    def parallel_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           sizes: list[int], *, scale: float | None) -> torch.Tensor:
        """Attention of this rank's queries over the full sequence.

        Args:
            query, key, value: ``[B, H, sizes[rank], D]`` this rank's shard.
            sizes: Tokens held by each rank (balanced shards of the full sequence).
            scale: Softmax scale, ``None`` for ``1/sqrt(D)``.

        Returns:
            ``[B, H, sizes[rank], D]``: the attention output of this rank's queries.
        """
        raise NotImplementedError
