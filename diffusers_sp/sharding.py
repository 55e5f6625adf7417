"""Splitting model inputs and gathering outputs along the sequence (uneven, balanced shards).

A sharding plan has the format of a Diffusers model's ``_cp_plan`` (which is what it is built
from where the model ships one): a dict from submodule name (``""`` for the model itself, ``"blocks.0"``,
``"blocks.*"`` for every block) to either

* a dict ``{argument name or output index: ContextParallelInput(split_dim, expected_dims, split_output)}``:
  split those forward arguments (or, with ``split_output=True``, those outputs) along ``split_dim``;
  an argument may instead be gathered back to the full sequence (:class:`GatherInput`), for a
  submodule that needs every token;
* a ``ContextParallelOutput(gather_dim, expected_dims)`` (or a list of them): gather the output.

Besides Diffusers' specs, an entry may be a :class:`SplitEach` (a list, tuple or dict of tensors), a
:class:`SplitByDims` (several accepted layouts), a :class:`SplitUnlessBroadcast` (one entry per token,
or one that broadcasts over them), a :class:`JointSequence` (text joined to the
sequence inside the model's forward: only the sequence part is split or gathered), a
:class:`PrefixCount` / :class:`TailCount` (an int counting leading / last tokens), a
:class:`SequenceLength` (an argument giving the split sequence's length) or a :class:`GridSide` (an
int side of the 2-D token grid). A module's entry may also be a :class:`GridWindow` (a module mixing
neighbouring tokens of that grid).

Unlike Diffusers' own context-parallel hooks, shards here are balanced and may be uneven: with S
tokens and P ranks, rank r gets ``S // P + (r < S % P)`` tokens, in rank order. Tensors whose rank
(number of dims) differs from ``expected_dims`` pass through whole, as in Diffusers.

The hooks have Diffusers' :class:`diffusers.hooks.ModelHook` interface (``pre_forward`` /
``post_forward``) but run as torch module hooks (``register_forward_pre_hook(with_kwargs=True)`` and
``register_forward_hook``; see :func:`attach`), in ``nn.Module.__call__``, outside the module's
``forward``. Everything that wraps ``forward`` instead -- Diffusers' ``HookRegistry`` (caches, group
offloading, layerwise casting) and Accelerate's ``add_hook_to_module`` (``enable_model_cpu_offload``,
``enable_sequential_cpu_offload``) -- therefore runs inside our split and gather, on this rank's shard,
whether it was added before or after enabling; and re-wrapping ``forward`` (Accelerate's model offload
does it after every pipeline call) cannot drop them. Had they been Diffusers hooks, a cache enabled
afterwards would sit outside the split of ``blocks.0`` and see the full sequence going in and a shard
coming out.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from diffusers.hooks import ModelHook
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

from .comm import all_gather_along
from .groups import SPGroup
from .validation import SequenceParallelConfigError

def balanced_sizes(total: int, parts: int) -> list[int]:
    """Sizes of ``parts`` balanced shards of ``total`` items: the first ``total % parts`` get one more.

    The same split as ``torch.tensor_split(x, parts)``; used for tokens and for Ulysses heads.
    """
    base, extra = divmod(int(total), int(parts))
    return [base + (1 if i < extra else 0) for i in range(parts)]


def shard(x: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    """This rank's balanced shard of ``x`` along ``dim`` (a view, no copy)."""
    sizes = balanced_sizes(x.shape[dim], world_size)
    return x.narrow(dim, sum(sizes[:rank]), sizes[rank])


