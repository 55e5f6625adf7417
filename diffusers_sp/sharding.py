"""Splitting model inputs and gathering outputs along the sequence (uneven, balanced shards).

A sharding plan has the format of a Diffusers model's ``_cp_plan`` (which is what it is built
from where the model ships one): a dict from submodule name (``""`` for the model itself, ``"blocks.0"``,
``"blocks.*"`` for every block) to either

* a dict ``{argument name or output index: ContextParallelInput(split_dim, expected_dims, split_output)}``:
  split those forward arguments (or, with ``split_output=True``, those outputs) along ``split_dim``;
  an argument may instead be gathered back to the full sequence (:class:`GatherInput`), for a
  submodule that needs every token;
* a ``ContextParallelOutput(gather_dim, expected_dims)`` (or a list of them): gather the output.

Besides Diffusers' specs, an entry may be (each in :mod:`diffusers_sp.plan_entries` or
:mod:`diffusers_sp.grid_window`, where it says how it splits) a :class:`SplitEach` (a list, tuple or dict of tensors), a
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

import torch
from diffusers.hooks import ModelHook
from diffusers.models._modeling_parallel import ContextParallelOutput

from .errors import SequenceParallelConfigError
from .grid_window import GridSide, GridWindow, GridWindowHook
from .plan_entries import (GatherInput, JointSequence, PrefixCount, SequenceLength, SequenceState, SplitByDims,
                           SplitEach, SplitUnlessBroadcast, TailCount, end_whole, gather_tensor, split_value)
from .shards import TokenOrder, balanced_sizes, shard

#: Names re-exported for the family modules and older imports; their homes are the modules above.
__all__ = ["GatherInput", "GridSide", "GridWindow", "GridWindowHook", "JointSequence", "PrefixCount",
           "SequenceLength", "SequenceState", "SplitByDims", "SplitEach", "SplitUnlessBroadcast", "TailCount",
           "TokenOrder", "balanced_sizes", "shard", "SequenceSplitHook", "SequenceForwardHook",
           "SequenceGatherHook", "attach", "detach", "retarget", "apply_plan", "remove_hooks"]


def _forward_parameters(module: torch.nn.Module) -> list[str]:
    params = list(inspect.signature(type(module).forward).parameters)
    return params[1:]  # drop self


class SequenceSplitHook(ModelHook):
    """Splits named forward arguments (or outputs, ``split_output=True``) into this rank's shard, or gathers
    arguments (:class:`~diffusers_sp.plan_entries.GatherInput`) back to the full sequence; each value as
    its plan entry says (:func:`~diffusers_sp.plan_entries.split_value`)."""

    def __init__(self, entries: dict, state: SequenceState):
        super().__init__()
        self.entries = entries
        self.state = state
        self._params: list[str] | None = None

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
                new = kwargs[name] = split_value(self.state, old, spec, what)
            elif name in self._params and self._params.index(name) < len(args):
                i = self._params.index(name)
                old = args[i]
                new = args[i] = split_value(self.state, old, spec, what)
            else:
                continue
            if new is not old and getattr(spec, "splits_tokens", True):
                self.state.inputs_split = True
        return tuple(args), kwargs

    def post_forward(self, module, output):
        out_specs = {k: v for k, v in self.entries.items() if isinstance(k, int)}
        if not out_specs:
            return output
        single = torch.is_tensor(output)
        items = [output] if single else list(output)
        for index, spec in out_specs.items():
            old = items[index]
            items[index] = split_value(self.state, old, spec, f"output {index} of {type(module).__name__}")
            if items[index] is not old and torch.is_tensor(old) and old.ndim >= 3:
                self.state.inputs_split = True  # token states, not a RoPE table: see SequenceState
        return items[0] if single else type(output)(items)


class SequenceForwardHook(ModelHook):
    """Marks the start of the model's forward: runs ``state.check``, forgets the previous forward's
    sequence length, so that every split of this forward is checked against the first one (see
    :class:`SequenceSplitHook`), keeps the unsplit call in ``state.call`` until the forward returns,
    and refuses the forward arguments in ``refuse`` (``{name: why}``) when they are not ``None``. A
    forward that ran whole (:func:`~diffusers_sp.plan_entries.run_whole`) gets its group back when it
    returns (or, had it raised, when the next one begins). Attached to the model after the plan's hooks, so
    its pre-forward runs before theirs."""

    def __init__(self, state: SequenceState, refuse: dict | None = None):
        super().__init__()
        self.state = state
        self.refuse = dict(refuse or {})
        self._params: list[str] = []

    def initialize_hook(self, module):
        self._params = _forward_parameters(module)
        return module

    def pre_forward(self, module, *args, **kwargs):
        end_whole(self.state)  # a forward that raised while running whole
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
        end_whole(self.state)
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
            if hasattr(spec, "gather_value"):  # a JointSequence: its text part stays
                items[i] = spec.gather_value(self.state, items[i], f"output {i} of {type(module).__name__}")
            else:
                items[i] = gather_tensor(self.state, items[i], spec.gather_dim % items[i].ndim)
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
        elif hasattr(entry, "module_hook"):  # an entry that runs the module itself (GridWindow)
            make = lambda: entry.module_hook(state)  # noqa: E731
        else:
            specs = [entry] if isinstance(entry, (ContextParallelOutput, JointSequence)) else list(entry)
            make = lambda: SequenceGatherHook(specs, state)  # noqa: E731
        for path, module in modules:
            installed.append(attach(path, module, make()))


def remove_hooks(installed: list[AttachedHook]) -> None:
    """Removes hooks attached by :func:`apply_plan` (or :func:`attach`), last attached first."""
    for attached in reversed(installed):
        detach(attached)
