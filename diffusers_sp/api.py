"""The public entry points: :func:`enable_sequence_parallel` (plan -> agree -> build groups ->
install) and :func:`disable_sequence_parallel`.

The steps live in their own modules: :mod:`diffusers_sp.planning` (checks and choices that need no
other rank), :mod:`diffusers_sp.agreement` (every rank the same, before any collective that depends on
it), :mod:`diffusers_sp.groups` (the replica / CFG / sequence-parallel groups),
:mod:`diffusers_sp.install` (hooks, processors, pipeline patches) and :mod:`diffusers_sp.handle`
(what was installed, and how to undo it).
"""

from __future__ import annotations

import logging

from .agreement import agreed_transport, check_same_on_all_ranks
from .errors import SequenceParallelConfigError
from .groups import SPGroup, build_parallel_groups, resolve_group
from .handle import HANDLE_ATTR, SequenceParallelHandle
from .install import install
from .pipelines import resolve_target
from .planning import EnableOptions, EnablePlan, plan_enable
from .processors.vsa import VSA_DEFAULTS
from .traits import PipelineTraits

logger = logging.getLogger("diffusers_sp")

__all__ = ["enable_sequence_parallel", "disable_sequence_parallel", "read_traits", "SequenceParallelHandle"]


def read_traits(target) -> PipelineTraits:
    """Reads the traits of a pipeline or transformer (see :mod:`diffusers_sp.traits`): every
    transformer a pipeline holds (:func:`diffusers_sp.pipelines.resolve_target`).

    Raises:
        SequenceParallelConfigError: the pipeline or model holds no transformer that diffusers-sp runs.
    """
    family, models = resolve_target(target)
    return PipelineTraits(name=type(target).__name__, family=family.name, is_video=family.is_video,
                          models=tuple(family.model_traits(m, a) for a, m in models))