@dataclass(frozen=True)
class TokenOrder:
    """A reordering of the sequence applied before it is sharded, and undone when it is gathered.

    Used by video sparse attention: tokens are put in tile order so that every rank owns whole
    tiles (see :mod:`diffusers_sp.processors.vsa`). Everything a transformer does outside attention
    is per token (norms, MLPs, modulation, RoPE with its tables reordered alike), so running the
    blocks on a reordered sequence is exact.

    Attributes:
        perm: ``LongTensor [S]``: ``perm[i]`` is the original (raster) index of the i-th token in the
            new order.
        inverse: ``LongTensor [S]``: the inverse permutation.
        sizes: Tokens held by each rank, in the new order (``sum(sizes) == S``).
    """

    perm: torch.Tensor
    inverse: torch.Tensor
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class SplitByDims:
    """A plan entry for an argument (or output) a model has in several layouts: ``options`` are
    ``ContextParallelInput`` specs with different ``expected_dims``; the one matching the tensor's
    number of dims splits it (none: it passes whole). E.g. Flux's ``img_ids``, ``[S, 3]`` or the
    deprecated ``[B, S, 3]``; LTX-2's RoPE tables, ``[B, S, D]`` (interleaved) or ``[B, H, S, D / 2]``
    (split)."""

    options: tuple


@dataclass(frozen=True)
class SplitEach:
    """A plan entry for an argument holding a list (or tuple) of tensors, or a dict whose values are
    tensors, each split by ``spec`` (a ``ContextParallelInput``), e.g. ControlNet residuals: one
    ``[B, S, C]`` tensor per block, added to the image tokens (a dict ``{block index: tensor}`` in
    Z-Image's ``controlnet_block_samples``)."""

    spec: object


@dataclass(frozen=True)
class SplitUnlessBroadcast:
    """A plan entry for a tensor that holds one entry per token along ``spec.split_dim`` (split by
    ``spec``, a ``ContextParallelInput``), or a single entry there that broadcasts over every token,
    which passes whole: Sana Video's modulation ``[B, 1, 6C]`` for a timestep per sample, ``[B, S, 6C]``
    for one per token (its image-to-video pipeline), both handed to every block."""

    spec: object


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


@dataclass(frozen=True)
class TailCount:
    """A plan entry for an integer argument that counts the last tokens of the split sequence: each rank
    receives how many of those tokens its own shard holds (:class:`PrefixCount` from the other end).

    E.g. Helios' ``original_context_length``: its blocks see ``[history; chunk]`` and cut the chunk being
    denoised off the history with it (``length - count``; the history skips the cross-attention, and its
    keys may be scaled). Shards are contiguous and in rank order, so each shard is ``[its history tokens;
    its chunk tokens]``, either part possibly empty, and the cut falls where the block makes it. The
    argument must reach the module after the sequence was split in the same forward."""


TEXT_SIDES = ("prefix", "suffix")


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


@dataclass(frozen=True)
class SequenceLength:
    """A plan entry for an argument from which the length ``S`` of the sequence split in the forward is
    read (``length(value) -> int``; ``None`` passes), for a model whose first split tensor also holds
    whole tokens (a :class:`JointSequence`, which needs ``S``), so that no split can tell it: e.g. QwenImage 2.1's
    ``img_shapes``, whose last entry is the target image. The argument passes unchanged."""

    length: Callable


@dataclass(frozen=True)
class GridSide:
    """A plan entry for an int argument that gives the ``"height"`` or ``"width"`` (``side``) of the 2-D
    token grid a module reshapes its tokens into (``tokens.unflatten(1, (height, width))``), as Sana's
    blocks do before their convolutional feed-forward. The full grid is kept for the forward
    (``SequenceState.extra["grid"]``) and the module receives ``height = S_r``, ``width = 1``: its
    shard as one column of tokens, in order, so that the reshape runs on the shard. What it then runs
    over that "image" must be wrapped by a :class:`GridWindow` entry, which hands it the neighbouring
    tokens of the real grid."""

    side: str


@dataclass(frozen=True)
class GridWindow:
    """A plan entry for a module that takes the tokens as an image ``[B, C, height, width]`` (the column
    :class:`GridSide` makes of the shard, ``[B, C, S_r, 1]``) and mixes each token with its neighbours
    up to ``halo`` rows and columns away on the full grid, zero-padded at its border: a (2·halo + 1)²
    convolution between per-token layers, as Sana's ``GLUMBConv`` feed-forward (1 x 1, 3 x 3 depthwise,
    1 x 1 convolutions).

    The module runs on whole rows of the real grid: this rank's rows and ``halo`` rows above and below
    (fewer at the border), the rank's tokens completed with its neighbours' tokens of those rows (one
    all-gather of at most ``(halo + 1) · width`` tokens from each end of each shard), and its output is
    cut back to the rank's tokens. Outputs on the window's first and last rows, where the window's
    zero padding stands in for rows it lacks, belong to other ranks and are dropped; every kept token
    sees exactly its neighbours of one process. Costs over one process's share: those halo rows' work.
    """

    halo: int = 1


