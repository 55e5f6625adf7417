"""Checks a sequence-parallel mode against a pipeline's traits before any collective runs.

Every check here is a pure function of (mode, traits, world size, options): each rank computes the
same answer from the same inputs, so an error is raised identically on every rank and no rank is
left waiting in a collective. See DESIGN.md, "Errors".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .traits import PipelineTraits

#: Modes a user may ask for.
KNOWN_MODES = ("auto", "ulysses", "kv_gather", "vsa")
#: Sequence-parallel communication modes under VSA (``vsa_sp_mode``).
VSA_SP_MODES = ("auto", "ulysses", "kv_gather")


class SequenceParallelConfigError(ValueError):
    """A mode, pipeline, model or option combination that cannot run exactly.

    Raised by :func:`diffusers_sp.enable_sequence_parallel` before any collective, with the same
    message on every rank, and by the processors during a forward when the model produces a shape
    the sharding plan did not expect. The message names the pipeline or model, the conflicting
    trait, and the modes (or settings) that would work.
    """


def ulysses_head_split_ok(num_heads: int, world_size: int) -> bool:
    """Whether Ulysses can give every rank at least one attention head.

    Ulysses splits the H heads over P ranks (balanced: the first H mod P ranks get one head more),
    so it needs H >= P. A head count not divisible by P still runs exactly, with uneven head shards.
    """
    return num_heads >= world_size


def choose_auto_mode(traits: "PipelineTraits", world_size: int) -> str:
    """The mode ``mode="auto"`` resolves to.

    Rule: K/V-gather when the world size is at most 2 or the head count is not divisible by it,
    Ulysses otherwise.

    Why: per layer and rank, Ulysses moves about 4·B·S·H·D·(P−1)/P² elements in two all-to-alls
    (Q, K, V in; O out) and K/V-gather about 2·B·S·H·D·(P−1)/P in one all-gather (K, V). At P = 2 the
    volumes are equal, but K/V-gather needs one collective instead of two and leaves Q and O where
    they are, so it wins. Above 2 ranks Ulysses moves less (its volume falls as 1/P) as long as the
    heads split evenly; with uneven heads the busiest rank does ceil(H/P)/(H/P) of the average
    attention work, so K/V-gather, which splits work by tokens, stays balanced instead.
    """
    heads = min(m.num_heads for m in traits.models)
    if world_size <= 2 or any(m.num_heads % world_size for m in traits.models):
        return "kv_gather"
    if heads < world_size:  # pragma: no cover - implied by the divisibility test above
        return "kv_gather"
    return "ulysses"


def validate_mode(mode: str, traits: "PipelineTraits", world_size: int) -> str:
    """Validates ``mode`` for ``traits`` at ``world_size`` and returns the mode that will run.

    Args:
        mode: One of :data:`KNOWN_MODES`.
        traits: The pipeline's (or model's) traits from :mod:`diffusers_sp.traits`.
        world_size: Number of ranks in the sequence-parallel group (>= 1).

    Returns:
        The resolved mode: ``"ulysses"``, ``"kv_gather"`` or ``"vsa"``.

    Raises:
        SequenceParallelConfigError: unknown mode; Ulysses with fewer heads than ranks. Explicit
            modes are never downgraded. (``"vsa"`` is checked further by :func:`validate_vsa`.)
    """
    if not isinstance(mode, str) or mode not in KNOWN_MODES:
        raise SequenceParallelConfigError(
            f"{traits.name}: unknown sequence-parallel mode {mode!r}. "
            f"Choose one of {', '.join(repr(m) for m in KNOWN_MODES)}."
        )
    if world_size < 1:
        raise SequenceParallelConfigError(f"{traits.name}: world size must be >= 1, got {world_size}.")
    if mode == "vsa":
        return "vsa"
    if mode == "auto":
        return choose_auto_mode(traits, world_size)
    if mode == "ulysses":
        for model in traits.models:
            if not ulysses_head_split_ok(model.num_heads, world_size):
                raise SequenceParallelConfigError(
                    f"{traits.name}: mode 'ulysses' splits attention heads across ranks, but "
                    f"{model.name} has {model.num_heads} heads for world size {world_size} "
                    f"(Ulysses needs at least one head per rank). Use mode='kv_gather' (no constraint "
                    f"on heads) or mode='auto', or run on at most {model.num_heads} ranks."
                )
    return mode


def validate_vsa(traits: "PipelineTraits", world_size: int, *, sparsity, tile_size, sp_mode: str,
                 has_latent_grid: bool, family_refusal: str = "") -> tuple[float, tuple[int, int, int], str]:
    """Validates the options of ``mode="vsa"`` and resolves its communication mode.

    Args:
        traits: The pipeline's traits.
        world_size: Ranks in the sequence-parallel group.
        sparsity: ``vsa_sparsity``, fraction of key tiles skipped, in ``[0, 1)``.
        tile_size: ``vsa_tile_size``, three positive ints (frames, height, width in latent patches).
        sp_mode: ``vsa_sp_mode``: ``"auto"``, ``"ulysses"`` or ``"kv_gather"``.
        has_latent_grid: Whether the family can read the latent grid of a forward call.
        family_refusal: The family's own reason why VSA cannot run on it (``""``: none).

    Returns:
        ``(sparsity, tile_size, resolved sp_mode)``.

    Raises:
        SequenceParallelConfigError: an image pipeline; a family whose latent grid cannot be read or
            that gives a reason of its own; text tokens inside self-attention (joint attention); a bad
            sparsity, tile size or ``vsa_sp_mode``; Ulysses underneath with fewer heads than ranks.
    """
    dense = "Modes that would work: 'ulysses', 'kv_gather', 'auto' (dense attention)."
    if not traits.is_video:
        raise SequenceParallelConfigError(
            f"{traits.name}: mode 'vsa' (video sparse attention) needs a video pipeline; this is an image "
            f"pipeline. {dense}")
    joint = [m.name for m in traits.models if m.joint_text]
    if joint:
        raise SequenceParallelConfigError(
            f"{traits.name}: mode 'vsa' is not supported with text tokens inside self-attention (joint "
            f"attention in {joint[0]}); VSA tiles only video tokens. {dense}")
    if family_refusal:
        raise SequenceParallelConfigError(f"{traits.name}: mode 'vsa' cannot run: {family_refusal}. {dense}")
    if not has_latent_grid:
        from .pipelines import FAMILIES  # here: the registry imports this module

        readable = ", ".join(f.name for f in FAMILIES if f.latent_grid is not None)
        raise SequenceParallelConfigError(
            f"{traits.name}: mode 'vsa' needs the latent grid (frames, height, width) of each forward, which "
            f"diffusers-sp cannot read for this family yet (VSA runs on the families whose grid it reads: "
            f"{readable}). {dense}")
    try:
        sparsity = float(sparsity)
    except (TypeError, ValueError):
        sparsity = float("nan")
    if not 0.0 <= sparsity < 1.0:
        raise SequenceParallelConfigError(
            f"{traits.name}: vsa_sparsity must be in [0, 1) (the fraction of key tiles skipped), got {sparsity}.")
    try:
        tile = tuple(int(t) for t in tile_size)
    except (TypeError, ValueError):
        tile = ()
    if len(tile) != 3 or min(tile) < 1 or tuple(tile_size) != tile:
        raise SequenceParallelConfigError(
            f"{traits.name}: vsa_tile_size must be three positive ints (frames, height, width in latent "
            f"patches, e.g. (4, 4, 4)), got {tile_size!r}.")
    if sp_mode not in VSA_SP_MODES:
        raise SequenceParallelConfigError(
            f"{traits.name}: vsa_sp_mode must be one of {VSA_SP_MODES}, got {sp_mode!r}.")
    if sp_mode == "auto":
        sp_mode = choose_auto_mode(traits, world_size)
    elif sp_mode == "ulysses":
        validate_mode("ulysses", traits, world_size)
    return sparsity, tile, sp_mode
