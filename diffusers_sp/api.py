"""enable_sequence_parallel / disable_sequence_parallel: traits -> validate -> group -> install."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from . import caches
from .comm import broadcast_tensor
from .copy_engine import TRANSPORTS, copy_engine_unavailable_reason, head_group_sizes, release_workspaces
from .groups import SPGroup, resolve_group, world_size_for
from .kernels.sdpa import KERNELS
from .pipelines import resolve_target, transformers_of
from .processors import PROCESSORS, SplitKVAttnProcessor
from .processors.base import PARALLEL_CALL
from .processors.vsa import VSA_DEFAULTS, TileOrderHook, VideoSparseAttnProcessor, load_gate_weights
from .forward_chain import unregister
from .sharding import SequenceState, apply_plan, attach, remove_hooks, retarget
from .traits import PipelineTraits
from .validation import SequenceParallelConfigError, resolve_mode, validate_vsa

logger = logging.getLogger("diffusers_sp")

_HANDLE_ATTR = "_diffusers_sp_handle"
#: Attributes of the model's processors that enabling changes and disable() restores.
_PROCESSOR_ATTRIBUTES = ("_attention_backend", "_parallel_config")


def _set_processor(module: torch.nn.Module, processor) -> None:
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
class _InstalledModel:
    model: torch.nn.Module
    state: SequenceState
    hooks: list  # sharding.AttachedHook: split / gather / forward hooks, run by torch in __call__
    processors: list  # (name, attention module, original processor, its saved attributes, our processor)
    modules: list = field(default_factory=list)  # model.modules() at enable (and after a retarget): scanned per forward
    chain_hooks: list = field(default_factory=list)  # (module, name, wrapper): Diffusers hooks placed innermost
    caches: caches.CacheSupport | None = None
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

    def kernel_choice(self):
        """The local kernel that runs unmasked self-attention of the (first) transformer as it is now.

        Resolves :attr:`requested_kernel` for the model's current device and dtype and its head dim (see
        :func:`diffusers_sp.kernels.sdpa.choose_kernel`). Masked calls may differ: a boolean key padding
        mask keeps FlashAttention-4 (through its varlen entry), other masks run on SDPA.

        Returns:
            A :class:`~diffusers_sp.kernels.sdpa.KernelChoice` (``name`` and the ``reason`` for a fallback).
        """
        from .kernels.sdpa import kernel_on

        model = self._models[0].model if self._models else None
        param = next(model.parameters(), None) if model is not None else None
        device = param.device if param is not None else torch.device("cpu")
        dtype = param.dtype if param is not None else torch.float32
        return kernel_on(self.requested_kernel, device, dtype, self.traits.models[0].head_dim)

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
        Caches, offloading, quantization and LoRA the user added stay as they are (with the attributes
        diffusers-sp set on cache hooks removed: see :mod:`diffusers_sp.caches`)."""
        for installed in self._models:
            for module, name, wrapped in reversed(installed.chain_hooks):
                unregister(module, name, wrapped)  # wherever Accelerate or a cache put it since
            installed.chain_hooks.clear()
            remove_hooks(installed.hooks)
            if installed.caches is not None:
                installed.caches.undo()
            originals = {id(wrapper): original for _, _, original, _, wrapper in installed.processors}
            swapped = {id(w): w.inner for w in installed.swap_wrappers.values()}
            for _, module, original, saved, wrapper in installed.processors:
                # A processor replaced since enabling (fuse_qkv_projections(), set_attn_processor) is
                # the user's change: it stays; one swapped in by the pipeline for a call that did not end
                # (PAG) stays too, unwrapped.
                current = getattr(module, "processor", None)
                if current is wrapper:
                    _set_processor(module, original)
                elif id(current) in swapped:
                    _set_processor(module, swapped[id(current)])
                for key, value in saved.items():
                    setattr(original, key, value)
            # Diffusers' fuse_qkv_projections() saves the processors it replaces (ours) for
            # unfuse_qkv_projections(); put the originals there instead.
            saved = getattr(installed.model, "original_attn_processors", None)
            if isinstance(saved, dict):
                for key, value in saved.items():
                    if id(value) in originals:
                        saved[key] = originals[id(value)]
            if getattr(installed.model, _HANDLE_ATTR, None) is self:
                delattr(installed.model, _HANDLE_ATTR)
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        if getattr(self.target, _HANDLE_ATTR, None) is self:
            delattr(self.target, _HANDLE_ATTR)
        self._models.clear()
        if self.transport == "copy_engine":
            release_workspaces(self.group)


def read_traits(target) -> PipelineTraits:
    """Reads the traits of a pipeline or transformer (see :mod:`diffusers_sp.traits`): every
    transformer a pipeline holds (:func:`diffusers_sp.pipelines.resolve_target`).

    Raises:
        SequenceParallelConfigError: the pipeline or model holds no transformer that diffusers-sp runs.
    """
    family, models = resolve_target(target)
    return PipelineTraits(name=type(target).__name__, family=family.name, is_video=family.is_video,
                          models=tuple(family.model_traits(m, a) for a, m in models))