@dataclass
class SequenceState:
    """Per-model state shared by the sharding hooks and the attention processors.

    Attributes:
        group: The sequence-parallel group.
        owner: What is parallelized, for messages: the pipeline's class name, or the model's.
        seq_len: Full (unsplit) length S of the sequence split in the current forward, set by the
            split hooks; ``None`` before the forward's first split (reset by
            :class:`SequenceForwardHook` when the model's forward begins).
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
        check: Called when the model's forward begins (:class:`SequenceForwardHook`), before any split
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


def _forward_parameters(module: torch.nn.Module) -> list[str]:
    params = list(inspect.signature(type(module).forward).parameters)
    return params[1:]  # drop self


class SequenceSplitHook(ModelHook):
    """Splits named forward arguments (or outputs, ``split_output=True``) into this rank's shard, or gathers
    arguments (:class:`GatherInput`) back to the full sequence."""

    def __init__(self, entries: dict, state: SequenceState):
        super().__init__()
        self.entries = entries
        self.state = state
        self._params: list[str] | None = None

    def _split(self, x, spec: ContextParallelInput, what: str = "a tensor"):
        if not torch.is_tensor(x) or (spec.expected_dims is not None and x.ndim != spec.expected_dims):
            return x
        group = self.state.group
        length = x.shape[spec.split_dim]
        if length < group.world_size:
            broadcast = (" A dimension of 1 that broadcasts over the tokens, such as a timestep of shape "
                         "[B, 1], cannot be split: pass one value per sample ([B]) or one per token.") if length == 1 else ""
            raise SequenceParallelConfigError(
                f"cannot split a sequence of {length} tokens over {group.world_size} ranks ({what} of shape "
                f"{list(x.shape)}, dim {spec.split_dim}); use fewer ranks or a larger latent (height, width or "
                f"frames).{broadcast}"
            )
        if self.state.seq_len is not None and length != self.state.seq_len:
            source, shape, dim = self.state.seq_source
            # Every rank holds the same full inputs, so every rank raises here alike; splitting anyway
            # would hand ranks shards that disagree (a shape error on some ranks while the others wait
            # in a collective) or, for a length that happens to divide, silently wrong values.
            raise SequenceParallelConfigError(
                f"inputs disagree on the sequence length: {source} of shape {list(shape)} (dim {dim}) has {self.state.seq_len} "
                f"entries, while {what} of shape {list(x.shape)} has {length} along dim {spec.split_dim}. "
                f"Every tensor split along the sequence needs one entry per token.")
        self.state.seq_len = length
        self.state.seq_source = (what, x.shape, spec.split_dim)  # a string only if an error needs it
        order = self.state.order
        if order is None:
            return shard(x, spec.split_dim, group.rank, group.world_size)
        if order.perm.numel() != length:
            raise SequenceParallelConfigError(
                f"a sequence of {length} tokens reached a split planned for {order.perm.numel()} tokens "
                f"(the latent grid read at the model input does not match the token sequence).")
        offset = sum(order.sizes[:group.rank])
        mine = order.perm[offset:offset + order.sizes[group.rank]].to(x.device)
        return x.index_select(spec.split_dim, mine)

    def initialize_hook(self, module):
        # Read the forward's parameter names once, here: inspect.signature inside a forward that
        # torch.compile traces would break the graph.
        self._params = _forward_parameters(module)
        return module

    def pre_forward(self, module, *args, **kwargs):
        args = list(args)
        for name, spec in self.entries.items():
            if not isinstance(name, str) or getattr(spec, "split_output", False):
                continue
            what = f"argument {name!r} of {type(module).__name__}"
            if name in kwargs:
                old = kwargs[name]
                new = kwargs[name] = self._split_value(old, spec, what)
            elif name in self._params and self._params.index(name) < len(args):
                i = self._params.index(name)
                old = args[i]
                new = args[i] = self._split_value(old, spec, what)
            else:
                continue
            if new is not old and not isinstance(spec, (PrefixCount, TailCount, GridSide)):
                self.state.inputs_split = True
        return tuple(args), kwargs

    def _gather(self, x, spec: GatherInput, what: str):
        if not torch.is_tensor(x) or (spec.expected_dims is not None and x.ndim != spec.expected_dims):
            return x
        sizes = self.state.shard_sizes()
        group = self.state.group
        if x.shape[spec.gather_dim] != sizes[group.rank]:
            # The same words on every rank (shard lengths differ between ranks).
            raise SequenceParallelConfigError(
                f"{what} was to be gathered along dim {spec.gather_dim} from this rank's shard of a sequence of "
                f"{sum(sizes)} tokens over {group.world_size} ranks, but its length there is not the shard's: the "
                f"sharding plan does not match the model's forward.")
        full = all_gather_along(x, spec.gather_dim, sizes, group)
        if self.state.order is not None:
            full = full.index_select(spec.gather_dim % full.ndim, self.state.order.inverse.to(full.device))
        return full

    def _split_value(self, value, spec, what: str = "a tensor"):
        if isinstance(spec, PrefixCount):
            return self._prefix_count(value, what)
        if isinstance(spec, TailCount):
            return self._tail_count(value, what)
        if isinstance(spec, JointSequence):
            return self._split_joint(value, spec, what)
        if isinstance(spec, GatherInput):
            return self._gather(value, spec, what)
        if isinstance(spec, SequenceLength):
            return self._declare_length(value, spec.length, what)
        if isinstance(spec, GridSide):
            return self._grid_side(value, spec.side, what)
        if isinstance(spec, SplitEach):
            if isinstance(value, dict):
                return {k: self._split(v, spec.spec, f"{what}[{k!r}]") for k, v in value.items()}
            if not isinstance(value, (list, tuple)):
                return value
            return type(value)(self._split(v, spec.spec, f"{what}[{i}]") for i, v in enumerate(value))
        if isinstance(spec, SplitByDims):
            chosen = next((o for o in spec.options if torch.is_tensor(value) and value.ndim == o.expected_dims), None)
            return value if chosen is None else self._split(value, chosen, what)
        if isinstance(spec, SplitUnlessBroadcast):
            inner = spec.spec
            if (torch.is_tensor(value) and value.ndim == inner.expected_dims and value.shape[inner.split_dim] == 1
                    and (self.state.seq_len is None or self.state.seq_len > 1)):
                return value  # one entry for every token
            return self._split(value, inner, what)
        if isinstance(spec, (list, tuple)):
            if not isinstance(value, (list, tuple)):  # e.g. an optional RoPE tuple passed as None
                return value
            return type(value)(self._split(v, s, what) for v, s in zip(value, spec))
        return self._split(value, spec, what)

    def _declare_length(self, value, length, what: str):
        """Sets the forward's sequence length from ``value`` (see :class:`SequenceLength`); returns ``value``."""
        if value is None:
            return value
        n, state = int(length(value)), self.state
        if n < state.group.world_size:
            raise SequenceParallelConfigError(
                f"cannot split a sequence of {n} tokens over {state.group.world_size} ranks (the length given by "
                f"{what}); use fewer ranks or a larger latent (height or width).")
        if state.seq_len is not None and n != state.seq_len:
            source, shape, dim = state.seq_source
            raise SequenceParallelConfigError(
                f"inputs disagree on the sequence length: {source} of shape {list(shape)} (dim {dim}) has "
                f"{state.seq_len} entries, while {what} gives {n}.")
        state.seq_len, state.seq_source = n, (what, (n,), 0)
        return value

    def _grid_side(self, side_len, side: str, what: str):
        """``S_r`` for the grid's height, 1 for its width (see :class:`GridSide`); the full side is kept."""
        if not isinstance(side_len, int) or isinstance(side_len, bool):
            return side_len
        state = self.state
        if state.seq_len is None:
            raise SequenceParallelConfigError(
                f"{what} is a side of the token grid, but no tensor was split before it in this forward (the "
                f"sharding plan must split the sequence first).")
        state.extra.setdefault("grid", {})[side] = side_len
        return state.shard_sizes()[state.group.rank] if side == "height" else 1

    def _counted_shards(self, what: str, end: str) -> SequenceState:
        """The state, once a count of the ``end`` (``"leading"`` / ``"last"``) tokens can be given per rank;
        before any split there is no shard to count in, and with the tokens reordered (VSA tiles) those
        tokens are no longer an end of each shard: every rank raises alike."""
        state = self.state
        if state.seq_len is None or state.order is not None:
            why = ("before any sequence tensor was split in this forward" if state.seq_len is None
                   else "with the tokens reordered for the mode's tiles, where they are not an end of each shard")
            raise SequenceParallelConfigError(
                f"{what} counts {end} tokens of the sequence, which cannot be split {why}; use a dense mode "
                f"('ulysses' or 'kv_gather') and a sharding plan that splits the tokens before this module.")
        return state

    def _prefix_count(self, count, what: str):
        """This rank's part of ``count`` leading tokens (see :class:`PrefixCount`); non-ints pass as they are."""
        if not isinstance(count, int) or isinstance(count, bool):
            return count
        sizes = self._counted_shards(what, "leading").shard_sizes()
        rank = self.state.group.rank
        return max(0, min(count - sum(sizes[:rank]), sizes[rank]))

    def _tail_count(self, count, what: str):
        """This rank's part of the last ``count`` tokens (see :class:`TailCount`): its shard less its part of
        the tokens before them; non-ints pass as they are."""
        if not isinstance(count, int) or isinstance(count, bool):
            return count
        state = self._counted_shards(what, "the last")
        if not 0 <= count <= state.seq_len:
            source, shape, dim = state.seq_source
            raise SequenceParallelConfigError(
                f"inputs disagree on the sequence length: {what} is {count}, a count of the last tokens of the "
                f"{state.seq_len} of {source} of shape {list(shape)} (dim {dim}).")
        return state.shard_sizes()[state.group.rank] - self._prefix_count(state.seq_len - count, what)

    def _split_joint(self, value, spec: JointSequence, what: str):
        """Splits the sequence part of a :class:`JointSequence` tensor; its text part stays whole."""
        inner = spec.spec
        if not torch.is_tensor(value) or (inner.expected_dims is not None and value.ndim != inner.expected_dims):
            return value
        if self.state.seq_len is None:
            raise SequenceParallelConfigError(
                f"{what} joins text to the sequence, but no split of this forward has set the sequence length "
                f"yet: the sharding plan does not match the model's forward (open an issue with the model class).")
        dim = inner.split_dim % value.ndim
        text, sequence = spec.parts(value, dim, self.state.seq_len, what)
        return spec.join(text, self._split(sequence, inner, what), dim)

    def post_forward(self, module, output):
        out_specs = {k: v for k, v in self.entries.items() if isinstance(k, int)}
        if not out_specs:
            return output
        single = torch.is_tensor(output)
        items = [output] if single else list(output)
        for index, spec in out_specs.items():
            old = items[index]
            items[index] = self._split_value(old, spec, f"output {index} of {type(module).__name__}")
            if items[index] is not old and torch.is_tensor(old) and old.ndim >= 3:
                self.state.inputs_split = True  # token states, not a RoPE table: see SequenceState
        return items[0] if single else type(output)(items)


