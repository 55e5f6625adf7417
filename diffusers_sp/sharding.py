"""Splitting model inputs and gathering outputs along the sequence (uneven, balanced shards).

A sharding plan has the format of a Diffusers model's ``_cp_plan`` (which is what it is built
from where the model ships one): a dict from submodule name (``""`` for the model itself, ``"blocks.0"``,
``"blocks.*"`` for every block) to either

* a dict ``{argument name or output index: ContextParallelInput(split_dim, expected_dims, split_output)}``:
  split those forward arguments (or, with ``split_output=True``, those outputs) along ``split_dim``;
* a ``ContextParallelOutput(gather_dim, expected_dims)`` (or a list of them): gather the output.

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
    """A plan entry for an argument a model accepts in several layouts: ``options`` are
    ``ContextParallelInput`` specs with different ``expected_dims``; the one matching the tensor's
    number of dims splits it (none: it passes whole). E.g. Flux's ``img_ids``, ``[S, 3]`` or the
    deprecated ``[B, S, 3]``."""

    options: tuple


@dataclass(frozen=True)
class SplitEach:
    """A plan entry for an argument holding a list (or tuple) of tensors, each split by ``spec``
    (a ``ContextParallelInput``), e.g. ControlNet residuals: one ``[B, S, C]`` tensor per block,
    added to the image tokens."""

    spec: object


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
    """

    group: SPGroup
    owner: str = ""
    seq_len: int | None = None
    seq_source: tuple = ()
    extra: dict[str, Any] = field(default_factory=dict)
    order: TokenOrder | None = None
    check: Callable[[], None] | None = None
    call: tuple | None = None

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
    """Splits named forward arguments (or outputs, ``split_output=True``) into this rank's shard."""

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
                kwargs[name] = self._split_value(kwargs[name], spec, what)
            elif name in self._params and self._params.index(name) < len(args):
                i = self._params.index(name)
                args[i] = self._split_value(args[i], spec, what)
        return tuple(args), kwargs

    def _split_value(self, value, spec, what: str = "a tensor"):
        if isinstance(spec, SplitEach):
            if not isinstance(value, (list, tuple)):
                return value
            return type(value)(self._split(v, spec.spec, f"{what}[{i}]") for i, v in enumerate(value))
        if isinstance(spec, SplitByDims):
            chosen = next((o for o in spec.options if torch.is_tensor(value) and value.ndim == o.expected_dims), None)
            return value if chosen is None else self._split(value, chosen, what)
        if isinstance(spec, (list, tuple)):
            if not isinstance(value, (list, tuple)):  # e.g. an optional RoPE tuple passed as None
                return value
            return type(value)(self._split(v, s, what) for v, s in zip(value, spec))
        return self._split(value, spec, what)

    def post_forward(self, module, output):
        out_specs = {k: v for k, v in self.entries.items() if isinstance(k, int)}
        if not out_specs:
            return output
        single = torch.is_tensor(output)
        items = [output] if single else list(output)
        for index, spec in out_specs.items():
            items[index] = self._split(items[index], spec, f"output {index} of {type(module).__name__}")
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
        self.state.seq_len, self.state.seq_source = None, ()
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
            full = all_gather_along(items[i], spec.gather_dim, self.state.shard_sizes(), self.state.group)
            if self.state.order is not None:
                full = full.index_select(spec.gather_dim % full.ndim, self.state.order.inverse.to(full.device))
            items[i] = full
        return items[0] if single else type(output)(items)


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
    """
    hook.initialize_hook(module)
    attached = AttachedHook(path, module, hook)
    cls = type(hook)
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
               refuse: dict | None = None) -> list[AttachedHook]:
    """Attaches split/gather hooks for ``plan`` to ``model``'s submodules (see :func:`attach`), and a
    :class:`SequenceForwardHook` to ``model`` (last, so it runs first) that refuses the forward
    arguments named in ``refuse`` (``{name: why}``).

    Returns:
        The :class:`AttachedHook` list, for :func:`remove_hooks`.

    Raises:
        SequenceParallelConfigError: a plan entry names a submodule the model does not have.
    """
    installed = []
    try:
        _register_plan(model, plan, state, installed)
        installed.append(attach("", model, SequenceForwardHook(state, refuse)))
    except BaseException:
        remove_hooks(installed)  # none of the plan stays half-registered
        raise
    return installed


def _register_plan(model, plan, state, installed: list) -> None:
    for name, entry in plan.items():
        try:
            modules = _submodules(model, name)
        except AttributeError as exc:
            raise SequenceParallelConfigError(
                f"{type(model).__name__}: sharding plan names submodule {name!r}, which the model lacks."
            ) from exc
        if isinstance(entry, dict):
            make = lambda: SequenceSplitHook(entry, state)  # noqa: E731
        else:
            specs = [entry] if isinstance(entry, ContextParallelOutput) else list(entry)
            make = lambda: SequenceGatherHook(specs, state)  # noqa: E731
        for path, module in modules:
            installed.append(attach(path, module, make()))


def remove_hooks(installed: list[AttachedHook]) -> None:
    """Removes hooks attached by :func:`apply_plan` (or :func:`attach`), last attached first."""
    for attached in reversed(installed):
        detach(attached)