def _check_same_on_all_ranks(group: SPGroup, fingerprint: dict) -> None:
    """Raises on every rank alike unless all ranks pass the same ``{what: value}`` (one all-gather).

    A rank whose own checks refused its settings passes ``{"refused": message}``; then every rank raises
    that message (naming the ranks that refused, when not all did)."""
    if group.world_size == 1:
        return
    gathered = [None] * group.world_size
    dist.all_gather_object(gathered, fingerprint, group=group.group)
    refusals = [(i, g["refused"]) for i, g in enumerate(gathered) if g.get("refused")]
    if refusals:  # a rank that refused its settings sends only its refusal
        texts = {text for _, text in refusals}
        if len(refusals) == len(gathered) and len(texts) == 1:
            raise SequenceParallelConfigError(texts.pop())
        raise SequenceParallelConfigError(
            "refused on some ranks: " + "; ".join(f"rank {i}: {text}" for i, text in refusals)
            + (" (the other ranks' settings were valid: every rank must pass the same options)"
               if len(refusals) < len(gathered) else ""))
    keys = list(dict.fromkeys(k for g in gathered for k in g))
    differ = [k for k in keys if any(g.get(k) != gathered[0].get(k) for g in gathered)]
    if differ:
        detail = "; ".join(f"{k}: " + ", ".join(f"rank {i} {g.get(k)!r}" for i, g in enumerate(gathered))
                           for k in differ)
        raise SequenceParallelConfigError(
            "ranks disagree on the pipeline or mode to parallelize (every rank must load the same model "
            f"and pass the same mode and options): {detail}")


def _sync_rng_states(group: SPGroup) -> None:
    """Makes every rank's global torch RNG (CPU and, if present, current CUDA device) equal to rank 0's."""
    if group.world_size == 1:
        return
    states = [torch.get_rng_state(), torch.cuda.get_rng_state() if torch.cuda.is_available() else None]
    dist.broadcast_object_list(states, src=dist.get_global_rank(group.group, 0), group=group.group)
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1])


def _broadcast_tree(value, group: SPGroup):
    if torch.is_tensor(value):
        return broadcast_tensor(value, group)
    if isinstance(value, (list, tuple)):
        return type(value)(_broadcast_tree(v, group) for v in value)
    return value


def _patch_prepare_latents(pipe, group: SPGroup, handle: SequenceParallelHandle) -> None:
    """Makes ``pipe.prepare_latents`` return rank 0's latents on every rank (one broadcast per call),
    and first copies rank 0's global RNG states to every rank: pipelines call ``prepare_latents`` once,
    before the denoising loop, so noise the scheduler draws from the global RNG in its steps (e.g.
    ``CogVideoXDPMScheduler`` without a generator) is the same on every rank even if the ranks' RNGs
    drifted apart between calls."""
    original = getattr(pipe, "prepare_latents", None)
    if original is None or group.world_size == 1:
        return

    @functools.wraps(original)
    def prepare_latents(*args, **kwargs):
        _sync_rng_states(group)
        return _broadcast_tree(original(*args, **kwargs), group)

    handle.patch_attribute(pipe, "prepare_latents", prepare_latents)


def _latent_preparers(pipe, models) -> list:
    """``pipe`` and the pipelines it holds as attributes that run one of its transformers ``models``
    (``(attribute, model)`` pairs): VisualClozePipeline calls its ``generation_pipe`` and
    ``upsampling_pipe``, whose own ``prepare_latents`` make the latents, not ``pipe``'s."""
    from diffusers import DiffusionPipeline

    ours = {id(model) for _, model in models}
    inner = [value for value in vars(pipe).values() if isinstance(value, DiffusionPipeline) and value is not pipe
             and any(id(model) in ours for _, model in transformers_of(value))]
    return [pipe, *inner]


def _check_model(installed: _InstalledModel) -> None:
    """Run when the model's forward begins (``SequenceState.check``), before any split or collective;
    every rank makes the same calls, so every rank raises alike.

    Follows what was changed since the last forward: hooks of ours moved to modules that replaced
    theirs (PEFT's LoRA layers; :func:`diffusers_sp.sharding.retarget`), caches added since adapted
    (:meth:`diffusers_sp.caches.CacheSupport.scan`), and a processor of a class the family lists in
    ``swapped_processors`` (PAG pipelines put theirs on for each call and put the previous ones back
    after it) wrapped like the model's own.

    Raises:
        SequenceParallelConfigError: Diffusers' own parallelism enabled, a cache or hook that cannot
            run under sequence parallelism (see :mod:`diffusers_sp.caches`), or an attention
            processor replaced since enabling by one of another class.
    """
    model = installed.model
    if retarget(model, installed.hooks):
        installed.modules = list(model.modules())
    caches.check_no_diffusers_parallelism(model, modules=())  # its hooks: scan() below
    installed.caches.scan(installed.modules)
    for name, module, _, _, processor in installed.processors:
        current = getattr(module, "processor", None)
        if current is processor or any(current is w for w in installed.swap_wrappers.values()):
            continue
        if installed.wrap is not None and type(current).__name__ in installed.swapped:
            _set_processor(module, installed.swap_wrapper(current))
            continue
        raise SequenceParallelConfigError(
            f"{type(model).__name__}: the attention processor of {name} was replaced after "
            f"enable_sequence_parallel (by {type(current).__name__}; "
            "fuse_qkv_projections(), set_attn_processor(), load_ip_adapter() and unload_ip_adapter() do this), "
            "so that attention would see only this rank's tokens. Call disable_sequence_parallel(), which keeps "
            "the new processors, then enable sequence parallelism again to wrap them.")


