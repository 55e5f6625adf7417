"""The entries of a sharding plan, and the per-model state they read: what to split or gather, and
how each kind of entry does it.

A plan (see :mod:`diffusers_sp.sharding`) maps submodules to entries. Diffusers' own
``ContextParallelInput`` splits a tensor along ``split_dim`` (:func:`split_tensor`); every other entry
here is a small class that knows how it splits (or gathers) its value, ``entry.split_value(state,
value, what)``, so the hooks ask the entry instead of testing its type. :func:`split_value` is the
one place that tells them apart: an entry of this module, a tuple of entries (one per element) or a
Diffusers spec.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .comm import all_gather_along
from .errors import SequenceParallelConfigError
from .groups import SPGroup
from .shards import TokenOrder, balanced_sizes, shard


@dataclass
class SequenceState:
    """Per-model state shared by the sharding hooks and the attention processors.

    Attributes:
        group: The sequence-parallel group.
        owner: What is parallelized, for messages: the pipeline's class name, or the model's.
        seq_len: Full (unsplit) length S of the sequence split in the current forward, set by the
            split hooks; ``None`` before the forward's first split (reset by
            :class:`~diffusers_sp.sharding.SequenceForwardHook` when the model's forward begins).
        seq_source: What set :attr:`seq_len`, ``(description, shape, dim)``; formatted only for an error.
        inputs_split: Whether the tokens flowing through the model were split in the current forward
            (reset with :attr:`seq_len`): a forward argument of a submodule, or an output of at least 3
            dims (``[B, S, C]`` tokens, e.g. HunyuanImage's ``x_embedder``; not a ``[S, D]`` RoPE table).
            Until then the tokens are whole on every rank: a marked attention call of dispatch mode made
            before it (MiniMax-H3's text refiner, before its plan splits the packed sequence at the first
            block) runs as one process runs it (see
            :class:`~diffusers_sp.processors.base.SequenceParallelAttnProcessor`).
        extra: Family-specific per-forward values (for example the text length of joint attention).
        order: ``None`` (shards of the sequence as it is) or a :class:`TokenOrder` for the current
            forward, set by a hook of the mode that needs it (VSA).
        check: Called when the model's forward begins (:class:`~diffusers_sp.sharding.SequenceForwardHook`), before any split
            or collective; raises (identically on every rank) when the model was changed in a way
            sequence parallelism cannot follow (e.g. Diffusers' own context parallelism enabled
            afterwards), and adapts what was added since the last forward (a cache: see
            :mod:`diffusers_sp.caches`).
        call: ``(args, kwargs)`` of the model's current forward as the caller passed them, before any
            split (shallow copies; ``None`` outside a forward): for code that needs the whole input,
            such as SeaCache's indicator (:mod:`diffusers_sp.caches`).
        mesh: ``None``, or in ``mode="hybrid"`` (and VSA over it) the
            :class:`~diffusers_sp.groups.HybridMesh` that factors :attr:`group` into Ulysses and
            K/V-gather groups; the tokens are split over :attr:`group` as in every mode.
        whole: ``None``, or while a forward runs whole (:func:`run_whole`: its sequence is shorter than
            the world size) the ``(group, mesh)`` that :attr:`group` and :attr:`mesh` stand in for;
            :func:`end_whole` puts them back.
    """

    group: SPGroup
    owner: str = ""
    seq_len: int | None = None
    seq_source: tuple = ()
    inputs_split: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    order: TokenOrder | None = None
    check: Callable[[], None] | None = None
    call: tuple | None = None
    mesh: Any = None
    whole: tuple | None = None

    def shard_sizes(self) -> list[int]:
        """Tokens held by each rank for the current forward."""
        if self.order is not None:
            return list(self.order.sizes)
        if self.seq_len is None:
            raise SequenceParallelConfigError(
                "sequence-parallel attention ran before any sequence tensor was split: the model's "
                "sharding plan does not match its forward (open an issue with the model class)."
            )
        return balanced_sizes(self.seq_len, self.group.world_size)


#: The group of a forward that runs whole: one rank, nothing exchanged (see :func:`run_whole`).
_ONE_RANK = SPGroup(None, 0, 1, None)


def run_whole(state: SequenceState) -> None:
    """Runs the current forward whole on every rank: its sequence has fewer tokens than the group has
    ranks, so some ranks would hold none.

    Every rank then computes what one process computes (the same inputs, the same weights), so the
    result is exact, and nothing is exchanged: :attr:`SequenceState.group` becomes a one-rank group for
    the rest of the forward (the splits keep every token, the gathers do nothing) and the attention
    processors call the model's own processor (see
    :class:`~diffusers_sp.processors.base.SequenceParallelAttnProcessor`). A sequence shorter than the
    rank count is far below one shard of any real workload, so running it P times costs nothing that
    matters, while a zero-token shard would reach the model's own code (reshapes with ``-1`` of an
    empty tensor raise there, on that rank alone). Called at the forward's first split, before any
    collective of the forward, by every rank alike (every rank holds the same full inputs).
    """
    if state.whole is None:
        state.whole = (state.group, state.mesh)
        state.group, state.mesh = _ONE_RANK, None


def end_whole(state: SequenceState) -> None:
    """Puts back the group (and mesh) :func:`run_whole` stood in for; nothing when the forward ran split."""
    if state.whole is not None:
        (state.group, state.mesh), state.whole = state.whole, None


def _check_length(state: SequenceState, length: int, source: str) -> None:
    """Refuses an empty sequence; makes a forward whose first split finds fewer tokens than ranks run whole
    (:func:`run_whole`). ``source`` names where the length comes from, for the error."""
    if length < 1:
        raise SequenceParallelConfigError(f"cannot split an empty sequence ({source}).")
    if state.seq_len is None and state.order is None and length < state.group.world_size:
        run_whole(state)


def split_tensor(state: SequenceState, x, spec, what: str = "a tensor"):
    """This rank's shard of ``x`` along ``spec.split_dim`` (a Diffusers ``ContextParallelInput``), in
    the order of ``state.order`` when one is set; ``x`` passes whole when it is not a tensor of
    ``spec.expected_dims`` dims. The first split of a forward sets ``state.seq_len``; every later one
    must agree with it. A first split of fewer tokens than ranks makes the forward run whole
    (:func:`run_whole`).

    Raises:
        SequenceParallelConfigError: an empty sequence, a length that disagrees with the
            forward's earlier splits, or one that disagrees with the token order (the same on every
            rank: every rank holds the same full inputs).
    """
    if not torch.is_tensor(x) or (spec.expected_dims is not None and x.ndim != spec.expected_dims):
        return x
    length = x.shape[spec.split_dim]
    _check_length(state, length, f"{what} of shape {list(x.shape)}, dim {spec.split_dim}")
    group = state.group
    if state.seq_len is not None and length != state.seq_len:
        source, shape, dim = state.seq_source
        # Splitting anyway would hand ranks shards that disagree (a shape error on some ranks while the
        # others wait in a collective) or, for a length that happens to divide, silently wrong values.
        broadcast = (" A dimension of 1 that broadcasts over the tokens, such as a timestep of shape [B, 1], "
                     "cannot be split: pass one value per sample ([B]) or one per token."
                     if 1 in (length, state.seq_len) else "")
        raise SequenceParallelConfigError(
            f"inputs disagree on the sequence length: {source} of shape {list(shape)} (dim {dim}) has {state.seq_len} "
            f"entries, while {what} of shape {list(x.shape)} has {length} along dim {spec.split_dim}. "
            f"Every tensor split along the sequence needs one entry per token.{broadcast}")
    state.seq_len = length
    state.seq_source = (what, x.shape, spec.split_dim)  # a string only if an error needs it
    order = state.order
    if order is None:
        return shard(x, spec.split_dim, group.rank, group.world_size)
    if order.perm.numel() != length:
        raise SequenceParallelConfigError(
            f"a sequence of {length} tokens reached a split planned for {order.perm.numel()} tokens "
            f"(the latent grid read at the model input does not match the token sequence).")
    offset = sum(order.sizes[:group.rank])
    mine = order.perm[offset:offset + order.sizes[group.rank]].to(x.device)
    return x.index_select(spec.split_dim, mine)


def gather_tensor(state: SequenceState, x: torch.Tensor, dim: int) -> torch.Tensor:
    """This rank's shard ``x`` all-gathered along ``dim`` to the full sequence, in the model's token
    order (a :class:`~diffusers_sp.shards.TokenOrder` undone), contiguous as the module's own output was:
    the model may ``view`` it (AnyFlow's unpatchify), and a gather along an inner dim is a strided view."""
    full = all_gather_along(x, dim, state.shard_sizes(), state.group)
    if state.order is not None:
        full = full.index_select(dim % full.ndim, state.order.inverse.to(full.device))
    return full.contiguous()


def split_value(state: SequenceState, value, spec, what: str = "a tensor"):
    """``value`` as this rank receives it under plan entry ``spec``: an entry of this module splits (or
    gathers) it itself, a tuple of entries applies one to each element of a tuple value (an optional
    one passed as ``None`` stays; an element whose entry is ``None`` passes whole; entries nest, for
    tuples of tuples such as Allegro's ``(tables, positions)``), a dict of entries applies one to each
    value of a dict under the same key (AnyFlow's ``{"query": table, "key": table}``; other keys pass), and
    a Diffusers ``ContextParallelInput`` goes to :func:`split_tensor`."""
    if hasattr(spec, "split_value"):
        return spec.split_value(state, value, what)
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            return value
        return {k: v if spec.get(k) is None else split_value(state, v, spec[k], f"{what}[{k!r}]")
                for k, v in value.items()}
    if isinstance(spec, (list, tuple)):
        if not isinstance(value, (list, tuple)):  # e.g. an optional RoPE tuple passed as None
            return value
        return type(value)(v if s is None else split_value(state, v, s, what) for v, s in zip(value, spec))
    return split_tensor(state, value, spec, what)


def _counted_shards(state: SequenceState, what: str, end: str) -> SequenceState:
    """``state``, once a count of the ``end`` (``"leading"`` / ``"last"``) tokens can be given per rank;
    before any split there is no shard to count in, and with the tokens reordered (VSA tiles) those
    tokens are no longer an end of each shard: every rank raises alike."""
    if state.seq_len is None or state.order is not None:
        why = ("before any sequence tensor was split in this forward" if state.seq_len is None
               else "with the tokens reordered for the mode's tiles, where they are not an end of each shard")
        raise SequenceParallelConfigError(
            f"{what} counts {end} tokens of the sequence, which cannot be split {why}; use a dense mode "
            f"('ulysses' or 'kv_gather') and a sharding plan that splits the tokens before this module.")
    return state


@dataclass(frozen=True)
class SplitByDims:
    """A plan entry for an argument (or output) a model has in several layouts: ``options`` are
    ``ContextParallelInput`` specs with different ``expected_dims``; the one matching the tensor's
    number of dims splits it (none: it passes whole). E.g. Flux's ``img_ids``, ``[S, 3]`` or the
    deprecated ``[B, S, 3]``; LTX-2's RoPE tables, ``[B, S, D]`` (interleaved) or ``[B, H, S, D / 2]``
    (split)."""

    options: tuple

    def split_value(self, state: SequenceState, value, what: str):
        chosen = next((o for o in self.options if torch.is_tensor(value) and value.ndim == o.expected_dims), None)
        return value if chosen is None else split_tensor(state, value, chosen, what)


@dataclass(frozen=True)
class SplitEach:
    """A plan entry for an argument holding a list (or tuple) of tensors, or a dict whose values are
    tensors, each split by ``spec`` (a ``ContextParallelInput``), e.g. ControlNet residuals: one
    ``[B, S, C]`` tensor per block, added to the image tokens (a dict ``{block index: tensor}`` in
    Z-Image's ``controlnet_block_samples``)."""

    spec: object

    def split_value(self, state: SequenceState, value, what: str):
        if isinstance(value, dict):
            return {k: split_tensor(state, v, self.spec, f"{what}[{k!r}]") for k, v in value.items()}
        if not isinstance(value, (list, tuple)):
            return value
        return type(value)(split_tensor(state, v, self.spec, f"{what}[{i}]") for i, v in enumerate(value))


@dataclass(frozen=True)
class SplitUnlessBroadcast:
    """A plan entry for a tensor that holds one entry per token along ``spec.split_dim`` (split by
    ``spec``, a ``ContextParallelInput``), or a single entry there that broadcasts over every token,
    which passes whole: Sana Video's modulation ``[B, 1, 6C]`` for a timestep per sample, ``[B, S, 6C]``
    for one per token (its image-to-video pipeline), both handed to every block."""

    spec: object

    def split_value(self, state: SequenceState, value, what: str):
        inner = self.spec
        if (torch.is_tensor(value) and value.ndim == inner.expected_dims and value.shape[inner.split_dim] == 1
                and (state.seq_len is None or state.seq_len > 1)):
            return value  # one entry for every token
        return split_tensor(state, value, inner, what)


@dataclass(frozen=True)
class PrefixCount:
    """A plan entry for an integer argument that counts the first tokens of the split sequence, such as
    the ``num_tokens`` HunyuanVideo's token-replace blocks receive (the first frame's tokens, which they
    modulate apart from the others): each rank receives how many of those tokens its own shard holds.

    Shards are contiguous and in rank order, so the first ``count`` tokens of the sequence are the first
    ``max(0, min(count - start, size))`` tokens of the shard of a rank that holds ``size`` tokens from
    ``start`` on: a prefix of every shard (empty on ranks past them), which is what the block's
    ``[:, :count]`` / ``[:, count:]`` slicing of its local tokens then selects. The argument must reach
    the module after the sequence was split in the same forward (its length is known then)."""

    #: A count, not tokens: passing it does not mark the forward's tokens as split.
    splits_tokens = False

    def split_value(self, state: SequenceState, count, what: str):
        """This rank's part of ``count`` leading tokens; non-ints pass as they are."""
        if not isinstance(count, int) or isinstance(count, bool):
            return count
        sizes = _counted_shards(state, what, "leading").shard_sizes()
        rank = state.group.rank
        return max(0, min(count - sum(sizes[:rank]), sizes[rank]))


@dataclass(frozen=True)
class TailCount:
    """A plan entry for an integer argument that counts the last tokens of the split sequence: each rank
    receives how many of those tokens its own shard holds (:class:`PrefixCount` from the other end).

    E.g. Helios' ``original_context_length``: its blocks see ``[history; chunk]`` and cut the chunk being
    denoised off the history with it (``length - count``; the history skips the cross-attention, and its
    keys may be scaled). Shards are contiguous and in rank order, so each shard is ``[its history tokens;
    its chunk tokens]``, either part possibly empty, and the cut falls where the block makes it. The
    argument must reach the module after the sequence was split in the same forward."""

    #: A count, not tokens: passing it does not mark the forward's tokens as split.
    splits_tokens = False

    def split_value(self, state: SequenceState, count, what: str):
        """This rank's part of the last ``count`` tokens: its shard less its part of the tokens before
        them; non-ints pass as they are."""
        if not isinstance(count, int) or isinstance(count, bool):
            return count
        _counted_shards(state, what, "the last")
        if not 0 <= count <= state.seq_len:
            source, shape, dim = state.seq_source
            raise SequenceParallelConfigError(
                f"inputs disagree on the sequence length: {what} is {count}, a count of the last tokens of the "
                f"{state.seq_len} of {source} of shape {list(shape)} (dim {dim}).")
        return state.shard_sizes()[state.group.rank] - PrefixCount().split_value(state, state.seq_len - count, what)


TEXT_SIDES = ("prefix", "suffix")


class SplitBatchFolded:
    """A plan entry for a tensor whose first dimension folds the batch and the split sequence, ``[B * S,
    ...]`` batch-major (Latte's ``timestep`` for its temporal blocks: one row per sample and spatial token):
    each rank keeps its shard of every sample's rows, ``[B * S_r, ...]``, in the order of its tokens. The
    tensor must reach the module after the sequence was split in the same forward; another first extent
    than a multiple of ``S`` passes whole."""

    def split_value(self, state: SequenceState, x, what: str):
        """This rank's rows of ``x``; non-tensors pass as they are."""
        if not torch.is_tensor(x) or x.ndim < 1:
            return x
        length = _counted_shards(state, what, "the split").seq_len
        if x.shape[0] % length:
            return x
        folded = x.unflatten(0, (x.shape[0] // length, length))
        return split_tensor(state, folded, _SplitDim(1), what).flatten(0, 1)


@dataclass(frozen=True)
class _SplitDim:
    """A split along ``split_dim`` of a tensor of any rank (the fields :func:`split_tensor` reads of a
    Diffusers ``ContextParallelInput``)."""

    split_dim: int
    expected_dims: int | None = None


class WholeLength:
    """A plan entry for an integer argument that is the length of this rank's joined sequence, ``W + S_r``
    (whole tokens and the rank's shard), where the module needs the whole sequence's, ``W + S``: e.g. the
    ``seq_len`` Stable Audio 3's rotary embedding builds its table for, which a
    :class:`JointSequence` output entry then splits like the tokens. The argument must reach the module
    after the sequence was split in the same forward."""

    #: A length, not tokens: passing it does not mark the forward's tokens as split.
    splits_tokens = False

    def split_value(self, state: SequenceState, length, what: str):
        """``length`` less this rank's shard plus the whole sequence; non-ints pass as they are."""
        if not isinstance(length, int) or isinstance(length, bool):
            return length
        sizes = _counted_shards(state, what, "the split").shard_sizes()
        return length - sizes[state.group.rank] + state.seq_len


@dataclass(frozen=True)
class JointSequence:
    """A plan entry for a tensor that joins replicated text entries to the split sequence along one
    dimension, e.g. ``[B, T + S, C]`` hidden states that a model's forward concatenated itself:
    ``spec`` (a ``ContextParallelInput`` to split, or a ``ContextParallelOutput`` to gather) applies to
    the sequence part only; the text part stays whole on every rank, in place.

    The text is the first (``text="prefix"``) or last (``"suffix"``) ``n - S`` entries along the
    dimension, ``n`` being the tensor's extent there and ``S`` the sequence length set by this
    forward's earlier splits (``S_r``, this rank's shard, for a gather). So such an entry must come
    after a plain split in the forward; it raises otherwise. Why not read ``T`` elsewhere: the
    per-forward sequence length is what every split is checked against already, while where the text
    ends is known only inside the model (Lumina 2 passes ``[caption; image]`` to its joint blocks).
    """

    spec: object
    text: str = "prefix"

    def __post_init__(self):
        if self.text not in TEXT_SIDES:
            raise ValueError(f"JointSequence text must be one of {TEXT_SIDES}, got {self.text!r}")

    @property
    def expected_dims(self):
        return self.spec.expected_dims

    def parts(self, x: torch.Tensor, dim: int, seq_len: int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(text, sequence)`` views of ``x`` along ``dim`` (``seq_len`` sequence entries)."""
        n = x.shape[dim]
        if n < seq_len:
            raise SequenceParallelConfigError(
                f"{what} of shape {list(x.shape)} has {n} entries along dim {dim}, fewer than the {seq_len} "
                f"sequence tokens it should hold after its text: the sharding plan does not match the model's "
                f"forward (open an issue with the model class).")
        text_len = n - seq_len
        if self.text == "prefix":
            return x.narrow(dim, 0, text_len), x.narrow(dim, text_len, seq_len)
        return x.narrow(dim, seq_len, text_len), x.narrow(dim, 0, seq_len)

    def join(self, text: torch.Tensor, sequence: torch.Tensor, dim: int) -> torch.Tensor:
        """Inverse of :meth:`parts` (with the sequence part split or gathered in between)."""
        if text.shape[dim] == 0:
            return sequence
        return torch.cat([text, sequence] if self.text == "prefix" else [sequence, text], dim=dim)

    def split_value(self, state: SequenceState, value, what: str):
        """Splits the sequence part; the text part stays whole."""
        inner = self.spec
        if not torch.is_tensor(value) or (inner.expected_dims is not None and value.ndim != inner.expected_dims):
            return value
        if state.seq_len is None:
            raise SequenceParallelConfigError(
                f"{what} joins text to the sequence, but no split of this forward has set the sequence length "
                f"yet: the sharding plan does not match the model's forward (open an issue with the model class).")
        dim = inner.split_dim % value.ndim
        text, sequence = self.parts(value, dim, state.seq_len, what)
        return self.join(text, split_tensor(state, sequence, inner, what), dim)

    def gather_value(self, state: SequenceState, value: torch.Tensor, what: str) -> torch.Tensor:
        """Gathers the sequence part (this rank's shard) back to the full sequence; the text stays."""
        dim = self.spec.gather_dim % value.ndim
        text, local = self.parts(value, dim, state.shard_sizes()[state.group.rank], what)
        return self.join(text, gather_tensor(state, local, dim), dim)


@dataclass(frozen=True)
class GatherInput:
    """A plan entry for an argument, already split along the sequence, that a submodule needs whole:
    this rank's shard is all-gathered to the full sequence (in the model's token order, a
    :class:`TokenOrder` undone) before the submodule runs, on every rank. The submodule's output is
    then split again by an output entry of the same dict (``ContextParallelInput(split_output=True)``).

    For a submodule that mixes tokens in a way the attention processors do not cover, e.g. Wan
    Animate's face adapter, which groups its queries by frame (``[B, S, ...] -> [B * F, S / F, ...]``),
    so that a shard cut inside a frame cannot run it. It costs one all-gather of the argument and the
    submodule's work on every token on every rank.

    Attributes:
        gather_dim: The sequence dimension.
        expected_dims: The argument's number of dims; another passes as it is (as in Diffusers' plans).
    """

    gather_dim: int
    expected_dims: int | None = None

    def split_value(self, state: SequenceState, x, what: str):
        """This rank's shard gathered to the full sequence, in the model's token order."""
        if not torch.is_tensor(x) or (self.expected_dims is not None and x.ndim != self.expected_dims):
            return x
        sizes = state.shard_sizes()
        group = state.group
        if x.shape[self.gather_dim] != sizes[group.rank]:
            # The same words on every rank (shard lengths differ between ranks).
            raise SequenceParallelConfigError(
                f"{what} was to be gathered along dim {self.gather_dim} from this rank's shard of a sequence of "
                f"{sum(sizes)} tokens over {group.world_size} ranks, but its length there is not the shard's: the "
                f"sharding plan does not match the model's forward.")
        return gather_tensor(state, x, self.gather_dim % x.ndim)


@dataclass(frozen=True)
class SequenceLength:
    """A plan entry for an argument from which the length ``S`` of the sequence split in the forward is
    read (``length(value) -> int``; ``None`` passes), for a model whose first split tensor also holds
    whole tokens (a :class:`JointSequence`, which needs ``S``), so that no split can tell it: e.g. QwenImage 2.1's
    ``img_shapes``, whose last entry is the target image. The argument passes unchanged."""

    length: Callable

    def split_value(self, state: SequenceState, value, what: str):
        """Sets the forward's sequence length from ``value``; returns ``value``."""
        if value is None:
            return value
        n = int(self.length(value))
        _check_length(state, n, f"the length given by {what}")
        if state.seq_len is not None and n != state.seq_len:
            source, shape, dim = state.seq_source
            raise SequenceParallelConfigError(
                f"inputs disagree on the sequence length: {source} of shape {list(shape)} (dim {dim}) has "
                f"{state.seq_len} entries, while {what} gives {n}.")
        state.seq_len, state.seq_source = n, (what, (n,), 0)
        return value