class SequenceForwardHook(ModelHook):
    """Marks the start of the model's forward: runs ``state.check``, forgets the previous forward's
    sequence length, so that every split of this forward is checked against the first one (see
    :class:`SequenceSplitHook`), keeps the unsplit call in ``state.call`` until the forward returns,
    and refuses the forward arguments in ``refuse`` (``{name: why}``) when they are not ``None``.
    Attached to the model after the plan's hooks, so its pre-forward runs before theirs."""

    def __init__(self, state: SequenceState, refuse: dict | None = None):
        super().__init__()
        self.state = state
        self.refuse = dict(refuse or {})
        self._params: list[str] = []

    def initialize_hook(self, module):
        self._params = _forward_parameters(module)
        return module

    def pre_forward(self, module, *args, **kwargs):
        if self.state.check is not None:
            self.state.check()
        self.state.seq_len, self.state.seq_source, self.state.inputs_split = None, (), False
        # Copies of the containers (the splits after this hook replace entries of ``kwargs``).
        self.state.call = (tuple(args), dict(kwargs))
        for name, why in self.refuse.items():
            i = self._params.index(name) if name in self._params else len(args)
            value = kwargs.get(name, args[i] if i < len(args) else None)
            if value is not None:
                owner = f"{self.state.owner}: " if self.state.owner and self.state.owner != type(module).__name__ else ""
                raise SequenceParallelConfigError(
                    f"{owner}{type(module).__name__} was called with {name!r} ({why}), which its sharding plan does "
                    f"not split, so sequence parallelism cannot run this call exactly; call it without "
                    f"{name!r}, or disable sequence parallelism for it.")
        return args, kwargs

    def post_forward(self, module, output):
        self.state.call = None  # the inputs are not kept alive past the forward
        return output