def _perturbed_guidance(target) -> str:
    """Why CFG parallelism cannot split ``target``'s batch (``""`` when it can): a Diffusers pipeline with
    perturbed-attention guidance (``PAGMixin``) runs its passes as one transformer batch,
    ``[uncond, cond, perturbed]`` or ``[cond, perturbed]``, which its PAG attention processors cut into
    those passes again; a half of it on each CFG group would be cut wrongly."""
    try:
        from diffusers.pipelines.pag.pag_utils import PAGMixin
    except ImportError:  # a Diffusers without PAG
        return ""
    if not isinstance(target, PAGMixin):
        return ""
    return ("perturbed-attention guidance (PAG) runs [uncond, cond, perturbed] (or [cond, perturbed]) as one "
            "transformer batch that its attention processors cut into those passes")


@contextlib.contextmanager
def _model_processors(handle: "SequenceParallelHandle"):
    """Puts the model's own processors back in place of ours for the duration, and ours back after
    it where a module still holds its own (a processor replaced meanwhile stays, and the next forward
    refuses it: :func:`_check_model`)."""
    swapped = []
    for installed in handle._models:
        for _, module, original, _, wrapper in installed.processors:
            if getattr(module, "processor", None) is wrapper:
                _set_processor(module, original)
                swapped.append((module, original, wrapper))
    try:
        yield
    finally:
        for module, original, wrapper in swapped:
            if getattr(module, "processor", None) is original:
                _set_processor(module, wrapper)


#: Pipeline methods that read the transformer's processors by class (``set_ip_adapter_scale`` selects
#: IP-Adapter processors; ``load_ip_adapter`` and ``unload_ip_adapter`` build new processors of the
#: classes they find): run with the model's own processors in place.
_PROCESSOR_METHODS = ("set_ip_adapter_scale", "load_ip_adapter", "unload_ip_adapter")


def _patch_processor_methods(pipe, handle: "SequenceParallelHandle") -> None:
    """Makes :data:`_PROCESSOR_METHODS` of ``pipe`` see the model's own processors
    (:func:`_model_processors`): SD3's ``set_ip_adapter_scale`` would otherwise skip our wrappers (it
    selects processors by class), and ``load_ip_adapter`` / ``unload_ip_adapter`` would try to
    construct one with no arguments. The processors they install replace ours, which the next forward
    refuses (:func:`_check_model`) until sequence parallelism is enabled again."""
    for method in _PROCESSOR_METHODS:
        original = getattr(pipe, method, None)
        if original is None:
            continue

        def call(*args, _original=original, **kwargs):
            with _model_processors(handle):
                return _original(*args, **kwargs)

        handle.patch_attribute(pipe, method, functools.wraps(original)(call))


def _gate_paths(spec, traits: PipelineTraits) -> list:
    """``vsa_gate_weights`` as one path (or None) per transformer of ``traits``.

    A single path serves a pipeline with one transformer; with several (Wan 2.2), pass a dict
    ``{"transformer": path, "transformer_2": path}`` (missing entries: zero gate).
    """
    def path(value, where=""):
        if value is None or isinstance(value, (str, os.PathLike)):
            return value
        raise SequenceParallelConfigError(
            f"{traits.name}: vsa_gate_weights{where} must be a path to a safetensors file (str or "
            f"os.PathLike) or None, got {type(value).__name__}.")

    if spec is None:
        return [None] * len(traits.models)
    if isinstance(spec, dict):
        unknown = sorted(set(spec) - {m.attribute for m in traits.models})
        if unknown:
            raise SequenceParallelConfigError(
                f"{traits.name}: vsa_gate_weights names {unknown}, which are not transformers of this pipeline "
                f"({[m.attribute for m in traits.models]}).")
        return [path(spec.get(m.attribute), f"[{m.attribute!r}]") for m in traits.models]
    if len(traits.models) > 1:
        raise SequenceParallelConfigError(
            f"{traits.name} has {len(traits.models)} transformers; pass vsa_gate_weights as a dict "
            f"{{attribute: path}} for {[m.attribute for m in traits.models]}.")
    return [path(spec)]


def _hybrid_copy_engine_refusal(traits: PipelineTraits) -> SequenceParallelConfigError:
    return SequenceParallelConfigError(
        f"{traits.name}: sp_transport='copy_engine' does not apply to mode='hybrid', whose two levels of groups "
        "use the collectives (NCCL). Use sp_transport='auto' or 'nccl', or mode='ulysses' / 'kv_gather' on one "
        "host with sp_transport='copy_engine'.")


