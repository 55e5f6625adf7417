"""enable_sequence_parallel / disable_sequence_parallel: traits -> validate -> group -> install."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .comm import broadcast_tensor
from .groups import SPGroup, resolve_group, world_size_for
from .kernels.sdpa import KERNELS
from .pipelines import FamilySpec, family_for
from .processors import PROCESSORS
from .sharding import SequenceState, apply_plan, remove_hooks
from .traits import PipelineTraits
from .validation import SequenceParallelConfigError, validate_mode

logger = logging.getLogger("diffusers_sp")

_OPTIONS = {"attention_kernel": "auto"}
_HANDLE_ATTR = "_diffusers_sp_handle"


def _set_processor(module: torch.nn.Module, processor) -> None:
    """``module.set_processor(processor)``; attention classes without it (``MochiAttention``) get the attribute."""
    if hasattr(module, "set_processor"):
        module.set_processor(processor)
    else:
        module.processor = processor


@dataclass
class _InstalledModel:
    model: torch.nn.Module
    state: SequenceState
    hooks: list
    processors: list  # (attention module, original processor, original inner backend)


@dataclass
class SequenceParallelHandle:
    """What :func:`enable_sequence_parallel` installed.

    Attributes:
        mode: The mode that runs (``"ulysses"`` or ``"kv_gather"``; ``"auto"`` resolved).
        rank: This process's rank in the sequence-parallel group.
        world_size: Ranks in the group (1: nothing is split).
        traits: The pipeline's traits as read at enable time.
        group: The :class:`~diffusers_sp.groups.SPGroup`.
    """

    mode: str
    rank: int
    world_size: int
    traits: PipelineTraits
    group: SPGroup
    target: object = field(repr=False)
    _models: list = field(default_factory=list, repr=False)
    _pipeline_patches: list = field(default_factory=list, repr=False)

    def disable(self) -> None:
        """Restores the original processors and removes every hook; outputs are then the model's own."""
        for installed in self._models:
            remove_hooks(installed.hooks)
            for module, original, backend in installed.processors:
                _set_processor(module, original)
                if hasattr(original, "_attention_backend"):
                    original._attention_backend = backend
            if getattr(installed.model, _HANDLE_ATTR, None) is self:
                delattr(installed.model, _HANDLE_ATTR)
        for obj, name in self._pipeline_patches:
            if name in vars(obj):
                delattr(obj, name)
        if getattr(self.target, _HANDLE_ATTR, None) is self:
            delattr(self.target, _HANDLE_ATTR)
        self._models.clear()
        self._pipeline_patches.clear()


def _models_of(target, family: FamilySpec) -> list[tuple[str, torch.nn.Module]]:
    if type(target).__name__ in family.model_classes:
        return [("", target)]
    found = [(a, getattr(target, a, None)) for a in family.transformer_attributes]
    found = [(a, m) for a, m in found if m is not None]
    if not found:
        raise SequenceParallelConfigError(f"{type(target).__name__} has no transformer to parallelize.")
    for attribute, model in found:
        if type(model).__name__ not in family.model_classes:
            raise SequenceParallelConfigError(
                f"{type(target).__name__}.{attribute} is a {type(model).__name__}; diffusers-sp supports "
                f"{', '.join(family.model_classes)} in this pipeline.")
    return found


def read_traits(target) -> PipelineTraits:
    """Reads the traits of a supported pipeline or transformer (see :mod:`diffusers_sp.traits`).

    Raises:
        SequenceParallelConfigError: the pipeline or model is not supported.
    """
    family = family_for(target)
    models = tuple(family.model_traits(m, a) for a, m in _models_of(target, family))
    return PipelineTraits(name=type(target).__name__, family=family.name, is_video=family.is_video, models=models)


def _check_same_on_all_ranks(group: SPGroup, fingerprint: tuple) -> None:
    if group.world_size == 1:
        return
    gathered = [None] * group.world_size
    dist.all_gather_object(gathered, fingerprint, group=group.group)
    if any(g != gathered[0] for g in gathered):
        raise SequenceParallelConfigError(
            "ranks disagree on the pipeline or mode to parallelize (every rank must load the same model "
            f"and pass the same mode): {gathered}")


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
    """Makes ``pipe.prepare_latents`` return rank 0's latents on every rank (one broadcast per call)."""
    original = getattr(pipe, "prepare_latents", None)
    if original is None or group.world_size == 1:
        return

    @functools.wraps(original)
    def prepare_latents(*args, **kwargs):
        return _broadcast_tree(original(*args, **kwargs), group)

    pipe.prepare_latents = prepare_latents
    handle._pipeline_patches.append((pipe, "prepare_latents"))