class SequenceGatherHook(ModelHook):
    """Gathers the module's output(s) along the sequence back to full length on every rank."""

    def __init__(self, specs: list, state: SequenceState):
        super().__init__()
        self.specs = specs
        self.state = state

    def post_forward(self, module, output):
        single = torch.is_tensor(output)
        items = [output] if single else list(output)
        for i, spec in enumerate(self.specs):
            if spec is None or (spec.expected_dims is not None and items[i].ndim != spec.expected_dims):
                continue
            joint, spec = (spec, spec.spec) if isinstance(spec, JointSequence) else (None, spec)
            sizes = self.state.shard_sizes()
            dim = spec.gather_dim % items[i].ndim
            text, local = (None, items[i]) if joint is None else joint.parts(
                items[i], dim, sizes[self.state.group.rank], f"output {i} of {type(module).__name__}")
            full = all_gather_along(local, dim, sizes, self.state.group)
            if self.state.order is not None:
                full = full.index_select(dim, self.state.order.inverse.to(full.device))
            items[i] = full if joint is None else joint.join(text, full, dim)
        return items[0] if single else type(output)(items)


class GridWindowHook(ModelHook):
    """Runs a module on whole rows of the token grid around this rank's tokens (see :class:`GridWindow`)."""

    def __init__(self, entry: GridWindow, state: SequenceState):
        super().__init__()
        self.halo = int(entry.halo)
        self.state = state
        self._cut: tuple[int, int] = (0, 0)
        self._index: dict = {}  # (height, width, sizes, device) -> (lo, hi, before, after, k): one per shape

    def _window_plan(self, height: int, width: int, sizes: tuple, device):
        key = (height, width, sizes, device)
        if key not in self._index:
            rank = self.state.group.rank
            starts = [sum(sizes[:q]) for q in range(len(sizes))]
            start, end = starts[rank], starts[rank] + sizes[rank]
            lo = max(0, start // width - self.halo) * width
            hi = min(height, (end - 1) // width + self.halo + 1) * width
            # Each rank sends its first and its last k tokens (all of them if it has fewer, zero-padded to
            # k): a rank needs fewer than k tokens from either side (< halo rows plus a partial row), and
            # of each rank it draws from, only an end within k of its own tokens.
            k = min((self.halo + 1) * width, max(sizes))
            ends = torch.tensor([s + n for s, n in zip(starts, sizes)])

            def index(positions: torch.Tensor, last: bool) -> torch.Tensor:
                q = torch.searchsorted(ends, positions, right=True)
                i = positions - torch.tensor(starts)[q]
                if last:
                    held = torch.tensor(sizes)[q].clamp(max=k)
                    i = k + i - (torch.tensor(sizes)[q] - held)
                return (q * 2 * k + i).to(device)

            self._index[key] = (lo, hi, index(torch.arange(lo, start), True), index(torch.arange(end, hi), False), k)
        return self._index[key]

    def pre_forward(self, module, x, *args, **kwargs):
        state = self.state
        grid = state.extra.get("grid", {})
        name = type(module).__name__
        height, width = grid.get("height"), grid.get("width")
        sizes = state.shard_sizes()
        rank = state.group.rank
        if (height is None or width is None or height * width != state.seq_len or state.order is not None
                or not torch.is_tensor(x) or x.ndim != 4 or tuple(x.shape[2:]) != (sizes[rank], 1)):
            # The same shapes on every rank, so every rank raises here alike.
            raise SequenceParallelConfigError(
                f"{name} mixes neighbouring tokens of the {height} x {width} token grid, but got "
                f"{list(x.shape) if torch.is_tensor(x) else type(x).__name__} for a sequence of {state.seq_len} tokens "
                f"split {sizes}{' and reordered' if state.order is not None else ''}; its sharding plan does not "
                f"match the model's forward.")
        lo, hi, before, after, k = self._window_plan(height, width, tuple(sizes), x.device)
        tokens = x.flatten(2)  # [B, C, S_r]
        if state.group.world_size > 1:
            held = min(k, sizes[rank])
            pad = tokens.new_zeros(tokens.shape[:2] + (k - held,))
            edges = torch.cat([tokens[..., :held], pad, tokens[..., sizes[rank] - held:], pad], dim=2)
            gathered = all_gather_along(edges, 2, [2 * k] * state.group.world_size, state.group)
            tokens = torch.cat([gathered.index_select(2, before), tokens, gathered.index_select(2, after)], dim=2)
        self._cut = (sum(sizes[:rank]) - lo, sizes[rank])
        return (tokens.unflatten(2, ((hi - lo) // width, width)), *args), kwargs

    def post_forward(self, module, output):
        offset, count = self._cut
        return output.flatten(2).narrow(2, offset, count).unsqueeze(-1)


def _submodules(model: torch.nn.Module, name: str) -> list[tuple[str, torch.nn.Module]]:
    """``(qualified name, module)`` of the submodules a plan entry names (``"blocks.*"``: every child)."""
    if name == "":
        return [("", model)]
    if name.endswith(".*"):
        parent = model.get_submodule(name[:-2])
        return [(f"{name[:-2]}.{child}", module) for child, module in parent.named_children()]
    return [(name, model.get_submodule(name))]


@dataclass
class AttachedHook:
    """One of our hooks on one module (see :func:`attach`).

    Attributes:
        path: The module's qualified name in the model (``""``: the model itself), to find the
            module again after something replaced it (:func:`retarget`).
        module: The module the hook is on.
        hook: The hook (``pre_forward`` / ``post_forward`` as Diffusers' ``ModelHook``).
        handles: torch's ``RemovableHandle`` of each registration.
    """

    path: str
    module: torch.nn.Module
    hook: ModelHook
    handles: list = field(default_factory=list)


def attach(path: str, module: torch.nn.Module, hook: ModelHook) -> AttachedHook:
    """Runs ``hook`` around every call of ``module`` as torch module hooks (see the module docstring).

    ``hook.pre_forward(module, *args, **kwargs) -> (args, kwargs)`` becomes a forward pre-hook with
    kwargs, registered first in line (``prepend=True``): of several hooks attached to one module, the
    last attached runs first, as with Diffusers' ``HookRegistry``. ``hook.post_forward(module, output)``
    becomes a forward hook, appended: the last attached runs last. A method the hook does not
    override is not registered.

    Raises:
        TypeError: ``hook`` overrides ``new_forward`` (which replaces the forward: no torch hook can).
    """
    cls = type(hook)
    if hasattr(cls, "new_forward"):
        # A torch hook runs before and after forward, never instead of it: such a hook would be skipped.
        raise TypeError(f"{cls.__name__} overrides new_forward, which hooks attached as torch module hooks "
                        f"cannot run; use pre_forward / post_forward")
    hook.initialize_hook(module)
    attached = AttachedHook(path, module, hook)
    if cls.pre_forward is not ModelHook.pre_forward:
        def pre(mod, args, kwargs):
            new_args, new_kwargs = hook.pre_forward(mod, *args, **kwargs)
            return tuple(new_args), new_kwargs

        attached.handles.append(module.register_forward_pre_hook(pre, prepend=True, with_kwargs=True))
    if cls.post_forward is not ModelHook.post_forward:
        attached.handles.append(module.register_forward_hook(lambda mod, args, output: hook.post_forward(mod, output)))
    return attached


def detach(attached: AttachedHook) -> None:
    """Removes the torch hooks of :func:`attach` (a no-op the second time)."""
    for handle in attached.handles:
        handle.remove()
    attached.handles.clear()


def retarget(model: torch.nn.Module, installed: list[AttachedHook]) -> bool:
    """Moves each hook whose ``path`` no longer names its module to the module now there.

    PEFT's ``load_lora_weights`` replaces a targeted ``nn.Linear`` (``proj_out`` may be one) by a LoRA
    layer that calls the old module as its ``base_layer`` and adds its own term afterwards; a gather
    left on the old module would gather before the LoRA term is added to this rank's rows, and
    ``unload_lora_weights`` puts the old module back. Returns whether anything moved. The hooks keep
    their order on the module they move to (pre-hooks are re-attached in the order they were first
    attached).
    """
    moved = False
    for i, item in enumerate(installed):
        try:
            now = model.get_submodule(item.path) if item.path else model
        except AttributeError:
            continue  # the module is gone: its hook can no longer run either
        if now is not item.module:
            detach(item)
            installed[i] = attach(item.path, now, item.hook)
            moved = True
    return moved


def apply_plan(model: torch.nn.Module, plan: dict, state: SequenceState,
               refuse: dict | None = None, hooks: dict | None = None) -> list[AttachedHook]:
    """Attaches split/gather hooks for ``plan`` to ``model``'s submodules (see :func:`attach`), then the
    family's own ``hooks``, and a :class:`SequenceForwardHook` to ``model`` (last, so it runs first)
    that refuses the forward arguments named in ``refuse`` (``{name: why}``).

    Args:
        hooks: ``{submodule name (``"layers.*"`` for every child): () -> ModelHook}``: rewrites that a
            plan cannot express (:attr:`diffusers_sp.pipelines.FamilySpec.forward_hooks`). Attached
            after the plan's hooks on the same module, so their ``pre_forward`` runs before the plan's
            splits and their ``post_forward`` after the plan's splits and gathers.

    Returns:
        The :class:`AttachedHook` list, for :func:`remove_hooks`.

    Raises:
        SequenceParallelConfigError: a plan entry or hook names a submodule the model does not have.
    """
    installed = []
    try:
        _register_plan(model, plan, state, installed)
        for name, make in (hooks or {}).items():
            for path, module in _submodules_of(model, name, "a family hook"):
                installed.append(attach(path, module, make()))
        installed.append(attach("", model, SequenceForwardHook(state, refuse)))
    except BaseException:
        remove_hooks(installed)  # none of the plan stays half-registered
        raise
    return installed


def _submodules_of(model, name: str, what: str) -> list[tuple[str, torch.nn.Module]]:
    """:func:`_submodules`, or a SequenceParallelConfigError naming ``what`` names a missing submodule."""
    try:
        return _submodules(model, name)
    except AttributeError as exc:
        raise SequenceParallelConfigError(
            f"{type(model).__name__}: {what} names submodule {name!r}, which the model lacks.") from exc


def _register_plan(model, plan, state, installed: list) -> None:
    for name, entry in plan.items():
        modules = _submodules_of(model, name, "sharding plan")
        if isinstance(entry, dict):
            make = lambda: SequenceSplitHook(entry, state)  # noqa: E731
        elif isinstance(entry, GridWindow):
            make = lambda: GridWindowHook(entry, state)  # noqa: E731
        else:
            specs = [entry] if isinstance(entry, (ContextParallelOutput, JointSequence)) else list(entry)
            make = lambda: SequenceGatherHook(specs, state)  # noqa: E731
        for path, module in modules:
            installed.append(attach(path, module, make()))


def remove_hooks(installed: list[AttachedHook]) -> None:
    """Removes hooks attached by :func:`apply_plan` (or :func:`attach`), last attached first."""
    for attached in reversed(installed):
        detach(attached)