def _resolve_transport(requested: str, mode: str, group: SPGroup, traits: PipelineTraits, *,
                       kv_first: bool = False) -> str:
    """``sp_transport`` resolved for ``mode``: ``"nccl"`` or ``"copy_engine"``.

    ``"auto"`` picks the copy engines for both dense modes when the whole launch is one group of 2
    ranks and they can run there (the same bits; on 2 H200s per step, Wan 1.3B shape: Ulysses 8-13 ms
    and K/V-gather 1-8 ms faster than NCCL; 14B: both 2-5 ms faster; benchmarks/RESULTS.md), and
    NCCL otherwise: larger groups, and 2-rank groups inside a larger launch (CFG parallelism,
    replicas), have not run on GPUs (CPU CI cannot run them). One exception: K/V-gather on a family
    whose K/V-first path is on (``kv_first``: Wan with ``overlap_query_projection=True``) takes NCCL,
    whose all-gather then runs under the query projection as well: in ten same-run pairs on 2 H200s
    (benchmarks/RESULTS.md) NCCL was faster in seven, by 1.3 ms per step on average (from 2.9 ms
    slower to 4.8 ms faster), and needs no symmetric buffer (0.19 GiB less per rank at the 1.3B
    shape, 0.71 GiB at 14B). Ulysses with joint text (Flux, SD3, CogVideoX, HunyuanVideo, Mochi,
    QwenImage) always runs on NCCL: its text rows travel in the same all-to-all. ``"copy_engine"``
    asks for them in either dense mode at any world size. VSA and hybrid always use NCCL.

    Raises:
        SequenceParallelConfigError: ``"copy_engine"`` was asked for where it cannot run, for hybrid,
            or for Ulysses on a model with joint text (the same on every rank: the checks read only the
            traits, the group and the launcher's environment).
    """
    if mode == "hybrid" and requested == "copy_engine" and group.world_size > 1:
        raise _hybrid_copy_engine_refusal(traits)
    if mode not in ("ulysses", "kv_gather") or requested == "nccl" or group.world_size == 1:
        return "nccl"  # at world size 1 nothing is transferred
    joint = [m.name for m in traits.models if m.joint_text]
    if mode == "ulysses" and joint:
        if requested == "copy_engine":
            raise SequenceParallelConfigError(
                f"{traits.name}: sp_transport='copy_engine' does not apply to Ulysses on {joint[0]}, whose "
                "self-attention has joint text tokens (Ulysses then runs on NCCL). Use mode='kv_gather' with "
                "sp_transport='copy_engine', or sp_transport='auto' or 'nccl'.")
        return "nccl"
    if requested == "auto" and (group.world_size != 2 or dist.get_world_size() != 2 or
                                (mode == "kv_gather" and kv_first)):
        return "nccl"
    reason = copy_engine_unavailable_reason(group)
    if reason is None:
        return "copy_engine"
    if requested == "copy_engine":
        raise SequenceParallelConfigError(
            f"{traits.name}: sp_transport='copy_engine' cannot run here: {reason}. Use sp_transport='nccl' or 'auto'.")
    return "nccl"


