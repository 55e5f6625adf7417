"""Weight sharding: each rank holds ``1/N`` of the transformers' and text encoders' weights between
forwards, with PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

Sequence parallelism splits the activations; this splits the weights too, so that a model larger
than one GPU runs on several. Each transformer block (every element of the model's block lists) is
one FSDP unit and the rest of the model is the root unit; text encoders likewise (their layer lists,
then the root). Parameters become ``DTensor`` shards (``Shard(0)``) between calls; during a forward
FSDP all-gathers one unit at a time, prefetching the next block's weights while the current block
computes (``set_modules_to_forward_prefetch``), and frees them again after the unit's forward
(``reshard_after_forward=True``). The gathered weights are the same numbers (no cast in the
all-gather), so outputs are exactly those of the replicated model. FSDP2 keeps a root unit gathered
after its forward (it expects a backward); in inference every root is resharded when its forward
ends (a forward hook), or the saving would be lost after the first call.

The sharding group. All ranks of an FSDP group must run the same units in the same order, or one
rank's all-gather pairs with another unit of the same shape and computes a wrong result silently.
The ranks of one sequence-parallel group always do (their caches decide together:
:mod:`diffusers_sp.caches`), and so do both CFG groups of a replica when CFG is folded into the
batch (one call). With CFG as two calls (``"two_call"``), the conditional and the unconditional
pass run on different CFG groups at the same time, and a cache may skip blocks in one of them:
transformers are then sharded over the sequence-parallel group only. Text encoders run the same
calls on every rank of a replica and are sharded over the replica. Replicas hold their own shards.
FSDP's all-gathers run on process groups of their own, apart from the attention's collectives, so
that prefetching and attention traffic do not queue behind each other (with a ``process_group``
passed by the caller, that group is used: a new group would need every rank of the launch).

Parameters whose dtype differs from most of their unit's (Diffusers' ``_keep_in_fp32_modules`` in a
bf16 model: norms, modulation tables) stay whole on every rank (``ignored_params``): FSDP2 all-gathers
one dtype per unit.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .errors import SequenceParallelConfigError
from .groups import SPGroup, register_teardown
from .sharded_load import has_empty_parameters, materialize

#: Diffusers hooks that move or re-cast weights, which FSDP's sharded parameters cannot follow.
_CONFLICTING_HOOKS = {
    "group_offloading": "Diffusers' group offloading moves the same weights between devices",
    "layerwise_casting": "layerwise casting re-casts the weights FSDP all-gathers",
}


@dataclass
class ShardedModule:
    """One module whose weights are sharded.

    Attributes:
        name: Its attribute on the pipeline (``"transformer"``, ``"text_encoder_2"``; ``""`` for a model
            passed alone).
        module: The module (its class is FSDP's subclass of the original while sharded).
        units: Every ``fully_shard``-ed module, the root last.
        group: The :class:`~diffusers_sp.groups.SPGroup` of the FSDP group.
        hook: The handle of the forward hook that reshards the root.
    """

    name: str
    module: torch.nn.Module
    units: list
    group: SPGroup
    hook: object = None


@dataclass
class WeightSharding:
    """What :func:`shard_pipeline` sharded, to report and to undo."""

    modules: list[ShardedModule] = field(default_factory=list)

    def local_bytes(self) -> dict[str, int]:
        """``{attribute: bytes}`` of the parameters this rank holds between forwards (its shards, and
        whole parameters FSDP left alone), per sharded module."""
        return {m.name: parameter_bytes(m.module) for m in self.modules}

    def undo(self) -> None:
        """Gathers every parameter back whole on every rank and removes FSDP from the modules: they are
        ordinary modules of their original classes again. A collective over each FSDP group (every
        rank of the group calls it, as ``disable()`` is)."""
        for sharded in reversed(self.modules):
            if sharded.hook is not None:
                sharded.hook.remove()
            for unit in reversed(sharded.units):
                _unshard_for_good(unit)
        self.modules.clear()


def parameter_bytes(module: torch.nn.Module) -> int:
    """Bytes of ``module``'s parameters held by this rank: the local shard of a sharded (``DTensor``)
    parameter, the whole of any other; each parameter once."""
    total = 0
    for p in module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def check_shard_weights(value, name: str) -> bool:
    """``shard_weights`` checked: ``True`` or ``False``.

    Raises:
        SequenceParallelConfigError: any other value, or ``True`` on a torch without FSDP2
            (``torch.distributed.fsdp.fully_shard``, torch 2.6 and newer).
    """
    if not isinstance(value, bool):
        raise SequenceParallelConfigError(
            f"{name}: shard_weights must be True (shard the transformers' and text encoders' weights over the "
            f"ranks with FSDP2) or False (every rank holds the whole model), got {value!r}.")
    if value and not hasattr(importlib.import_module("torch.distributed.fsdp"), "fully_shard"):
        raise SequenceParallelConfigError(
            f"{name}: shard_weights=True needs FSDP2 (torch.distributed.fsdp.fully_shard), which this torch "
            f"{torch.__version__} lacks; install torch 2.6 or newer.")
    return value


def components_to_shard(target, models: list) -> list[tuple[str, torch.nn.Module]]:
    """``(attribute, module)`` of what ``shard_weights=True`` shards: the transformers ``models`` and,
    for a pipeline, every ``text_encoder*`` component that is a module."""
    found = [(attribute, model) for attribute, model in models]
    seen = {id(m) for _, m in found}
    for attribute in getattr(getattr(target, "config", None) or {}, "keys", lambda: ())():
        module = getattr(target, attribute, None) if attribute.startswith("text_encoder") else None
        if isinstance(module, torch.nn.Module) and id(module) not in seen:
            seen.add(id(module))
            found.append((attribute, module))
    return found


def check_shardable(name: str, components: list) -> None:
    """Refuses, before any collective, what FSDP2's sharded parameters cannot run with.

    Raises:
        SequenceParallelConfigError: Diffusers' group offloading or layerwise casting, Accelerate's CPU
            offload hooks, or quantized weights (tensor subclasses such as torchao's) on a module to
            shard, or a module already sharded by FSDP; the message says what would work.
    """
    for attribute, module in components:
        where = f"{name}.{attribute}" if attribute else name
        for sub in module.modules():
            registry = sub.__dict__.get("_diffusers_hook")
            for hook in (registry.hooks.values() if registry is not None else ()):
                kind = type(hook).__module__.rsplit(".", 1)[-1]
                if kind in _CONFLICTING_HOOKS:
                    raise _refusal(where, _CONFLICTING_HOOKS[kind], "remove it (or use shard_weights=False)")
            if hasattr(sub, "_hf_hook"):
                raise _refusal(where, "Accelerate's CPU offload hooks move the weights between devices",
                               "call pipe.to(device) instead of enable_*_cpu_offload() (or use shard_weights=False)")
            if type(sub).__name__.startswith("FSDP"):
                raise _refusal(where, "the module is sharded by FSDP already", "pass the module unsharded")
        for p in module.parameters():
            if type(p.data) is not torch.Tensor:  # a tensor subclass: torchao's quantized tensors, ...
                raise _refusal(where, f"its weights are {type(p.data).__name__} tensors (quantized)",
                               "use shard_weights=False with quantized weights")


def _refusal(where: str, why: str, instead: str) -> SequenceParallelConfigError:
    return SequenceParallelConfigError(f"{where}: shard_weights=True cannot run: {why}. To run: {instead}.")


def block_lists(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The units of ``module`` below its root, ``(qualified name, module)``: the elements (with
    parameters) of every ``nn.ModuleList`` in it, outermost lists first, none inside another unit."""
    units, taken = [], set()
    for name, sub in module.named_modules():
        if not isinstance(sub, torch.nn.ModuleList) or any(name.startswith(t + ".") for t in taken):
            continue
        elements = [(f"{name}.{i}", m) for i, m in enumerate(sub) if any(True for _ in m.parameters())]
        if elements:
            units.extend(elements)
            taken.add(name)
    return units


def _ignored(unit: torch.nn.Module, managed: set) -> set:
    """Parameters of ``unit`` (not in ``managed``: those of its sub-units) whose dtype is not the one
    most of its parameters have."""
    params = [p for p in unit.parameters() if id(p) not in managed]
    if not params:
        return set()
    counts = Counter()
    for p in params:
        counts[p.dtype] += p.numel()
    common = counts.most_common(1)[0][0]
    return {p for p in params if p.dtype != common}


def shard_module(attribute: str, module: torch.nn.Module, group: SPGroup, pg) -> ShardedModule:
    """``fully_shard`` on every block of ``module`` and on its root, over the process group ``pg``
    (the ranks of ``group``), with forward prefetch of the next block and the root resharded after
    each forward (see the module docstring)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    # FSDP moves each unit to the mesh's device as it shards it: a pipeline loaded on the CPU goes to the
    # GPUs one block at a time, never whole (NCCL groups run on CUDA, gloo on the CPU).
    mesh = DeviceMesh.from_group(pg, "cuda" if "nccl" in (group.backend or "") else "cpu")
    # A module built by load_pipeline_for_sharding has empty (meta) parameters: each unit reads its own
    # from the files just before it is sharded, so no rank holds more than one unit whole.
    empty = has_empty_parameters(module)
    blocks, managed = block_lists(module), set()
    for name, block in blocks:
        if empty:
            materialize(block, module, name)
        fully_shard(block, mesh=mesh, reshard_after_forward=True, ignored_params=_ignored(block, managed))
        managed.update(id(p) for p in block.parameters())
    if empty:
        materialize(module, module, "")
    fully_shard(module, mesh=mesh, reshard_after_forward=True, ignored_params=_ignored(module, managed))
    for (_, current), (_, following) in zip(blocks, blocks[1:]):
        current.set_modules_to_forward_prefetch([following])
    hook = module.register_forward_hook(_reshard_root)
    return ShardedModule(attribute, module, [*(b for _, b in blocks), module], group, hook)


def _reshard_root(module, args, output):
    module.reshard()
    return output


def _unshard_for_good(unit: torch.nn.Module) -> None:
    """Makes a ``fully_shard``-ed module an ordinary one again: every sharded parameter gathered whole
    (a collective over its FSDP group) and set back as a plain ``nn.Parameter`` on every module that
    shares it, FSDP's forward hooks and state removed and the original class restored. Reads FSDP2's
    state (``FSDPState``, ``FSDPParam``), which torch offers no public inverse of ``fully_shard`` for."""
    from torch.distributed.fsdp import FSDPModule

    # FSDP's own all-gather (no DTensor operation: those fill DTensor's caches with the device mesh).
    unit.unshard()
    state = unit._get_fsdp_state()
    param_groups = getattr(state, "_fsdp_param_groups", None)
    if param_groups is None:  # torch releases with one parameter group per state
        param_groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
    for param_group in param_groups:
        for fsdp_param in param_group.fsdp_params:
            whole = torch.nn.Parameter(fsdp_param.unsharded_param.detach().clone(),
                                       requires_grad=fsdp_param.sharded_param.requires_grad)
            info = fsdp_param._module_info
            for owner, name in [(info.module, info.param_name), *zip(info.shared_modules, info.shared_param_names)]:
                owner._parameters[name] = whole
    for handle_name in ("_pre_forward_hook_handle", "_post_forward_hook_handle"):
        handle = getattr(state, handle_name, None)
        if handle is not None:
            handle.remove()
    # fully_shard's state and registry live in the module's __dict__ under keys of torch's composable
    # API (torch.distributed._composable.contract), and the module is a key of its module-to-state map
    # (torch.distributed._composable_state), which refuses a second fully_shard of the same module.
    for key in [k for k in vars(unit) if k.startswith("__composable_api")]:
        del unit.__dict__[key]
    from torch.distributed import _composable_state

    _composable_state._module_state_mapping.pop(unit, None)
    unit.__class__ = next(c for c in type(unit).__mro__[1:] if not issubclass(c, FSDPModule))


#: FSDP's process groups, built once per layout and launch: ``{key: {"replica": ..., "sp": ...}}``.
_GROUPS: dict = {}


@register_teardown
def _forget_groups() -> None:
    """Drops what holds FSDP's process groups, so that they end with the run: our cache of them, and
    DTensor's caches (sharding propagation in Python and C++, redistribution plans), whose keys hold
    the specs, and through them the device meshes, of the sharded parameters' operations."""
    _GROUPS.clear()
    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor import DTensor

    caches = [getattr(DTensor._op_dispatcher.sharding_propagator, name, None)
              for name in ("propagate_op_sharding", "_propagate_tensor_meta_cached")]
    for name, module in list(sys.modules.items()):
        if name.startswith("torch.distributed.tensor") and module is not None:
            caches += [v for v in vars(module).values() if isinstance(v, functools._lru_cache_wrapper)]
    for cache in caches:
        if cache is not None:
            cache.cache_clear()
    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # the C++ dispatch's cache
    if native is not None:
        native()


def fsdp_groups(layout, launch: SPGroup) -> dict:
    """This rank's FSDP groups for the ``replicas x cfg x sp`` ``layout``: ``{"replica": (SPGroup,
    ProcessGroup), "sp": (...)}``, process groups of their own (see the module docstring). A collective
    over the launch the first time for a layout: every rank creates every group, in the same order."""
    key = (layout.num_replicas, layout.cfg_degree, layout.sp_degree, launch.group_name)
    if key not in _GROUPS:
        world, rank = dist.get_world_size(), dist.get_rank()
        per_replica = layout.cfg_degree * layout.sp_degree
        lists = {"replica": [list(range(r, r + per_replica)) for r in range(0, world, per_replica)],
                 "sp": [list(range(s, s + layout.sp_degree)) for s in range(0, world, layout.sp_degree)]}
        made = {}
        for kind, ranks in lists.items():
            pg, _ = dist.new_subgroups_by_enumeration(ranks)
            size = len(ranks[0])
            made[kind] = (SPGroup(pg.group_name, rank % size, size, launch.backend), pg)
        _GROUPS[key] = made
    return _GROUPS[key]


def shard_pipeline(target, models: list, layout, launch: SPGroup, cfg_strategy: str | None,
                   own_group: SPGroup | None = None) -> WeightSharding:
    """Shards the transformers ``models`` and, for a pipeline, its text encoders (see the module
    docstring for the groups). ``own_group`` (the sequence-parallel group of a caller's
    ``process_group``) serves every module when given.

    Returns:
        The :class:`WeightSharding`, for the handle's report and ``disable()``.
    """
    sharding = WeightSharding()
    if own_group is not None or not dist.is_initialized():
        group = own_group or launch
        transformers = encoders = (group, group.group)
    else:
        groups = fsdp_groups(layout, launch)
        encoders = groups["replica"]
        transformers = groups["sp"] if layout.cfg_degree == 2 and cfg_strategy == "two_call" else encoders
    ours = {id(m) for _, m in models}
    try:
        for attribute, module in components_to_shard(target, models):
            group, pg = transformers if id(module) in ours else encoders
            if pg is None:  # one process, no distributed run: nothing to share the weights with
                continue
            sharding.modules.append(shard_module(attribute, module, group, pg))
    except BaseException:
        sharding.undo()
        raise
    return sharding
