"""Checks a sequence-parallel mode against a pipeline's traits before any collective runs.

Every check here is a pure function of (mode, traits, world size, options): each rank computes the
same answer from the same inputs, so an error is raised identically on every rank and no rank is
left waiting in a collective. See DESIGN.md, "Errors".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .traits import PipelineTraits

#: Modes a user may ask for. "vsa" is reserved until video sparse attention lands.
KNOWN_MODES = ("auto", "ulysses", "kv_gather", "vsa")
#: Modes that run in this release.
IMPLEMENTED_MODES = ("ulysses", "kv_gather")


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
    so it needs H >= P. Heads that do not divide P still run exactly, with uneven head shards.
    """
    return num_heads >= world_size


def choose_auto_mode(traits: "PipelineTraits", world_size: int) -> str:
    """The mode ``mode="auto"`` resolves to.

    Rule: K/V-gather when the world size is at most 2 or the head count does not divide it,
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
        The resolved mode, ``"ulysses"`` or ``"kv_gather"``.

    Raises:
        SequenceParallelConfigError: unknown mode; ``"vsa"`` (not available yet); Ulysses with
            fewer heads than ranks. Explicit modes are never downgraded.
    """
    if not isinstance(mode, str) or mode not in KNOWN_MODES:
        raise SequenceParallelConfigError(
            f"{traits.name}: unknown sequence-parallel mode {mode!r}. "
            f"Choose one of {', '.join(repr(m) for m in KNOWN_MODES if m != 'vsa')}."
        )
    if world_size < 1:
        raise SequenceParallelConfigError(f"{traits.name}: world size must be >= 1, got {world_size}.")
    if mode == "vsa":
        raise SequenceParallelConfigError(
            f"{traits.name}: mode 'vsa' (video sparse attention) is not available in this version of "
            f"diffusers-sp. Modes that would work: 'ulysses', 'kv_gather', 'auto'."
        )
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