def enable_sequence_parallel(target, mode: str = "auto", *, process_group=None, cfg_parallel: bool | str = False,
                             sp_degree: int | None = None, ulysses_degree: int | None = None,
                             parallel_vae: bool = False,
                             attention_kernel: str = "auto", sp_transport: str = "auto",
                             overlap_head_groups: int | str = "auto", overlap_query_projection: bool = True,
                             vsa_sparsity: float | None = None, vsa_tile_size: tuple[int, int, int] | None = None,
                             vsa_sp_mode: str | None = None, vsa_gate_weights=None) -> SequenceParallelHandle:
    """Splits the token sequence of a pipeline's transformer(s) across the ranks of a process group.

    Every rank runs the same pipeline call; each transformer forward is split along its tokens
    (balanced shards, the first ``S mod P`` ranks one token more), self-attention runs with the
    chosen strategy, and the output is gathered to the full sequence, so the scheduler, VAE and
    callbacks see exactly what one process would compute.

    Args:
        target: A Diffusers pipeline (every transformer it holds is parallelized, e.g. ``transformer``
            and ``transformer_2`` of Wan 2.2) or a transformer model; see
            :func:`diffusers_sp.pipelines.resolve_target` and the README's coverage table.
        mode: ``"auto"`` (:func:`diffusers_sp.validation.choose_auto_mode`: inside one host K/V-gather
            at world size <= 2 or heads not divisible by it, Ulysses otherwise, hybrid with fewer heads
            than ranks; across hosts hybrid, Ulysses inside each host), ``"ulysses"`` (all-to-all over
            heads), ``"kv_gather"`` (all-gather K and V), ``"hybrid"`` (Ulysses inside groups of
            ``ulysses_degree`` ranks, K/V-gather across them: USP, arXiv 2405.07719; see
            :mod:`diffusers_sp.processors.hybrid`) or ``"vsa"`` (video sparse attention, arXiv
            2505.13389, on families that can read the latent grid).
        process_group: A ``torch.distributed.ProcessGroup`` to split over; ``None`` uses the whole
            run as launched by ``accelerate launch`` / ``torchrun`` (initialised through
            ``accelerate.PartialState``: NCCL on CUDA, gloo on CPU), or one process if not launched.
        cfg_parallel: ``False`` (default), ``True`` (two CFG groups, a ``cfg x sp`` mesh: one computes
            the conditional pass, one the unconditional; see :mod:`diffusers_sp.cfg_parallel`) or
            ``"auto"`` (chosen by :func:`diffusers_sp.cfg_parallel.choose_cfg_parallel`).
        sp_degree: Ranks per sequence-parallel group; ``None``: all ranks not used by CFG. Smaller
            values leave ``world / (cfg x sp)`` replicas (see :mod:`diffusers_sp.replicas`); the
            handle reports ``replica_index`` and ``num_replicas``.
        ulysses_degree: ``None`` or U, a divisor of the sequence-parallel group's P ranks, at most the
            fewest heads of any model: the group factors into ``P / U`` K/V-gather x ``U`` Ulysses
            (``world = replicas x cfg x kv_gather x ulysses``; Ulysses groups are ``U`` consecutive
            ranks, so they share a host when U divides the ranks per host). Honoured by
            ``mode="hybrid"`` and ``"auto"`` (U = P: Ulysses, U = 1: K/V-gather, else hybrid) and by
            ``mode="vsa"`` for its ``vsa_sp_mode``; ``"ulysses"`` accepts only P, ``"kv_gather"``
            only 1. ``None``: chosen from the head count, P and the ranks per host
            (``LOCAL_WORLD_SIZE``, set by ``torchrun`` and ``accelerate launch``), see
            :func:`diffusers_sp.validation.default_ulysses_degree`. Queries, keys and values in the
            attention call stay ``[B, H, T + S_r, D]`` on every rank.
        parallel_vae: Share the VAE's decode tiles over the ranks of a replica
            (:mod:`diffusers_sp.vae`; enables the VAE's tiling).
        attention_kernel: The local dense kernel: ``"auto"``, ``"sdpa"`` or ``"flash_attn"`` (see
            :func:`diffusers_sp.kernels.sdpa.local_attention`).
        sp_transport: ``"auto"`` (the copy engines through symmetric memory when the launch is one group
            of 2 CUDA ranks on one host, else the collectives; the collectives for K/V-gather where the
            K/V-first path runs, see ``overlap_query_projection``), ``"nccl"`` (the group's collectives;
            gloo on CPU) or ``"copy_engine"`` (either dense mode at any world size; an error where it
            cannot run, and for Ulysses on models with joint text); see :mod:`diffusers_sp.copy_engine`.
        overlap_head_groups: ``"auto"`` (2) or a positive int: the head groups whose copy-engine
            transfers overlap the attention.
        overlap_query_projection: In both dense modes on families that provide it (Wan), K and V are
            projected first and their transfer overlaps the query projection, QK-norm and RoPE (only
            the norm and RoPE with fused QKV projections).
        vsa_sparsity: ``mode="vsa"`` only: fraction of key tiles skipped, in ``[0, 1)``; ``None``: 0.9.
        vsa_tile_size: ``mode="vsa"`` only: the tile, in latent patches, frames first; ``None``:
            ``(4, 4, 4)``.
        vsa_sp_mode: ``mode="vsa"`` only: the communication underneath, ``"auto"`` (``None``; the
            rule of ``mode="auto"``), ``"ulysses"``, ``"kv_gather"`` or ``"hybrid"`` (with
            ``ulysses_degree``).
        vsa_gate_weights: ``mode="vsa"`` only: path of a safetensors file or folder with
            ``blocks.{i}.to_gate_compress.{weight,bias}`` (a dict ``{attribute: path}`` for a pipeline
            with several transformers); ``None``: zero gate.

    Returns:
        A :class:`SequenceParallelHandle` with ``mode``, ``sp_mode``, ``ulysses_degree``,
        ``kv_gather_degree``, ``transport``, ``attention_kernel``, ``rank`` and ``world_size`` (in the
        sequence-parallel group), ``replica_index`` and ``num_replicas`` (see ``sp_degree``),
        ``cfg_rank`` and ``cfg_degree``, ``is_output_rank`` (the one rank of each replica that should
        write its outputs) and ``disable()``.

    Raises:
        SequenceParallelConfigError: a target holding no transformer diffusers-sp runs, an unknown
            mode or option value, a mode the model cannot run exactly (e.g. Ulysses with fewer heads
            than ranks), a ``ulysses_degree`` that does not divide the group, exceeds the heads or
            contradicts the mode (the message lists the values that work), ``mode="hybrid"`` with a
            ``process_group`` or ``sp_transport="copy_engine"``, ``vsa_*`` options with another mode,
            sequence parallelism already enabled on the target, or an unusable process group. Raised
            before any collective, with the same message on every rank (ranks launched with different
            settings all get the same error).
    """
    given_vsa = {"vsa_sparsity": vsa_sparsity, "vsa_tile_size": vsa_tile_size, "vsa_sp_mode": vsa_sp_mode,
                 "vsa_gate_weights": vsa_gate_weights}
    opts = dict(attention_kernel=attention_kernel, sp_transport=sp_transport, overlap_head_groups=overlap_head_groups,
                overlap_query_projection=overlap_query_projection,
                **{k: VSA_DEFAULTS[k] if v is None else v for k, v in given_vsa.items()})
    # Every check that needs no other rank runs first. A rank whose settings are refused takes part in
    # the agreement below with its refusal, so that ranks launched with different settings (one rank's
    # refused, the others' valid) all raise the same error instead of waiting for the refused one.
    try:
        plan = _plan(target, mode, process_group, cfg_parallel, sp_degree, ulysses_degree, parallel_vae, opts,
                     given_vsa)
        agree = dict(plan.agree, refused=None)
    except SequenceParallelConfigError as exc:
        plan, agree = exc, {"refused": str(exc)}
    launch = resolve_group(process_group)
    _check_same_on_all_ranks(launch, agree)
    if isinstance(plan, SequenceParallelConfigError):
        raise plan
    family, models, traits, layout = plan.family, plan.models, plan.traits, plan.layout
    resolved, ulysses, vsa, sp_mode = plan.resolved, plan.ulysses, plan.vsa, plan.sp_mode
    if plan.gate_error is not None:
        raise plan.gate_error
    hybrid = sp_mode == "hybrid"
    if layout.trivial and not hybrid:
        group, pgroups = launch, None
    else:
        from .groups import build_parallel_groups

        pgroups = build_parallel_groups(layout.num_replicas, layout.cfg_degree, layout.sp_degree,
                                        ulysses if hybrid else None)
        group = pgroups.sp
    kv_first = family.self_attention_kv_first if opts["overlap_query_projection"] else None
    transport = _agreed_transport(opts["sp_transport"], sp_mode, group, traits, kv_first=kv_first is not None)

    handle = SequenceParallelHandle(mode=resolved, rank=group.rank, world_size=group.world_size, traits=traits,
                                    group=group, target=target, sp_mode=sp_mode,
                                    transport=transport if transport == "copy_engine" else group.backend or "none",
                                    ulysses_degree=ulysses, kv_gather_degree=group.world_size // ulysses,
                                    requested_kernel=opts["attention_kernel"])
    replica_group = group
    if pgroups is not None:
        handle.groups = pgroups
        handle.replica_index, handle.num_replicas = pgroups.replica_index, pgroups.num_replicas
        handle.cfg_rank, handle.cfg_degree = pgroups.cfg_rank, pgroups.cfg_degree
        replica_group = pgroups.replica  # every rank working on the same sample
    try:
        _install(handle, target, family, models, traits, vsa=vsa, opts=opts, kv_first=kv_first,
                 layout=layout, parallel_vae=parallel_vae, replica_group=replica_group)
    except BaseException:
        handle.disable()  # nothing half-installed stays behind
        raise
    if handle.is_output_rank and handle.replica_index == 0:
        sp = f"sp {layout.sp_degree}" + (f" (ulysses {ulysses} x kv_gather {layout.sp_degree // ulysses})"
                                          if sp_mode == "hybrid" else "")
        sizes = (sp if layout.trivial else
                 f"{layout.num_replicas} replica(s) x cfg {layout.cfg_degree} x {sp} = "
                 f"{layout.num_replicas * layout.cfg_degree * layout.sp_degree} ranks")
        logger.info("diffusers-sp: %s with %s, %s, transfers by %s, attention kernel %s%s", traits.name,
                    resolved if vsa is None else f"vsa (under {vsa['sp_mode']})", sizes, handle.transport,
                    handle.attention_kernel,
                    f" (cfg_parallel='auto': {layout.cfg_reason})" if layout.cfg_reason else "")
    return handle