def enable_sequence_parallel(target, mode: str = "auto", *, process_group=None, cfg_parallel: bool | str = False,
                             sp_degree: int | None = None, ulysses_degree: int | None = None,
                             parallel_vae: bool = False,
                             attention_kernel: str = "auto", sp_transport: str = "auto",
                             overlap_head_groups: int | str = "auto", overlap_query_projection: bool = True,
                             vsa_sparsity: float | None = None, vsa_tile_size: tuple[int, int, int] | None = None,
                             vsa_sp_mode: str | None = None, vsa_gate_weights=None,
                             shard_weights: bool = False) -> SequenceParallelHandle:
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
        shard_weights: ``False`` (every rank holds the whole pipeline) or ``True``: every transformer and
            text encoder is sharded with PyTorch's FSDP2 (``fully_shard``, one unit per block plus the
            root) over the ranks that make one output together, so each rank holds about ``1/N`` of
            those weights between forwards and gathers one or two blocks at a time (see
            :mod:`diffusers_sp.weights`; ``handle.local_weight_bytes()`` reports what a rank holds).
            Outputs stay exact. ``disable()`` gives back ordinary, whole modules. LoRA weights load
            before or after enabling (their matrices stay whole on every rank).

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
            sequence parallelism already enabled on the target, an unusable process group, or
            ``shard_weights`` other than True / False or with what FSDP2 cannot run (Diffusers'
            group offloading or layerwise casting, Accelerate's CPU offload, quantized weights). Raised
            before any collective, with the same message on every rank (ranks launched with different
            settings all get the same error).
    """
    given_vsa = {"vsa_sparsity": vsa_sparsity, "vsa_tile_size": vsa_tile_size, "vsa_sp_mode": vsa_sp_mode,
                 "vsa_gate_weights": vsa_gate_weights}
    opts = EnableOptions(attention_kernel=attention_kernel, sp_transport=sp_transport, shard_weights=shard_weights,
                         overlap_head_groups=overlap_head_groups, overlap_query_projection=overlap_query_projection,
                         **{k: VSA_DEFAULTS[k] if v is None else v for k, v in given_vsa.items()})
    # Every check that needs no other rank runs first. A rank whose settings are refused takes part in
    # the agreement below with its refusal, so that ranks launched with different settings (one rank's
    # refused, the others' valid) all raise the same error instead of waiting for the refused one.
    try:
        plan = plan_enable(target, mode, process_group=process_group, cfg_parallel=cfg_parallel,
                           sp_degree=sp_degree, ulysses_degree=ulysses_degree, parallel_vae=parallel_vae,
                           opts=opts, given_vsa=given_vsa)
        agree = dict(plan.agree, refused=None)
    except SequenceParallelConfigError as exc:
        plan, agree = exc, {"refused": str(exc)}
    launch = resolve_group(process_group)
    check_same_on_all_ranks(launch, agree)
    if isinstance(plan, SequenceParallelConfigError):
        raise plan
    if plan.gate_error is not None:
        raise plan.gate_error
    kv_first = plan.family.self_attention_kv_first if opts.overlap_query_projection else None
    handle = _make_handle(target, plan, opts, launch, kv_first=kv_first is not None)
    try:
        install(handle, target, plan, opts=opts, kv_first=kv_first, parallel_vae=parallel_vae,
                replica_group=handle.groups.replica if handle.groups is not None else handle.group,
                process_group=process_group)
    except BaseException:
        handle.disable()  # nothing half-installed stays behind
        raise
    _log_enabled(handle, plan)
    return handle


def _make_handle(target, plan: EnablePlan, opts: EnableOptions, launch: SPGroup, *,
                 kv_first: bool) -> SequenceParallelHandle:
    """The handle of ``plan``: the replica / CFG / sequence-parallel groups built (a collective over the
    launch, entered alike by every rank after the agreement) and the transport agreed in the group
    (``kv_first``: whether the family's K/V-first self-attention runs)."""
    layout, hybrid = plan.layout, plan.sp_mode == "hybrid"
    if layout.trivial and not hybrid:
        group, pgroups = launch, None
    else:
        pgroups = build_parallel_groups(layout.num_replicas, layout.cfg_degree, layout.sp_degree,
                                        plan.ulysses if hybrid else None)
        group = pgroups.sp
    transport = agreed_transport(opts.sp_transport, plan.sp_mode, group, plan.traits, kv_first=kv_first)
    handle = SequenceParallelHandle(mode=plan.resolved, rank=group.rank, world_size=group.world_size,
                                    traits=plan.traits, group=group, target=target, sp_mode=plan.sp_mode,
                                    transport=transport if transport == "copy_engine" else group.backend or "none",
                                    ulysses_degree=plan.ulysses, kv_gather_degree=group.world_size // plan.ulysses,
                                    requested_kernel=opts.attention_kernel,
                                    vsa_tile=None if plan.vsa is None else tuple(plan.vsa.tile))
    if pgroups is not None:
        handle.groups = pgroups
        handle.replica_index, handle.num_replicas = pgroups.replica_index, pgroups.num_replicas
        handle.cfg_rank, handle.cfg_degree = pgroups.cfg_rank, pgroups.cfg_degree
    return handle


def _log_enabled(handle: SequenceParallelHandle, plan: EnablePlan) -> None:
    """One log line, from the output rank of the first replica, of what runs."""
    if not (handle.is_output_rank and handle.replica_index == 0):
        return
    layout, ulysses = plan.layout, plan.ulysses
    sp = f"sp {layout.sp_degree}" + (f" (ulysses {ulysses} x kv_gather {layout.sp_degree // ulysses})"
                                      if plan.sp_mode == "hybrid" else "")
    sizes = (sp if layout.trivial else
             f"{layout.num_replicas} replica(s) x cfg {layout.cfg_degree} x {sp} = "
             f"{layout.num_replicas * layout.cfg_degree * layout.sp_degree} ranks")
    logger.info("diffusers-sp: %s with %s, %s, transfers by %s, attention kernel %s%s", plan.traits.name,
                plan.resolved if plan.vsa is None else
                f"vsa (under {plan.vsa.sp_mode}, fine stage {handle.vsa_backend()})", sizes, handle.transport,
                handle.attention_kernel, f" (cfg_parallel='auto': {layout.cfg_reason})" if layout.cfg_reason else "")


def disable_sequence_parallel(target) -> None:
    """Undoes :func:`enable_sequence_parallel` on ``target`` (a pipeline or model).

    Restores every original processor and removes every hook; the model then gives exactly its
    original outputs. Does nothing if sequence parallelism is not enabled on ``target``.
    """
    handle = getattr(target, HANDLE_ATTR, None)
    if handle is not None:
        handle.disable()
