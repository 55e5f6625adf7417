"""Agreement across ranks: every rank must have made the same choices before a collective that
depends on them. One all-gather of a small fingerprint; a disagreement or a refusal on any rank is
raised on every rank alike, so no rank is left waiting."""

from __future__ import annotations

import torch.distributed as dist

from . import planning
from .errors import SequenceParallelConfigError
from .groups import SPGroup


def check_same_on_all_ranks(group: SPGroup, fingerprint: dict) -> None:
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


def agreed_transport(requested: str, mode: str, group: SPGroup, traits, *, kv_first: bool) -> str:
    """:func:`~diffusers_sp.planning.resolve_transport`, its verdict or refusal shared within the SP group: it also depends on
    each rank's environment (launcher variables, peer access), so no rank may raise alone."""
    try:
        transport, refusal = planning.resolve_transport(requested, mode, group, traits, kv_first=kv_first), None
    except SequenceParallelConfigError as exc:
        transport, refusal = None, str(exc)
    check_same_on_all_ranks(group, {"sp_transport (resolved)": transport if refusal is None else f"refused: {refusal}"})
    if refusal is not None:
        raise SequenceParallelConfigError(refusal)
    return transport