@dataclass
class _Plan:
    """What :func:`enable_sequence_parallel` settles on one rank before any collective."""

    family: object
    models: list
    traits: PipelineTraits
    layout: object
    resolved: str
    ulysses: int
    vsa: dict | None
    sp_mode: str
    gate_error: Exception | None
    agree: dict


def _plan(target, mode, process_group, cfg_parallel, sp_degree, ulysses_degree, parallel_vae, opts,
          given_vsa) -> _Plan:
    """The checks and choices of :func:`enable_sequence_parallel` that need no other rank (pure apart from
    reading ``vsa_gate_weights``); raises SequenceParallelConfigError for a setting it refuses."""
    _check_options(opts, parallel_vae)
    family, models = resolve_target(target)
    traits = PipelineTraits(name=type(target).__name__, family=family.name, is_video=family.is_video,
                            models=tuple(family.model_traits(m, a) for a, m in models))
    if getattr(target, _HANDLE_ATTR, None) is not None or any(getattr(m, _HANDLE_ATTR, None) for _, m in models):
        raise SequenceParallelConfigError(
            f"{traits.name}: sequence parallelism is already enabled; call disable_sequence_parallel() first.")
    layout = _resolve_layout(target, traits, family, process_group, cfg_parallel, sp_degree)
    host_size = _host_size(process_group)
    resolved, ulysses = resolve_mode(mode, traits, layout.sp_degree, ulysses_degree=ulysses_degree,
                                     host_size=host_size)
    # The hybrid mode builds its groups from the whole launch and moves tensors with the collectives, so
    # where the user passed a process_group or asked for the copy engines, "auto" falls back to
    # K/V-gather (no constraint on heads) instead of choosing a mode that is then refused.
    hybrid_blocked = process_group is not None or opts["sp_transport"] == "copy_engine"
    if resolved == "hybrid" and mode == "auto" and ulysses_degree is None and hybrid_blocked:
        resolved, ulysses = "kv_gather", 1
    cfg_strategy = family.cfg_strategy if layout.cfg_degree == 2 else None
    for _, model in models:
        caches.check_no_diffusers_parallelism(model)
        caches.CacheSupport(type(model).__name__, None, cfg_strategy=cfg_strategy).check(model.modules())
    stray = sorted(k for k, v in given_vsa.items() if v is not None and resolved != "vsa")
    if stray:
        raise SequenceParallelConfigError(
            f"{traits.name}: {', '.join(stray)} apply to mode='vsa' only, but the mode is {resolved!r} "
            f"(from mode={mode!r}). Pass mode='vsa' or drop them.")
    vsa, gate_error = _resolve_vsa(traits, family, layout, opts, ulysses_degree, host_size) if resolved == "vsa" \
        else (None, None)
    if vsa and vsa["sp_mode"] == "hybrid" and opts["vsa_sp_mode"] == "auto" and ulysses_degree is None \
            and hybrid_blocked:
        vsa["sp_mode"], vsa["ulysses_degree"] = "kv_gather", 1
    sp_mode = vsa["sp_mode"] if vsa else resolved
    if vsa:
        ulysses = vsa["ulysses_degree"]
    if sp_mode == "hybrid" and opts["sp_transport"] == "copy_engine" and layout.sp_degree > 1:
        raise _hybrid_copy_engine_refusal(traits)  # before any collective
    if sp_mode == "hybrid" and process_group is not None:
        raise SequenceParallelConfigError(
            f"{traits.name}: mode='hybrid' builds its Ulysses and K/V-gather groups from the whole launch; pass "
            f"process_group=None with it (sp_degree makes smaller sequence-parallel groups), or use "
            f"mode='ulysses' / 'kv_gather' over the process_group.")
    if parallel_vae:
        from .vae import check_parallel_vae

        check_parallel_vae(target, models)

    # What every rank of the launch must agree on, checked over the whole launch (or the passed
    # process_group) before the replica/CFG/SP sub-groups are built: building them is itself a
    # collective over the launch, which ranks with different layouts would enter with different
    # arguments and never leave.
    agree = {
        "model": traits.fingerprint(), "mode": resolved, "attention_kernel": opts["attention_kernel"],
        "sp_transport": opts["sp_transport"], "overlap_head_groups": opts["overlap_head_groups"],
        "overlap_query_projection": opts["overlap_query_projection"],
        "vsa": None if vsa is None else (vsa["sparsity"], vsa["tile"], vsa["sp_mode"], opts["vsa_gate_weights"] is not None),
        "replicas": layout.num_replicas, "cfg_degree": layout.cfg_degree, "sp_degree": layout.sp_degree,
        "ulysses_degree": ulysses,
        "parallel_vae": bool(parallel_vae),
        "hooks (caches, offloading, ...)": [caches.describe(model.modules()) for _, model in models],
        "vsa_gate_weights (read)": "ok" if gate_error is None else f"failed: {gate_error}"}
    return _Plan(family=family, models=models, traits=traits, layout=layout, resolved=resolved, ulysses=ulysses,
                 vsa=vsa, sp_mode=sp_mode, gate_error=gate_error, agree=agree)


