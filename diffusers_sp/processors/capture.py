"""How a wrapper takes over the model processor's attention call without changing the model's code.

Two routes, by the family's ``attention_call``: a :class:`torch.overrides.TorchFunctionMode` that
catches ``F.scaled_dot_product_attention`` while the model's processor runs
(:class:`_AttentionCallIntercept`), or, for processors that call Diffusers' ``dispatch_attention_fn``,
a copy of the processor's ``__call__`` whose global ``dispatch_attention_fn`` is the wrapper's
(:func:`_with_dispatch`), which runs the calls marked :data:`PARALLEL_CALL`. Also here: the
signature a wrapper must show to its attention module (:func:`_specialize`) and the guard that makes
a backward pass through a parallel call fail loudly (:func:`_without_backward`).
"""

from __future__ import annotations

import inspect
import types

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

#: The function the intercept catches (read once: the mode compares by identity).
_SDPA = F.scaled_dot_product_attention


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
