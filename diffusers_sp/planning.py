"""Planning :func:`~diffusers_sp.enable_sequence_parallel`: every check and choice that needs no other
rank (options, mode, layout, VSA settings, transport), made alike on every rank from the same inputs.
Nothing here runs a collective; :mod:`diffusers_sp.agreement` then compares the outcome across ranks.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch.distributed as dist

from . import caches
from .copy_engine import TRANSPORTS, copy_engine_unavailable_reason, head_group_sizes
from .errors import SequenceParallelConfigError
from .groups import SPGroup, world_size_for
from .handle import HANDLE_ATTR
from .kernels.sdpa import KERNELS
from .pipelines import FAMILIES, is_modular, resolve_target
from .processors.vsa import load_gate_weights
from .traits import PipelineTraits
from .validation import resolve_mode, validate_vsa
from .sharded_load import has_empty_parameters
from .weights import check_shard_weights, check_shardable, components_to_shard


@dataclass(frozen=True)
class EnableOptions:
    """The options of :func:`~diffusers_sp.enable_sequence_parallel` that go to the processors and
    transports, after ``None`` defaults were filled in (see its docstring for each)."""

    attention_kernel: str = "auto"
    sp_transport: str = "auto"
    overlap_head_groups: int | str = "auto"
    overlap_query_projection: bool = True
    vsa_sparsity: float = 0.9
    vsa_tile_size: tuple = (4, 4, 4)
    vsa_sp_mode: str = "auto"
    vsa_gate_weights: object = None
    shard_weights: bool = False


@dataclass
class VSAPlan:
    """``mode="vsa"`` as it will run: checked options and the gate weights read.

    Attributes:
        sparsity: Fraction of key tiles skipped, in ``[0, 1)``.
        tile: The tile ``(tt, th, tw)`` in latent patches.
        sp_mode: The communication underneath (``"ulysses"``, ``"kv_gather"`` or ``"hybrid"``).
        ulysses_degree: Its Ulysses degree.
        gates: One list of per-layer gate weights (or ``None``: zero gate) per transformer, or
            ``None`` when reading them failed (the error is shared across ranks first).
    """

    sparsity: float
    tile: tuple[int, int, int]
    sp_mode: str
    ulysses_degree: int
    gates: list | None


@dataclass
class EnablePlan:
    """What :func:`~diffusers_sp.enable_sequence_parallel` settles on one rank before any collective.

    Attributes:
        family: The :class:`~diffusers_sp.pipelines.spec.FamilySpec` of the target's transformers.
        models: ``(attribute, model)`` pairs of the transformers to parallelize.
        traits: The pipeline's traits.
        layout: The ``replicas x cfg x sp`` :class:`~diffusers_sp.replicas.Layout`.
        resolved: The mode that runs (``"auto"`` resolved).
        ulysses: The Ulysses degree of the sequence-parallel group.
        vsa: ``None``, or the :class:`VSAPlan` of ``mode="vsa"``.
        sp_mode: The communication that runs (``resolved``, or VSA's mode underneath).
        gate_error: The error of reading ``vsa_gate_weights`` (raised after the agreement), or ``None``.
        agree: What every rank must agree on (:func:`~diffusers_sp.agreement.check_same_on_all_ranks`).
    """

    family: object
    models: list
    traits: PipelineTraits
    layout: object
    resolved: str
    ulysses: int
    vsa: VSAPlan | None
    sp_mode: str
    gate_error: Exception | None
    agree: dict

def plan_enable(target, mode: str, *, process_group, cfg_parallel, sp_degree, ulysses_degree, parallel_vae,
                opts: EnableOptions, given_vsa: dict) -> EnablePlan:
    """The checks and choices of :func:`~diffusers_sp.enable_sequence_parallel` that need no other rank
    (pure apart from reading ``vsa_gate_weights``).

    Args:
        given_vsa: The ``vsa_*`` options as the user passed them (``None``: not given), to refuse
            them with another mode.

    Raises:
        SequenceParallelConfigError: for a setting it refuses (see ``enable_sequence_parallel``).
    """
    check_options(opts, parallel_vae)
    family, models = resolve_target(target)
    traits = PipelineTraits(name=type(target).__name__, family=family.name, is_video=family.is_video,
                            models=tuple(family.model_traits(m, a) for a, m in models))
    if getattr(target, HANDLE_ATTR, None) is not None or any(getattr(m, HANDLE_ATTR, None) for _, m in models):
        raise SequenceParallelConfigError(
            f"{traits.name}: sequence parallelism is already enabled; call disable_sequence_parallel() first.")
    layout = _resolve_layout(target, traits, family, process_group, cfg_parallel, sp_degree)
    host_size = _host_size(process_group)
    resolved, ulysses = resolve_mode(mode, traits, layout.sp_degree, ulysses_degree=ulysses_degree,
                                     host_size=host_size)
    # The hybrid mode builds its groups from the whole launch and moves tensors with the collectives, so
    # where the user passed a process_group or asked for the copy engines, "auto" falls back to
    # K/V-gather (no constraint on heads) instead of choosing a mode that is then refused.
    hybrid_blocked = process_group is not None or opts.sp_transport == "copy_engine"
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
    if vsa and vsa.sp_mode == "hybrid" and opts.vsa_sp_mode == "auto" and ulysses_degree is None \
            and hybrid_blocked:
        vsa.sp_mode, vsa.ulysses_degree = "kv_gather", 1
    sp_mode = vsa.sp_mode if vsa else resolved
    if vsa:
        ulysses = vsa.ulysses_degree
    if sp_mode == "hybrid":
        _check_hybrid(traits, opts, layout, process_group)
    _check_components(target, traits, models, opts, parallel_vae)

    # What every rank of the launch must agree on, checked over the whole launch (or the passed
    # process_group) before the replica/CFG/SP sub-groups are built: building them is itself a
    # collective over the launch, which ranks with different layouts would enter with different
    # arguments and never leave.
    agree = {
        "model": traits.fingerprint(), "mode": resolved, "attention_kernel": opts.attention_kernel,
        "sp_transport": opts.sp_transport, "overlap_head_groups": opts.overlap_head_groups,
        "overlap_query_projection": opts.overlap_query_projection,
        "vsa": None if vsa is None else (vsa.sparsity, vsa.tile, vsa.sp_mode, opts.vsa_gate_weights is not None),
        "replicas": layout.num_replicas, "cfg_degree": layout.cfg_degree, "sp_degree": layout.sp_degree,
        "ulysses_degree": ulysses,
        "parallel_vae": bool(parallel_vae), "shard_weights": opts.shard_weights,
        "hooks (caches, offloading, ...)": [caches.describe(model.modules()) for _, model in models],
        "vsa_gate_weights (read)": "ok" if gate_error is None else f"failed: {gate_error}"}
    return EnablePlan(family=family, models=models, traits=traits, layout=layout, resolved=resolved, ulysses=ulysses,
                 vsa=vsa, sp_mode=sp_mode, gate_error=gate_error, agree=agree)

def _check_components(target, traits, models, opts: EnableOptions, parallel_vae: bool) -> None:
    """The refusals of the parallel VAE and of weight sharding (or of its absence for a pipeline loaded
    with empty weights), before any collective."""
    if parallel_vae:
        from .vae import check_parallel_vae

        check_parallel_vae(target, models)
    if opts.shard_weights:
        check_shardable(traits.name, components_to_shard(target, models))
    elif any(has_empty_parameters(m) for _, m in components_to_shard(target, models)):
        raise SequenceParallelConfigError(
            f"{traits.name} was loaded with empty weights for sharding (load_pipeline_for_sharding): enable it "
            f"with shard_weights=True, which reads each rank's shards, or load it with from_pretrained.")


def _check_hybrid(traits, opts: EnableOptions, layout, process_group) -> None:
    """The refusals of a hybrid sequence-parallel mode (also under VSA), before any collective."""
    if opts.sp_transport == "copy_engine" and layout.sp_degree > 1:
        raise hybrid_copy_engine_refusal(traits)
    if process_group is not None:
        raise SequenceParallelConfigError(
            f"{traits.name}: mode='hybrid' builds its Ulysses and K/V-gather groups from the whole launch; pass "
            f"process_group=None with it (sp_degree makes smaller sequence-parallel groups), or use "
            f"mode='ulysses' / 'kv_gather' over the process_group.")


def check_options(opts: EnableOptions, parallel_vae) -> None:
    """The type and value checks of :func:`~diffusers_sp.enable_sequence_parallel`'s options (pure: every rank alike)."""
    if opts.attention_kernel not in KERNELS:
        raise SequenceParallelConfigError(
            f"attention_kernel={opts.attention_kernel!r} is not one of {KERNELS}.")
    if opts.sp_transport not in TRANSPORTS:
        raise SequenceParallelConfigError(f"sp_transport={opts.sp_transport!r} is not one of {TRANSPORTS}.")
    check_shard_weights(opts.shard_weights, "enable_sequence_parallel")
    if not isinstance(parallel_vae, bool):
        raise SequenceParallelConfigError(f"parallel_vae must be True or False, got {parallel_vae!r}.")
    if not isinstance(opts.overlap_query_projection, bool):
        raise SequenceParallelConfigError(
            f"overlap_query_projection must be True or False, got {opts.overlap_query_projection!r}.")
    try:
        head_group_sizes(1, opts.overlap_head_groups)  # the copy engines' own check of the option
    except ValueError as exc:
        raise SequenceParallelConfigError(f"{exc}.") from None

def _resolve_layout(target, traits, family, process_group, cfg_parallel, sp_degree):
    """The ``replicas x cfg x sp`` :class:`~diffusers_sp.replicas.Layout` (pure, before any collective);
    a pipeline with perturbed-attention guidance keeps CFG parallelism off (see :func:`_perturbed_guidance`)."""
    from .replicas import resolve_layout

    pag = _perturbed_guidance(target) or _modular_guidance(target)
    if pag and cfg_parallel is True:
        raise SequenceParallelConfigError(
            f"{traits.name}: cfg_parallel=True cannot split this pipeline's guidance: {pag}. Use "
            f"cfg_parallel=False (sequence parallelism runs this guidance exactly).")
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
                 host_size=None) -> tuple[VSAPlan, SequenceParallelConfigError | None]:
    """``mode="vsa"``'s options checked and its gate weights read: ``(vsa settings, the reading's error)``.

    Every rank reads the files before any collective. A file that only some ranks can read (a path
    missing on one host) must not fail on those alone: the outcome is compared over the launch with the
    other options, and raised after that on every rank."""
    sparsity, tile, sp_mode, ulysses = validate_vsa(
        traits, layout.sp_degree, sparsity=opts.vsa_sparsity, tile_size=opts.vsa_tile_size,
        sp_mode=opts.vsa_sp_mode, has_latent_grid=family.latent_grid is not None,
        family_refusal=family.vsa_refusal, ulysses_degree=ulysses_degree, host_size=host_size,
        grid_families=tuple(f.name for f in FAMILIES if f.latent_grid is not None))
    paths = _gate_paths(opts.vsa_gate_weights, traits)
    gate_error = None
    try:
        gates = [None if path is None else load_gate_weights(path, mt.num_attention_layers, mt.num_heads * mt.head_dim)
                 for path, mt in zip(paths, traits.models)]
    except Exception as exc:  # noqa: BLE001 - any reader error (missing file, bad safetensors) is shared
        gates, gate_error = None, exc if isinstance(exc, SequenceParallelConfigError) else \
            SequenceParallelConfigError(f"vsa_gate_weights: {type(exc).__name__}: {exc}")
    return VSAPlan(sparsity=sparsity, tile=tile, sp_mode=sp_mode, ulysses_degree=ulysses, gates=gates), gate_error

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

def _modular_guidance(target) -> str:
    """Why CFG parallelism cannot split a modular pipeline's guidance (``""`` for any other target):
    CFG parallelism pairs a step's two transformer calls by the names a classic pipeline gives them
    through ``cache_context("cond")`` / ``("uncond")``, and Diffusers' modular denoise blocks (0.42)
    make their guider's calls without them."""
    if not is_modular(target):
        return ""
    return ("a modular pipeline's guider makes the conditional and unconditional transformer calls without "
            "the cache_context names by which CFG parallelism pairs them")


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

def hybrid_copy_engine_refusal(traits: PipelineTraits) -> SequenceParallelConfigError:
    return SequenceParallelConfigError(
        f"{traits.name}: sp_transport='copy_engine' does not apply to mode='hybrid', whose two levels of groups "
        "use the collectives (NCCL). Use sp_transport='auto' or 'nccl', or mode='ulysses' / 'kv_gather' on one "
        "host with sp_transport='copy_engine'.")

def resolve_transport(requested: str, mode: str, group: SPGroup, traits: PipelineTraits, *,
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
        raise hybrid_copy_engine_refusal(traits)
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