def _check_options(opts: dict, parallel_vae) -> None:
    """The type and value checks of :func:`enable_sequence_parallel`'s options (pure: every rank alike)."""
    if opts["attention_kernel"] not in KERNELS:
        raise SequenceParallelConfigError(
            f"attention_kernel={opts['attention_kernel']!r} is not one of {KERNELS}.")
    if opts["sp_transport"] not in TRANSPORTS:
        raise SequenceParallelConfigError(f"sp_transport={opts['sp_transport']!r} is not one of {TRANSPORTS}.")
    if not isinstance(parallel_vae, bool):
        raise SequenceParallelConfigError(f"parallel_vae must be True or False, got {parallel_vae!r}.")
    if not isinstance(opts["overlap_query_projection"], bool):
        raise SequenceParallelConfigError(
            f"overlap_query_projection must be True or False, got {opts['overlap_query_projection']!r}.")
    try:
        head_group_sizes(1, opts["overlap_head_groups"])  # the copy engines' own check of the option
    except ValueError as exc:
        raise SequenceParallelConfigError(f"{exc}.") from None


def _resolve_layout(target, traits, family, process_group, cfg_parallel, sp_degree):
    """The ``replicas x cfg x sp`` :class:`~diffusers_sp.replicas.Layout` (pure, before any collective);
    a pipeline with perturbed-attention guidance keeps CFG parallelism off (see :func:`_perturbed_guidance`)."""
    from .replicas import resolve_layout

    pag = _perturbed_guidance(target)
    if pag and cfg_parallel is True:
        raise SequenceParallelConfigError(
            f"{traits.name}: cfg_parallel=True cannot split this pipeline's guidance: {pag}, while CFG "
            f"parallelism gives each CFG group one half of the batch. Use cfg_parallel=False (sequence "
            f"parallelism runs perturbed-attention guidance exactly).")
    layout = resolve_layout(traits.name, world_size_for(process_group), cfg_parallel=cfg_parallel,
                            sp_degree=sp_degree, family=family.name,
                            cfg_capable=family.cfg_strategy is not None and not pag,
                            cfg_by_default=family.cfg_by_default, process_group=process_group)
    if pag and cfg_parallel == "auto":
        layout = dataclasses.replace(layout, cfg_reason=pag)
    return layout


def _host_size(process_group) -> int | None:
    """Ranks per host of the launch, from ``LOCAL_WORLD_SIZE`` (``torchrun`` and ``accelerate launch``
    set it on every rank); ``None`` (taken as one host) when it is not set or a ``process_group`` was
    passed, whose ranks need not follow the launch's numbering."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    if process_group is not None or not value.strip().isdigit() or int(value) < 1:
        return None
    return int(value)


def _resolve_vsa(traits, family, layout, opts, ulysses_degree=None,
                 host_size=None) -> tuple[dict, SequenceParallelConfigError | None]:
    """``mode="vsa"``'s options checked and its gate weights read: ``(vsa settings, the reading's error)``.

    Every rank reads the files before any collective. A file that only some ranks can read (a path
    missing on one host) must not fail on those alone: the outcome is compared over the launch with the
    other options, and raised after that on every rank."""
    sparsity, tile, sp_mode, ulysses = validate_vsa(
        traits, layout.sp_degree, sparsity=opts["vsa_sparsity"], tile_size=opts["vsa_tile_size"],
        sp_mode=opts["vsa_sp_mode"], has_latent_grid=family.latent_grid is not None,
        family_refusal=family.vsa_refusal, ulysses_degree=ulysses_degree, host_size=host_size)
    paths = _gate_paths(opts["vsa_gate_weights"], traits)
    gate_error = None
    try:
        gates = [None if path is None else load_gate_weights(path, mt.num_attention_layers, mt.num_heads * mt.head_dim)
                 for path, mt in zip(paths, traits.models)]
    except Exception as exc:  # noqa: BLE001 - any reader error (missing file, bad safetensors) is shared
        gates, gate_error = None, exc if isinstance(exc, SequenceParallelConfigError) else \
            SequenceParallelConfigError(f"vsa_gate_weights: {type(exc).__name__}: {exc}")
    return dict(sparsity=sparsity, tile=tile, sp_mode=sp_mode, ulysses_degree=ulysses, gates=gates), gate_error


def _agreed_transport(requested: str, mode: str, group: SPGroup, traits, *, kv_first: bool) -> str:
    """:func:`_resolve_transport`, its verdict or refusal shared within the SP group: it also depends on
    each rank's environment (launcher variables, peer access), so no rank may raise alone."""
    try:
        transport, refusal = _resolve_transport(requested, mode, group, traits, kv_first=kv_first), None
    except SequenceParallelConfigError as exc:
        transport, refusal = None, str(exc)
    _check_same_on_all_ranks(group, {"sp_transport (resolved)": transport if refusal is None else f"refused: {refusal}"})
    if refusal is not None:
        raise SequenceParallelConfigError(refusal)
    return transport


