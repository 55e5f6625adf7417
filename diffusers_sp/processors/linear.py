"""Sequence parallelism for linear attention: the sums over the keys all-reduced, queries local.

Linear attention (Sana's ``SanaLinearAttnProcessor2_0``: "SANA: Efficient High-Resolution Image
Synthesis with Linear Diffusion Transformers", arXiv 2410.10629) replaces the softmax by a kernel
``phi`` (ReLU in Sana):

    out_i = phi(q_i) · (Σ_j phi(k_j)ᵀ v_j) / (phi(q_i) · Σ_j phi(k_j))

Both sums run over the key tokens and do not depend on the query, so with the tokens split over the
ranks each rank sums its own keys and one all-reduce completes both: ``[B, H, D + 1, D]`` per layer
(Diffusers appends a row of ones to V, so the normaliser is the last row of the same product),
whatever the sequence length. The queries, the division and everything after stay on their rank.
Exact up to the order of the float additions (partial sums per rank, then their sum). Nothing else
moves: no K/V all-gather, no head all-to-all; the modes "ulysses" and "kv_gather" both run this.

The model's processor runs as it is; its product over the tokens is found the way the softmax call is
found for the other strategies, through a :class:`torch.overrides.TorchFunctionMode`: the first matrix
product of the call whose contraction runs over this rank's tokens (``[..., X, S_r] @ [..., S_r, Y]``,
Diffusers' ``torch.matmul(value, key)``) has its result all-reduced; later products pass as they are
(the one with the queries contracts over D, which may equal S_r). A processor making no such product,
or a softmax attention call, raises SequenceParallelConfigError rather than running an unknown
computation split. Sana's PAG processors make the same product over the unperturbed samples and an
identity "attention" (per token) for the perturbed ones: they run here too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..comm import all_reduce_sum
from ..errors import SequenceParallelConfigError
from .base import SequenceParallelAttnProcessor

_SDPA = F.scaled_dot_product_attention
_MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)


class _TokenSumIntercept(TorchFunctionMode):
    """All-reduces the first matrix product contracting over ``tokens``; counts every such product."""

    def __init__(self, tokens: int, group, where: str):
        super().__init__()
        self.tokens, self.group, self.where = tokens, group, where
        self.products = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MATMULS and len(args) == 2 and all(torch.is_tensor(a) and a.ndim >= 2 for a in args) \
                and args[0].shape[-1] == self.tokens and args[1].shape[-2] == self.tokens:
            self.products += 1
            out = func(*args, **kwargs)
            # Only the first: with as many tokens as channels (S_r = D), the product of the summed
            # state with the queries contracts over as many entries, after it.
            return all_reduce_sum(out, self.group) if self.products == 1 else out
        if func is _SDPA:
            raise SequenceParallelConfigError(
                f"{self.where} makes a softmax attention call; the linear-attention strategy (sums over the "
                f"keys all-reduced) does not apply to it.")
        if args and isinstance(args[0], torch.Tensor) and getattr(torch.Tensor, func.__name__, None) is func:
            # As in processors/base.py: Tensor methods called on the tensor (torch.compile traces them).
            return getattr(args[0], func.__name__)(*args[1:], **kwargs)
        return func(*args, **kwargs)


class LinearAttnProcessor(SequenceParallelAttnProcessor):
    """Runs the model's linear-attention processor with its sums over the keys all-reduced (module
    docstring). Self-attention only: the processor's input ``hidden_states`` ``[B, S_r, C]`` is this
    rank's shard of the split sequence (no joint text). See
    :class:`~diffusers_sp.processors.base.SequenceParallelAttnProcessor` for the arguments; the
    kernel, transport and K/V-first options do not apply."""

    strategy = "linear_sum"

    def _run_parallel(self, attn, *args, **kwargs):
        name = type(self.inner).__name__
        sizes = self.state.shard_sizes()
        tokens = sizes[self.state.group.rank]
        if kwargs.get("encoder_hidden_states") is not None:
            raise SequenceParallelConfigError(
                f"{name}: called with encoder_hidden_states; the linear-attention strategy splits self-attention only.")
        self.state.group.check_device(next(attn.parameters()).device)
        intercept = _TokenSumIntercept(tokens, self.state.group, name)
        with intercept:
            out = self.inner(attn, *args, **kwargs)
        if intercept.products == 0:
            raise SequenceParallelConfigError(
                f"{name}: no matrix product over this rank's {tokens} tokens was found, so the sums over the keys "
                f"cannot be all-reduced; this processor is not the linear attention the strategy knows.")
        return out