def enable_sequence_parallel(target, mode: str = "auto", *, process_group=None, **options) -> SequenceParallelHandle:
    """Splits the token sequence of a pipeline's transformer(s) across the ranks of a process group.

    Every rank runs the same pipeline call; each transformer forward is split along its tokens
    (balanced shards, the first ``S mod P`` ranks one token more), self-attention runs with the
    chosen strategy, and the output is gathered to the full sequence, so the scheduler, VAE and
    callbacks see exactly what one process would compute.

    Args:
        target: A supported ``DiffusionPipeline`` (all its transformers are parallelized, e.g.
            ``transformer`` and ``transformer_2`` of Wan 2.2) or a supported transformer model.
        mode: ``"auto"`` (K/V-gather at world size <= 2 or heads not divisible by it, else Ulysses),
            ``"ulysses"`` (all-to-all over heads) or ``"kv_gather"`` (all-gather K and V).
        process_group: A ``torch.distributed.ProcessGroup`` to split over; ``None`` uses the whole
            run as launched by ``accelerate launch`` / ``torchrun`` (initialised through
            ``accelerate.PartialState``: NCCL on CUDA, gloo on CPU), or one process if not launched.
        **options: ``attention_kernel`` = ``"auto"`` | ``"sdpa"`` | ``"flash_attn"`` (local kernel).

    Returns:
        A :class:`SequenceParallelHandle` with ``mode``, ``rank``, ``world_size`` and ``disable()``.

    Raises:
        SequenceParallelConfigError: unsupported pipeline or model, unknown mode or option, a mode
            the model cannot run exactly (e.g. Ulysses with fewer heads than ranks), sequence
            parallelism already enabled on the target, or an unusable process group. Raised before
            any collective, with the same message on every rank.
    """
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise SequenceParallelConfigError(
            f"{type(target).__name__}: unknown option(s) {unknown}; known options: {sorted(_OPTIONS)}.")
    opts = {**_OPTIONS, **options}
    if opts["attention_kernel"] not in KERNELS:
        raise SequenceParallelConfigError(
            f"attention_kernel={opts['attention_kernel']!r} is not one of {KERNELS}.")
    traits = read_traits(target)
    family = family_for(target)
    models = _models_of(target, family)
    if getattr(target, _HANDLE_ATTR, None) is not None or any(getattr(m, _HANDLE_ATTR, None) for _, m in models):
        raise SequenceParallelConfigError(
            f"{traits.name}: sequence parallelism is already enabled; call disable_sequence_parallel() first.")
    resolved = validate_mode(mode, traits, world_size_for(process_group))

    group = resolve_group(process_group)
    _check_same_on_all_ranks(group, (traits.fingerprint(), resolved, opts["attention_kernel"]))

    handle = SequenceParallelHandle(mode=resolved, rank=group.rank, world_size=group.world_size, traits=traits,
                                    group=group, target=target)
    processor_cls = PROCESSORS[resolved]
    for (_, model), model_traits in zip(models, traits.models):
        # The processors read where joint-attention text tokens sit (None, "prefix" or "suffix").
        state = SequenceState(group, extra={"joint_text": model_traits.joint_text})
        installed = _InstalledModel(model, state, hooks=[], processors=[])
        handle._models.append(installed)
        installed.hooks = apply_plan(model, family.sharding_plan(model), state)
        for _, module in family.attention_modules(model):
            inner = module.processor
            backend = getattr(inner, "_attention_backend", None)
            if hasattr(inner, "_attention_backend"):
                # dispatch_attention_fn with the native backend ends in F.scaled_dot_product_attention,
                # which the wrapper catches.
                inner._attention_backend = "native"
            installed.processors.append((module, inner, backend))
            _set_processor(module, processor_cls(inner, state, kernel=opts["attention_kernel"]))
        setattr(model, _HANDLE_ATTR, handle)
    if target is not models[0][1]:
        _sync_rng_states(group)
        _patch_prepare_latents(target, group, handle)
    setattr(target, _HANDLE_ATTR, handle)
    if group.rank == 0:
        logger.info("diffusers-sp: %s with %s over %d rank(s)", traits.name, resolved, group.world_size)
    return handle


def disable_sequence_parallel(target) -> None:
    """Undoes :func:`enable_sequence_parallel` on ``target`` (a pipeline or model).

    Restores every original processor and removes every hook; the model then gives exactly its
    original outputs. Does nothing if sequence parallelism is not enabled on ``target``.
    """
    handle = getattr(target, _HANDLE_ATTR, None)
    if handle is not None:
        handle.disable()