def _install(handle, target, family, models, traits, *, vsa, opts, kv_first, layout, parallel_vae,
             replica_group) -> None:
    """The installing part of :func:`enable_sequence_parallel`, after every check: hooks, processors,
    CFG parallelism, parallel VAE, RNG and latents, each recorded on ``handle`` as it goes (so that
    ``handle.disable()`` undoes a partial install)."""
    from . import cfg_parallel as _cfg

    group, transport, pgroups = handle.group, handle.transport, handle.groups
    groups_opt = opts["overlap_head_groups"]
    # A family whose attention has one exact parallel form of its own runs it whichever dense mode was
    # asked for (Sana's linear attention: its key sums all-reduced, processors/linear.py).
    processor_cls = family.attention_processor or PROCESSORS[handle.mode]
    for index, ((_, model), model_traits) in enumerate(zip(models, traits.models)):
        # The processors read where joint-attention text tokens sit (None, "prefix" or "suffix").
        state = SequenceState(group, owner=traits.name, extra={"joint_text": model_traits.joint_text},
                              mesh=pgroups.hybrid if pgroups is not None else None)
        installed = _InstalledModel(model, state, hooks=[], processors=[], modules=list(model.modules()),
                                    swapped=tuple(family.swapped_processors))
        # A cache decides once for what one process computes in one call: with CFG folded into the
        # batch and split between the CFG groups, that is the whole replica (diffusers_sp.caches).
        cfg_strategy = family.cfg_strategy if layout.cfg_degree == 2 else None
        installed.caches = caches.CacheSupport(type(model).__name__,
                                               replica_group if cfg_strategy == "batch" else group, state,
                                               cfg_strategy=cfg_strategy)
        state.check = functools.partial(_check_model, installed)
        handle._models.append(installed)
        installed.hooks = apply_plan(model, family.sharding_plan(model), state, refuse=family.unsupported_inputs,
                                     hooks=family.forward_hooks(model, state) if family.forward_hooks else None)
        if vsa is not None:
            # Attached last, so its pre-forward runs first and sets the tile order for the splits.
            installed.hooks.append(attach("", model, TileOrderHook(state, family.latent_grid, vsa["tile"])))
        installed.caches.scan(installed.modules)
        dispatch = family.attention_call == "dispatch"
        if vsa is None:
            installed.wrap = functools.partial(processor_cls, state=state, kernel=opts["attention_kernel"],
                                               transport=transport, head_groups=groups_opt, kv_first=kv_first,
                                               dispatch=dispatch)
        modules = [(name, module, layer) for layer, (name, module) in enumerate(family.attention_modules(model))]
        if family.split_kv_attention_modules is not None:  # whole queries over split K/V: K/V-gather in every mode
            modules += [(name, module, None) for name, module in family.split_kv_attention_modules(model)]
        for name, module, layer in modules:
            inner = module.processor
            saved = {k: getattr(inner, k) for k in _PROCESSOR_ATTRIBUTES if hasattr(inner, k)}
            if layer is None:
                processor = SplitKVAttnProcessor(inner, state, kernel=opts["attention_kernel"], dispatch=dispatch)
            elif vsa is None:
                processor = processor_cls(inner, state, kernel=opts["attention_kernel"], transport=transport,
                                          head_groups=groups_opt, kv_first=kv_first, dispatch=dispatch)
            else:
                gate = vsa["gates"][index][layer] if vsa["gates"][index] is not None else None
                processor = VideoSparseAttnProcessor(inner, state, sparsity=vsa["sparsity"], sp_mode=vsa["sp_mode"],
                                                     gate=gate, dispatch=dispatch)
            installed.processors.append((name, module, inner, saved, processor))
            if dispatch:
                # The model's processor passes this to dispatch_attention_fn for the calls context
                # parallelism splits; the wrapper's dispatcher runs those (processors/base.py).
                inner._parallel_config = PARALLEL_CALL
            elif hasattr(inner, "_attention_backend"):
                # dispatch_attention_fn with the native backend ends in F.scaled_dot_product_attention,
                # which the wrapper catches.
                inner._attention_backend = "native"
            _set_processor(module, processor)
        setattr(model, _HANDLE_ATTR, handle)
    if layout.cfg_degree == 2:
        handle._cfg_hooks = _cfg.install(target, family.name, models, pgroups, handle, family.cfg_strategy)
    if parallel_vae:
        from .vae import install_parallel_vae

        install_parallel_vae(target, replica_group, handle)
        handle.parallel_vae = True
    if target is not models[0][1]:
        _sync_rng_states(replica_group)
        for pipe in _latent_preparers(target, models):
            _patch_prepare_latents(pipe, replica_group, handle)
        _patch_processor_methods(target, handle)
    setattr(target, _HANDLE_ATTR, handle)


def disable_sequence_parallel(target) -> None:
    """Undoes :func:`enable_sequence_parallel` on ``target`` (a pipeline or model).

    Restores every original processor and removes every hook; the model then gives exactly its
    original outputs. Does nothing if sequence parallelism is not enabled on ``target``.
    """
    handle = getattr(target, _HANDLE_ATTR, None)
    if handle is not None:
        handle.disable()
