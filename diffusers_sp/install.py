"""Installing sequence parallelism on a pipeline once it is planned and agreed: the sharding hooks
and wrapped processors of each transformer, CFG parallelism, the parallel VAE, and the pipeline
patches that keep every rank on the same latents (RNG states, ``prepare_latents``). Each step is
recorded on the :class:`~diffusers_sp.handle.SequenceParallelHandle` that undoes it.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist

from . import caches
from .comm import broadcast_tensor
from .errors import SequenceParallelConfigError
from .groups import SPGroup
from .handle import (HANDLE_ATTR, PROCESSOR_ATTRIBUTES, InstalledModel, SequenceParallelHandle, WrappedProcessor,
                     set_processor)
from .pipelines import transformers_of
from .planning import EnableOptions, EnablePlan
from .plan_entries import SequenceState
from .processors import PROCESSORS, SplitKVAttnProcessor
from .processors.capture import PARALLEL_CALL
from .processors.vsa import TileOrderHook, VideoSparseAttnProcessor
from .sharding import apply_plan, attach, retarget
from .weights import shard_pipeline


def install(handle: SequenceParallelHandle, target, plan: EnablePlan, *, opts: EnableOptions, kv_first,
            parallel_vae: bool, replica_group: SPGroup, process_group=None) -> None:
    """The installing part of :func:`~diffusers_sp.enable_sequence_parallel`, after every check: hooks,
    processors, CFG parallelism, parallel VAE, RNG and latents, each recorded on ``handle`` as it goes
    (so that ``handle.disable()`` undoes a partial install).

    Args:
        kv_first: The family's K/V-first self-attention (``overlap_query_projection``) or ``None``.
        replica_group: Every rank working on the same sample (the SP group, or CFG x SP).
        process_group: The caller's ``process_group`` (``shard_weights`` then shards over it).
    """
    from . import cfg_parallel as _cfg

    family, models, layout = plan.family, plan.models, plan.layout
    for index, ((_, model), model_traits) in enumerate(zip(models, plan.traits.models)):
        installed = _install_model(handle, model, model_traits, plan, replica_group)
        processors = _processor_factory(handle, installed, plan, opts, kv_first, index)
        for name, module, layer in _attention_modules(family, model):
            _wrap(installed, name, module, processors(module.processor, layer), family.attention_call == "dispatch")
        setattr(model, HANDLE_ATTR, handle)
    if layout.cfg_degree == 2:
        handle._cfg_hooks = _cfg.install(target, family.name, models, handle.groups, handle, family.cfg_strategy)
    if parallel_vae:
        from .vae import install_parallel_vae

        install_parallel_vae(target, replica_group, handle)
        handle.parallel_vae = True
    if target is not models[0][1]:
        _sync_rng_states(replica_group)
        for pipe in _latent_preparers(target, models):
            _patch_prepare_latents(pipe, replica_group, handle)
        _patch_processor_methods(target, handle)
    if opts.shard_weights:  # last: every hook of ours is in place, and disable() undoes it first
        cfg_strategy = family.cfg_strategy if layout.cfg_degree == 2 else None
        launch = handle.groups.world if handle.groups is not None else handle.group
        handle.weights = shard_pipeline(target, models, layout, launch, cfg_strategy,
                                        own_group=handle.group if process_group is not None else None)
    setattr(target, HANDLE_ATTR, handle)


def _install_model(handle, model, model_traits, plan: EnablePlan, replica_group) -> InstalledModel:
    """The sequence state, cache support and sharding hooks of one transformer, recorded on ``handle``."""
    family, layout, pgroups = plan.family, plan.layout, handle.groups
    # The processors read where joint-attention text tokens sit (None, "prefix" or "suffix").
    state = SequenceState(handle.group, owner=plan.traits.name, extra={"joint_text": model_traits.joint_text},
                          mesh=pgroups.hybrid if pgroups is not None else None)
    installed = InstalledModel(model, state, hooks=[], processors=[], modules=list(model.modules()),
                               swapped=tuple(family.swapped_processors))
    # A cache decides once for what one process computes in one call: with CFG folded into the
    # batch and split between the CFG groups, that is the whole replica (diffusers_sp.caches).
    cfg_strategy = family.cfg_strategy if layout.cfg_degree == 2 else None
    installed.caches = caches.CacheSupport(type(model).__name__,
                                           replica_group if cfg_strategy == "batch" else handle.group, state,
                                           cfg_strategy=cfg_strategy)
    state.check = functools.partial(check_model, installed)
    handle._models.append(installed)
    installed.hooks = apply_plan(model, family.sharding_plan(model), state, refuse=family.unsupported_inputs,
                                 hooks=family.forward_hooks(model, state) if family.forward_hooks else None)
    if plan.vsa is not None:
        # Attached last, so its pre-forward runs first and sets the tile order for the splits.
        installed.hooks.append(attach("", model, TileOrderHook(state, family.latent_grid, plan.vsa.tile)))
    installed.caches.scan(installed.modules)
    return installed


def _attention_modules(family, model) -> list:
    """``(name, module, layer)`` of every attention module to wrap: the family's self-attention
    (``layer`` its index), its whole-query split-K/V modules (``layer`` ``None``) and its attention over
    two streams of the split tokens (``layer`` :data:`TWO_STREAMS`)."""
    modules = [(name, module, layer) for layer, (name, module) in enumerate(family.attention_modules(model))]
    if family.split_kv_attention_modules is not None:  # whole queries over split K/V: K/V-gather in every mode
        modules += [(name, module, None) for name, module in family.split_kv_attention_modules(model)]
    if family.two_stream_attention_modules is not None:
        modules += [(name, module, TWO_STREAMS) for name, module in family.two_stream_attention_modules(model)]
    return modules


#: The ``layer`` of an attention module over two streams of the split tokens (:func:`_attention_modules`).
TWO_STREAMS = "two_streams"


def _processor_factory(handle, installed: InstalledModel, plan: EnablePlan, opts: EnableOptions, kv_first, index):
    """``(inner processor, layer) -> our processor`` for one transformer (``index`` in the pipeline);
    also sets ``installed.wrap``, which wraps the processors a pipeline swaps in for a call."""
    family, vsa, state = plan.family, plan.vsa, installed.state
    dispatch = family.attention_call == "dispatch"
    # A family whose attention has one exact parallel form of its own runs it whichever dense mode was
    # asked for (Sana's linear attention: its key sums all-reduced, processors/linear.py).
    processor_cls = family.attention_processor or PROCESSORS[handle.mode]
    dense = functools.partial(processor_cls, state=state, kernel=opts.attention_kernel, transport=handle.transport,
                              head_groups=opts.overlap_head_groups, kv_first=kv_first, dispatch=dispatch,
                              attention_scale=family.attention_scale)
    if vsa is None:
        installed.wrap = dense

    def make(inner, layer):
        if layer is None:
            return SplitKVAttnProcessor(inner, state, kernel=opts.attention_kernel, dispatch=dispatch)
        if layer == TWO_STREAMS:  # dense in every mode: a family with such modules lists no "vsa" mode
            return dense(inner, streams=2)
        if vsa is None:
            return dense(inner)
        gate = vsa.gates[index][layer] if vsa.gates[index] is not None else None
        # The family's own self-attention whatever overlap_query_projection says: VSA has no K/V transfer
        # to start early, and the rewrite runs the same bits with faster kernels (Wan's RoPE).
        return VideoSparseAttnProcessor(inner, state, sparsity=vsa.sparsity, sp_mode=vsa.sp_mode, gate=gate,
                                        dispatch=dispatch, kv_first=family.self_attention_kv_first)

    return make


def _wrap(installed: InstalledModel, name: str, module, processor, dispatch: bool) -> None:
    """Puts ``processor`` (ours, around the module's own) on ``module`` and records it."""
    inner = module.processor
    saved = {k: getattr(inner, k) for k in PROCESSOR_ATTRIBUTES if hasattr(inner, k)}
    installed.processors.append(WrappedProcessor(name, module, inner, saved, processor))
    if dispatch:
        # The model's processor passes this to dispatch_attention_fn for the calls context
        # parallelism splits; the wrapper's dispatcher runs those (processors/base.py).
        inner._parallel_config = PARALLEL_CALL
    elif hasattr(inner, "_attention_backend"):
        # dispatch_attention_fn with the native backend ends in F.scaled_dot_product_attention,
        # which the wrapper catches.
        inner._attention_backend = "native"
    set_processor(module, processor)

def check_model(installed: InstalledModel) -> None:
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
    for w in installed.processors:
        current = getattr(w.module, "processor", None)
        if current is w.wrapper or any(current is s for s in installed.swap_wrappers.values()):
            continue
        if installed.wrap is not None and type(current).__name__ in installed.swapped:
            set_processor(w.module, installed.swap_wrapper(current))
            continue
        raise SequenceParallelConfigError(
            f"{type(model).__name__}: the attention processor of {w.name} was replaced after "
            f"enable_sequence_parallel (by {type(current).__name__}; "
            "fuse_qkv_projections(), set_attn_processor(), load_ip_adapter() and unload_ip_adapter() do this), "
            "so that attention would see only this rank's tokens. Call disable_sequence_parallel(), which keeps "
            "the new processors, then enable sequence parallelism again to wrap them.")

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

@contextlib.contextmanager
def _model_processors(handle: "SequenceParallelHandle"):
    """Puts the model's own processors back in place of ours for the duration, and ours back after
    it where a module still holds its own (a processor replaced meanwhile stays, and the next forward
    refuses it: :func:`check_model`)."""
    swapped = []
    for installed in handle._models:
        for w in installed.processors:
            if getattr(w.module, "processor", None) is w.wrapper:
                set_processor(w.module, w.original)
                swapped.append((w.module, w.original, w.wrapper))
    try:
        yield
    finally:
        for module, original, wrapper in swapped:
            if getattr(module, "processor", None) is original:
                set_processor(module, wrapper)

#: Pipeline methods that read the transformer's processors by class (``set_ip_adapter_scale`` selects
#: IP-Adapter processors; ``load_ip_adapter`` and ``unload_ip_adapter`` build new processors of the
#: classes they find): run with the model's own processors in place.
_PROCESSOR_METHODS = ("set_ip_adapter_scale", "load_ip_adapter", "unload_ip_adapter")

def _patch_processor_methods(pipe, handle: "SequenceParallelHandle") -> None:
    """Makes :data:`_PROCESSOR_METHODS` of ``pipe`` see the model's own processors
    (:func:`_model_processors`): SD3's ``set_ip_adapter_scale`` would otherwise skip our wrappers (it
    selects processors by class), and ``load_ip_adapter`` / ``unload_ip_adapter`` would try to
    construct one with no arguments. The processors they install replace ours, which the next forward
    refuses (:func:`check_model`) until sequence parallelism is enabled again."""
    for method in _PROCESSOR_METHODS:
        original = getattr(pipe, method, None)
        if original is None:
            continue

        def call(*args, _original=original, **kwargs):
            with _model_processors(handle):
                return _original(*args, **kwargs)

        handle.patch_attribute(pipe, method, functools.wraps(original)(call))
