"""The handle :func:`~diffusers_sp.enable_sequence_parallel` returns: what runs, where this rank sits,
and everything installed, so that :meth:`SequenceParallelHandle.disable` can undo it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .caches import CacheSupport
from .copy_engine import release_workspaces
from .forward_chain import unregister
from .groups import SPGroup
from .plan_entries import SequenceState
from .sharding import remove_hooks
from .traits import PipelineTraits

#: The attribute under which a pipeline or model holds its handle while sequence parallelism is on.
HANDLE_ATTR = "_diffusers_sp_handle"
#: Attributes of the model's processors that enabling changes and disable() restores.
PROCESSOR_ATTRIBUTES = ("_attention_backend", "_parallel_config")


def set_processor(module: torch.nn.Module, processor) -> None:
    """``module.set_processor(processor)``; attention classes without it (``MochiAttention``) get the attribute.

    A processor that is an ``nn.Module`` (IP-Adapter's, which holds the image-prompt projections) stays
    registered as the module's child when our wrapper (not a module) takes its place: the wrapper
    shadows it as the ``processor`` attribute only, so ``.to()``, ``state_dict()``, offloading and
    casting still reach its weights under their own names. Setting a module processor again
    (``disable()``) replaces both.
    """
    child = module.__dict__.get("_modules", {}).get("processor")
    if isinstance(child, torch.nn.Module) and not isinstance(processor, torch.nn.Module):
        object.__setattr__(module, "processor", processor)
        return
    if hasattr(module, "set_processor"):
        module.set_processor(processor)
    else:
        module.processor = processor


@dataclass
class WrappedProcessor:
    """One attention module whose processor was wrapped.

    Attributes:
        name: The module's qualified name in the model.
        module: The attention module.
        original: The model's processor that was there at enable time.
        saved: The attributes of ``original`` that enabling changed (``_attention_backend``,
            ``_parallel_config``), with their values before, for :meth:`SequenceParallelHandle.disable`.
        wrapper: Our processor around ``original``.
    """

    name: str
    module: torch.nn.Module
    original: object
    saved: dict
    wrapper: object


@dataclass
class InstalledModel:
    """What :func:`~diffusers_sp.install.install` put on one transformer, for the handle to undo."""

    model: torch.nn.Module
    state: SequenceState
    hooks: list  # sharding.AttachedHook: split / gather / forward hooks, run by torch in __call__
    processors: list  # WrappedProcessor, one per wrapped attention module
    modules: list = field(default_factory=list)  # model.modules() at enable (and after a retarget): scanned per forward
    chain_hooks: list = field(default_factory=list)  # (module, name, wrapper): Diffusers hooks placed innermost
    caches: CacheSupport | None = None
    # Processors a pipeline swaps in for a call (FamilySpec.swapped_processors): their class names, how to
    # wrap one (inner -> our processor) and the wrappers made, by id of the swapped-in processor.
    swapped: tuple = ()
    wrap: Callable | None = None
    swap_wrappers: dict = field(default_factory=dict)

    def swap_wrapper(self, inner):
        """Our processor around ``inner``, a processor of :attr:`swapped` (made once per ``inner``)."""
        wrapper = self.swap_wrappers.get(id(inner))
        if wrapper is None or wrapper.inner is not inner:
            wrapper = self.swap_wrappers[id(inner)] = self.wrap(inner)
        return wrapper


@dataclass
class SequenceParallelHandle:
    """What :func:`enable_sequence_parallel` installed.

    Attributes:
        mode: The mode that runs (``"ulysses"``, ``"kv_gather"``, ``"hybrid"`` or ``"vsa"``; ``"auto"``
            resolved).
        sp_mode: The communication that runs: ``mode`` itself, or for VSA its resolved
            ``vsa_sp_mode`` (``"ulysses"``, ``"kv_gather"`` or ``"hybrid"``).
        ulysses_degree, kv_gather_degree: The factorisation of the sequence-parallel group,
            ``world_size = kv_gather_degree x ulysses_degree``: ``(P, 1)`` for Ulysses, ``(1, P)`` for
            K/V-gather, ``(U, P / U)`` for hybrid (Ulysses inside groups of ``U`` consecutive ranks,
            K/V-gather across them).
        rank: This process's rank in the sequence-parallel group.
        world_size: Ranks in the group (1: nothing is split).
        traits: The pipeline's traits as read at enable time.
        group: The :class:`~diffusers_sp.groups.SPGroup`.
        transport: How the ranks exchange tensors (``sp_transport`` resolved): ``"copy_engine"``, or
            the backend of the group's collectives, ``"nccl"`` on CUDA or ``"gloo"`` on CPU
            (``"none"`` at world size 1 without a distributed run). VSA, and Ulysses on models with
            joint text, use the collectives. Inside a ``torch.compile``d region the processors take
            the collectives whatever this says (side streams and events do not trace).
        requested_kernel: The ``attention_kernel`` option as given; :attr:`attention_kernel` says what runs.
        vsa_tile: ``mode="vsa"``: the VSA tile ``(tt, th, tw)`` in latent patches; None otherwise.
    """

    mode: str
    rank: int
    world_size: int
    traits: PipelineTraits
    group: SPGroup
    target: object = field(repr=False)
    sp_mode: str = ""
    transport: str = "nccl"
    requested_kernel: str = "auto"
    ulysses_degree: int = 1
    kv_gather_degree: int = 1
    _models: list = field(default_factory=list, repr=False)
    # Where this rank sits in the replicas x cfg x sp layout (diffusers_sp.replicas / cfg_parallel / vae).
    replica_index: int = 0
    num_replicas: int = 1
    cfg_rank: int = 0
    cfg_degree: int = 1
    parallel_vae: bool = False
    groups: object = field(default=None, repr=False)
    _undo: list = field(default_factory=list, repr=False)
    _cfg_hooks: list = field(default_factory=list, repr=False)  # CFGParallelHook per transformer (stats)
    weights: object = field(default=None, repr=False)  # diffusers_sp.weights.WeightSharding, shard_weights=True
    vsa_tile: tuple | None = None

    def local_weight_bytes(self) -> dict[str, int]:
        """``{component: bytes}`` of the parameters this rank holds of each transformer and text encoder
        (``""`` for a model passed alone) between forwards: about ``1/N`` of each with
        ``shard_weights=True`` (FSDP shards), the whole of each without."""
        if self.weights is not None:
            return self.weights.local_bytes()
        from .weights import components_to_shard, parameter_bytes

        models = [(mt.attribute, m.model) for mt, m in zip(self.traits.models, self._models)]
        return {name: parameter_bytes(module) for name, module in components_to_shard(self.target, models)}

    def kernel_choice(self, compiled: bool = False):
        """The local kernel that runs unmasked self-attention of the (first) transformer as it is now.

        Resolves :attr:`requested_kernel` for the model's current device and dtype and its head dim (see
        :func:`diffusers_sp.kernels.sdpa.choose_kernel`). Masked calls may differ: a boolean key padding
        mask keeps FlashAttention-4 (through its varlen entry), other masks run on SDPA.

        Args:
            compiled: Report what runs inside a ``torch.compile``d region (inference): FlashAttention-4
                stays (as the custom operators of :mod:`diffusers_sp.kernels.fa4`), FlashAttention-3/-2
                give way to SDPA.

        Returns:
            A :class:`~diffusers_sp.kernels.sdpa.KernelChoice` (``name`` and the ``reason`` for a fallback).
        """
        from .kernels.sdpa import kernel_on

        device, dtype = self._model_device_dtype()
        return kernel_on(self.requested_kernel, device, dtype, self.traits.models[0].head_dim, compiling=compiled)

    def vsa_backend(self) -> str | None:
        """``mode="vsa"``: the VSA backend that runs video self-attention of the (first) transformer as it is
        now (its device, dtype, head dim and :attr:`vsa_tile`): ``"gluon"``, ``"triton"``, ``"flex"``, ``"fa4"`` or
        ``"reference"``, as :func:`~diffusers_sp.kernels.vsa.backend_on` resolves ``backend="auto"``. None in
        the dense modes."""
        if self.vsa_tile is None:
            return None
        from .kernels.vsa import backend_on

        device, dtype = self._model_device_dtype()
        tile_volume = self.vsa_tile[0] * self.vsa_tile[1] * self.vsa_tile[2]
        return backend_on("auto", device, dtype, self.traits.models[0].head_dim, tile_volume)

    def _model_device_dtype(self) -> tuple[torch.device, torch.dtype]:
        """Device and dtype of the (first) transformer's parameters now (CPU, float32 without any)."""
        model = self._models[0].model if self._models else None
        param = next(model.parameters(), None) if model is not None else None
        if param is None:
            return torch.device("cpu"), torch.float32
        return param.device, param.dtype

    @property
    def attention_kernel(self) -> str:
        """Name of the kernel that runs unmasked self-attention now: ``"flash_attn_4"``, ``"flash_attn_3"``,
        ``"flash_attn_2"`` or ``"sdpa"`` (see :meth:`kernel_choice`)."""
        return self.kernel_choice().name

    def patch_attribute(self, obj, name: str, value) -> None:
        """Sets ``obj.name = value`` as an instance attribute (shadowing a method, e.g. a pipeline's
        ``prepare_latents``) until :meth:`disable`, which puts back the instance attribute the user had
        set there before, or deletes ours so that the class attribute shows again."""
        missing = object()
        before = vars(obj).get(name, missing)
        setattr(obj, name, value)

        def undo():
            if before is missing:
                vars(obj).pop(name, None)
            else:
                setattr(obj, name, before)

        self._undo.append(undo)

    @property
    def is_output_rank(self) -> bool:
        """True on the one rank of each replica that should write its outputs (CFG rank 0, SP rank 0)."""
        return self.cfg_rank == 0 and self.rank == 0

    def disable(self) -> None:
        """Restores the original processors and removes every hook; outputs are then the model's own.
        With ``shard_weights=True`` the weights are gathered whole first (a collective over each FSDP
        group: call it on every rank). Caches, offloading, quantization and LoRA the user added stay as
        they are (with the attributes diffusers-sp set on cache hooks removed: see
        :mod:`diffusers_sp.caches`)."""
        if self.weights is not None:
            weights, self.weights = self.weights, None
            weights.undo()
        for installed in self._models:
            for module, name, wrapped in reversed(installed.chain_hooks):
                unregister(module, name, wrapped)  # wherever Accelerate or a cache put it since
            installed.chain_hooks.clear()
            remove_hooks(installed.hooks)
            if installed.caches is not None:
                installed.caches.undo()
            originals = {id(w.wrapper): w.original for w in installed.processors}
            swapped = {id(w): w.inner for w in installed.swap_wrappers.values()}
            for w in installed.processors:
                # A processor replaced since enabling (fuse_qkv_projections(), set_attn_processor) is
                # the user's change: it stays; one swapped in by the pipeline for a call that did not end
                # (PAG) stays too, unwrapped.
                current = getattr(w.module, "processor", None)
                if current is w.wrapper:
                    set_processor(w.module, w.original)
                elif id(current) in swapped:
                    set_processor(w.module, swapped[id(current)])
                for key, value in w.saved.items():
                    setattr(w.original, key, value)
            # Diffusers' fuse_qkv_projections() saves the processors it replaces (ours) for
            # unfuse_qkv_projections(); put the originals there instead.
            saved = getattr(installed.model, "original_attn_processors", None)
            if isinstance(saved, dict):
                for key, value in saved.items():
                    if id(value) in originals:
                        saved[key] = originals[id(value)]
            if getattr(installed.model, HANDLE_ATTR, None) is self:
                delattr(installed.model, HANDLE_ATTR)
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        if getattr(self.target, HANDLE_ATTR, None) is self:
            delattr(self.target, HANDLE_ATTR)
        self._models.clear()
        if self.transport == "copy_engine":
            release_workspaces(self.group)
