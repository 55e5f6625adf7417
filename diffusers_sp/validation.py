"""Checks a sequence-parallel mode against a pipeline's traits before any collective runs.

Every check here is a pure function of (mode, traits, world size, options): each rank computes the
same answer from the same inputs, so an error is raised identically on every rank and no rank is
left waiting in a collective. See DESIGN.md, "Errors".
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .errors import SequenceParallelConfigError

if TYPE_CHECKING:  # pragma: no cover
    from .traits import PipelineTraits

__all__ = ["SequenceParallelConfigError"]  # re-exported: its home is diffusers_sp.errors

#: Modes a user may ask for.
KNOWN_MODES = ("auto", "ulysses", "kv_gather", "hybrid", "vsa")
#: Sequence-parallel communication modes under VSA (``vsa_sp_mode``).
VSA_SP_MODES = ("auto", "ulysses", "kv_gather", "hybrid")


def ulysses_head_split_ok(num_heads: int, world_size: int) -> bool:
    """Whether Ulysses can give every rank at least one attention head.

    Ulysses splits the H heads over P ranks (balanced: the first H mod P ranks get one head more),
    so it needs H >= P. A head count not divisible by P still runs exactly, with uneven head shards.
    """
    return num_heads >= world_size


def one_host(world_size: int, host_size: int | None) -> bool:
    """Whether every sequence-parallel group of ``world_size`` ranks lies inside one host.

    Launchers number ranks host by host (``torchrun`` and ``accelerate launch``: global rank =
    node rank x ranks per node + local rank), and the sequence-parallel groups are blocks of
    consecutive ranks starting at multiples of their size (:mod:`diffusers_sp.replicas`), so each
    of them stays on one host exactly when the host size is a multiple of the group size.

    Args:
        world_size: Ranks in the sequence-parallel group.
        host_size: Ranks per host (``LOCAL_WORLD_SIZE``); ``None``: unknown, taken as one host.
    """
    return host_size is None or host_size % world_size == 0


def _heads(traits: "PipelineTraits") -> tuple[int, int]:
    """``(gcd, min)`` of the head counts of every model in ``traits``."""
    counts = [m.num_heads for m in traits.models]
    return math.gcd(*counts), min(counts)


def default_ulysses_degree(traits: "PipelineTraits", world_size: int, host_size: int | None = None) -> int:
    """The Ulysses degree U of ``mode="hybrid"`` when ``ulysses_degree`` is not given.

    ``U = gcd(H, P)`` inside one host and ``gcd(H, P, host size)`` across hosts (``H``: the gcd of
    the head counts of every model, ``P``: ``world_size``): the largest Ulysses group that divides
    the group (each inner group is U consecutive ranks), splits every model's heads evenly (no rank
    attends more heads than another) and, across hosts, stays inside one host (U divides the host
    size, so its all-to-alls never leave the host's NVLink domain). K/V-gather runs over the other
    ``P / U`` ranks. 1 means K/V-gather alone, ``P`` Ulysses alone.
    """
    heads, _ = _heads(traits)
    if one_host(world_size, host_size):
        return math.gcd(heads, world_size)
    return math.gcd(heads, world_size, host_size)


def choose_auto_mode(traits: "PipelineTraits", world_size: int, host_size: int | None = None) -> str:
    """The mode ``mode="auto"`` resolves to (its Ulysses degree: :func:`resolve_mode`).

    Rule, with P ranks in the sequence-parallel group, H heads and ``host_size`` ranks per host
    (``LOCAL_WORLD_SIZE``; ``None``: one host):

    * inside one host, K/V-gather when P is at most 2 or the head count is not divisible by P,
      Ulysses otherwise; but with fewer heads than ranks (H < P), hybrid with
      ``U = gcd(H, P)`` (:func:`default_ulysses_degree`) when that is above 1;
    * across hosts, hybrid: Ulysses inside each host over ``U = gcd(H, P, host_size)`` ranks,
      K/V-gather across the hosts over ``P / U``; K/V-gather alone when U is 1.

    Why: per layer and rank, Ulysses moves about 4·B·S·H·D·(P−1)/P² elements in two all-to-alls
    (Q, K, V in; O out) and K/V-gather about 2·B·S·H·D·(P−1)/P in one all-gather (K, V). At P = 2 the
    volumes are equal, but K/V-gather needs one collective instead of two and leaves Q and O where
    they are, so it wins. Above 2 ranks Ulysses moves less (its volume falls as 1/P) as long as the
    heads split evenly; with uneven heads the busiest rank does ceil(H/P)/(H/P) of the average
    attention work, so K/V-gather, which splits work by tokens, stays balanced instead. Ulysses cannot
    run with fewer heads than ranks; hybrid (USP, arXiv 2405.07719) U x R moves
    4·B·S·H·D·(U−1)/(U·P) + 2·B·S·H·D·(R−1)/(R·U), less than K/V-gather alone for every U > 1 (2 heads
    on 4 ranks: 1.0 against 1.5 B·S·H·D). Across hosts, all-to-alls are at their best inside one
    NVLink domain and need every rank of the group at every step, while K/V-gather's all-gather
    over the slower inter-host links moves only K and V of the rank's heads (1/U of them).
    """
    if world_size <= 1:
        return "kv_gather"
    heads, fewest = _heads(traits)
    if not one_host(world_size, host_size) or fewest < world_size:
        u = default_ulysses_degree(traits, world_size, host_size)
        return "kv_gather" if u == 1 else "ulysses" if u == world_size else "hybrid"
    if world_size <= 2 or any(m.num_heads % world_size for m in traits.models):
        return "kv_gather"
    return "ulysses"


def _degree_error(traits, world_size: int, ulysses_degree, why: str) -> "SequenceParallelConfigError":
    _, fewest = _heads(traits)
    ok = [d for d in range(1, world_size + 1) if world_size % d == 0 and d <= fewest]
    return SequenceParallelConfigError(
        f"{traits.name}: ulysses_degree={ulysses_degree!r} {why}. The sequence-parallel group of {world_size} "
        f"rank(s) factors into ulysses_degree x kv_gather_degree, with at least one head per rank of a Ulysses "
        f"group ({fewest} heads here): ulysses_degree values that work here: {ok}.")


def check_ulysses_degree(traits: "PipelineTraits", world_size: int, ulysses_degree) -> int:
    """Checks an explicit ``ulysses_degree`` against the group size and the head counts; returns it.

    Raises:
        SequenceParallelConfigError: not a positive int, not a divisor of ``world_size``, or more than
            the fewest heads of any model; the message lists the values that work.
    """
    if isinstance(ulysses_degree, bool) or not isinstance(ulysses_degree, int) or ulysses_degree < 1:
        raise _degree_error(traits, world_size, ulysses_degree, "is not a positive int")
    if world_size % ulysses_degree:
        raise _degree_error(traits, world_size, ulysses_degree, f"does not divide the {world_size} ranks")
    _, fewest = _heads(traits)
    if ulysses_degree > fewest:
        name = min(traits.models, key=lambda m: m.num_heads).name
        raise _degree_error(traits, world_size, ulysses_degree,
                            f"would leave some of its ranks without a head ({name} has {fewest} heads)")
    return ulysses_degree


def resolve_mode(mode: str, traits: "PipelineTraits", world_size: int, *, ulysses_degree: int | None = None,
                 host_size: int | None = None, option: str = "mode") -> tuple[str, int]:
    """Validates ``mode`` (and ``ulysses_degree``) and returns ``(mode that runs, Ulysses degree U)``.

    The sequence-parallel group of P ranks factors into ``U x R`` (``R = P / U``): ``"ulysses"`` is
    ``P x 1``, ``"kv_gather"`` ``1 x P``, ``"hybrid"`` any U (Ulysses inside groups of U consecutive
    ranks, K/V-gather across them; :mod:`diffusers_sp.processors.hybrid`). For ``"vsa"`` the degree
    is resolved with its ``vsa_sp_mode`` (:func:`validate_vsa`) and 1 is returned here.

    Args:
        mode: One of :data:`KNOWN_MODES`.
        traits: The pipeline's (or model's) traits.
        world_size: Ranks in the sequence-parallel group (>= 1).
        ulysses_degree: ``None`` (``"hybrid"``: :func:`default_ulysses_degree`; ``"auto"``: its rule,
            :func:`choose_auto_mode`) or U. An explicit U is honoured by ``"auto"`` (the mode is then
            ``"ulysses"`` for U = P, ``"kv_gather"`` for U = 1, else ``"hybrid"``) and ``"hybrid"``;
            ``"ulysses"`` accepts only P, ``"kv_gather"`` only 1.
        host_size: Ranks per host (``LOCAL_WORLD_SIZE``); ``None``: one host.
        option: The option that gave ``mode``, for messages (``"vsa_sp_mode"`` under VSA).

    Raises:
        SequenceParallelConfigError: unknown mode; Ulysses with fewer heads than ranks; a
            ``ulysses_degree`` that does not divide ``world_size``, exceeds the fewest heads, or
            contradicts an explicit ``"ulysses"`` / ``"kv_gather"``. Explicit modes are never
            downgraded.
    """
    if not isinstance(mode, str) or mode not in KNOWN_MODES:
        raise SequenceParallelConfigError(
            f"{traits.name}: unknown sequence-parallel mode {mode!r}. "
            f"Choose one of {', '.join(repr(m) for m in KNOWN_MODES)}."
        )
    if world_size < 1:
        raise SequenceParallelConfigError(f"{traits.name}: world size must be >= 1, got {world_size}.")
    if ulysses_degree is not None:
        check_ulysses_degree(traits, world_size, ulysses_degree)
    if mode == "vsa":
        return "vsa", 1
    if mode == "auto":
        if ulysses_degree is not None:
            u = ulysses_degree
            return ("ulysses" if u == world_size and u > 1 else "kv_gather" if u == 1 else "hybrid"), u
        mode = choose_auto_mode(traits, world_size, host_size)
        if mode == "hybrid":
            return mode, default_ulysses_degree(traits, world_size, host_size)
    if mode == "hybrid":
        return mode, ulysses_degree if ulysses_degree is not None else default_ulysses_degree(
            traits, world_size, host_size)
    if mode == "ulysses":
        for model in traits.models:
            if not ulysses_head_split_ok(model.num_heads, world_size):
                raise SequenceParallelConfigError(
                    f"{traits.name}: mode 'ulysses' splits attention heads across ranks, but "
                    f"{model.name} has {model.num_heads} heads for world size {world_size} "
                    f"(Ulysses needs at least one head per rank). Use mode='kv_gather' (no constraint "
                    f"on heads), mode='hybrid' or mode='auto', or run on at most {model.num_heads} ranks."
                )
        if ulysses_degree not in (None, world_size):
            raise SequenceParallelConfigError(
                f"{traits.name}: {option}='ulysses' runs Ulysses over all {world_size} ranks, but "
                f"ulysses_degree={ulysses_degree}: pass {option}='hybrid' (or 'auto') with ulysses_degree="
                f"{ulysses_degree} for Ulysses inside groups of {ulysses_degree} ranks and K/V-gather across them.")
        return mode, world_size
    if ulysses_degree not in (None, 1):  # kv_gather
        raise SequenceParallelConfigError(
            f"{traits.name}: {option}='kv_gather' gathers K and V over all {world_size} ranks, but "
            f"ulysses_degree={ulysses_degree}: pass {option}='hybrid' (or 'auto') with ulysses_degree="
            f"{ulysses_degree} for Ulysses inside groups of {ulysses_degree} ranks and K/V-gather across them.")
    return mode, 1


def validate_mode(mode: str, traits: "PipelineTraits", world_size: int, *, ulysses_degree: int | None = None,
                  host_size: int | None = None) -> str:
    """Validates ``mode`` for ``traits`` at ``world_size`` and returns the mode that will run.

    Args:
        mode: One of :data:`KNOWN_MODES`.
        traits: The pipeline's (or model's) traits from :mod:`diffusers_sp.traits`.
        world_size: Number of ranks in the sequence-parallel group (>= 1).
        ulysses_degree, host_size: As in :func:`resolve_mode`.

    Returns:
        The resolved mode: ``"ulysses"``, ``"kv_gather"``, ``"hybrid"`` or ``"vsa"``
        (:func:`resolve_mode` also returns the Ulysses degree).

    Raises:
        SequenceParallelConfigError: as :func:`resolve_mode`. (``"vsa"`` is checked further by
            :func:`validate_vsa`.)
    """
    return resolve_mode(mode, traits, world_size, ulysses_degree=ulysses_degree, host_size=host_size)[0]


def validate_vsa(traits: "PipelineTraits", world_size: int, *, sparsity, tile_size, sp_mode: str,
                 has_latent_grid: bool, family_refusal: str = "", ulysses_degree: int | None = None,
                 host_size: int | None = None,
                 grid_families: tuple[str, ...] = ()) -> tuple[float, tuple[int, int, int], str, int]:
    """Validates the options of ``mode="vsa"`` and resolves its communication mode.

    Args:
        traits: The pipeline's traits.
        world_size: Ranks in the sequence-parallel group.
        sparsity: ``vsa_sparsity``, fraction of key tiles skipped, in ``[0, 1)``.
        tile_size: ``vsa_tile_size``, three positive ints (frames, height, width in latent patches).
        sp_mode: ``vsa_sp_mode``: ``"auto"``, ``"ulysses"``, ``"kv_gather"`` or ``"hybrid"``.
        has_latent_grid: Whether the family can read the latent grid of a forward call.
        family_refusal: The family's own reason why VSA cannot run on it (``""``: none).
        ulysses_degree, host_size: As in :func:`resolve_mode`, for the communication underneath.
        grid_families: Names of the families whose latent grid can be read (named in the error for a
            family that cannot; the caller passes them, so this module needs no family registry).

    Returns:
        ``(sparsity, tile_size, resolved sp_mode, its Ulysses degree)``.

    Raises:
        SequenceParallelConfigError: an image pipeline; a family whose latent grid cannot be read or
            that gives a reason of its own; text tokens inside self-attention (joint attention); a bad
            sparsity, tile size or ``vsa_sp_mode``; Ulysses underneath with fewer heads than ranks; a bad
            ``ulysses_degree`` (:func:`resolve_mode`).
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
        readable = ", ".join(grid_families)
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
    sp_mode, ulysses_degree = resolve_mode(sp_mode, traits, world_size, ulysses_degree=ulysses_degree,
                                           host_size=host_size, option="vsa_sp_mode")
    return sparsity, tile, sp_mode, ulysses_degree
