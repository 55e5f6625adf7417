"""How the ranks of a launch are laid out: ``replicas x cfg x sp``.

``world_size = num_replicas * cfg_degree * sp_degree``:

* ``sp_degree`` ranks split one transformer forward along its tokens (sequence parallelism);
* ``cfg_degree`` (1 or 2) groups of them share one denoising step, one computing the conditional
  pass and one the unconditional (CFG parallelism, :mod:`diffusers_sp.cfg_parallel`);
* the remaining ranks form ``num_replicas`` independent replicas, each generating its own samples
  (different prompts or seeds: data parallelism over a prompt list).

The layout is validated here as a pure function of the arguments and the launch's world size, so an
invalid combination raises :class:`~diffusers_sp.validation.SequenceParallelConfigError` with the
same message on every rank before any collective.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import SequenceParallelConfigError


@dataclass(frozen=True)
class Layout:
    """A validated ``replicas x cfg x sp`` layout.

    Attributes:
        num_replicas: Independent replicas (>= 1).
        cfg_degree: 2 with CFG parallelism, else 1.
        sp_degree: Ranks per sequence-parallel group (>= 1).
        cfg_reason: Why ``cfg_parallel="auto"`` chose what it chose (``""`` when not auto).
    """

    num_replicas: int
    cfg_degree: int
    sp_degree: int
    cfg_reason: str = ""

    @property
    def world_size(self) -> int:
        return self.num_replicas * self.cfg_degree * self.sp_degree

    @property
    def trivial(self) -> bool:
        """One replica, no CFG parallelism: the sequence-parallel group is the whole launch."""
        return self.num_replicas == 1 and self.cfg_degree == 1


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def resolve_layout(name: str, world_size: int, *, cfg_parallel=False, sp_degree: int | None = None,
                   cfg_capable: bool = True, family: str | None = None, cfg_by_default: bool = True,
                   process_group=None) -> Layout:
    """Validates ``cfg_parallel`` / ``sp_degree`` against the world size and returns the layout.

    Args:
        name: Pipeline or model class name (for messages).
        world_size: Ranks of the launch.
        cfg_parallel: ``False`` (default), ``True`` or ``"auto"`` (see
            :func:`diffusers_sp.cfg_parallel.choose_cfg_parallel`).
        sp_degree: Ranks per sequence-parallel group; ``None``: every rank not used by CFG.
        cfg_capable: Whether the target can use CFG parallelism (a family with CFG).
        family: Family name, for the ``"auto"`` rule's messages.
        cfg_by_default: Whether the family's default calls use CFG (the ``"auto"`` rule).
        process_group: The ``process_group`` passed to ``enable_sequence_parallel`` (``None``: the launch).

    Raises:
        SequenceParallelConfigError: ``cfg_parallel`` not in (False, True, "auto"); ``sp_degree`` not a
            positive int; either used together with a ``process_group``; ``cfg_parallel=True`` with an
            odd number of ranks (or on a target without CFG); ``world_size`` not divisible by
            ``cfg_degree * sp_degree``. The message names values that would work.
    """
    if cfg_parallel not in (False, True, "auto"):
        raise SequenceParallelConfigError(
            f"{name}: cfg_parallel={cfg_parallel!r}; use False, True or 'auto'.")
    if sp_degree is not None and (isinstance(sp_degree, bool) or not isinstance(sp_degree, int) or sp_degree < 1):
        raise SequenceParallelConfigError(f"{name}: sp_degree={sp_degree!r}; use a positive int or None.")
    if process_group is not None and (cfg_parallel or sp_degree is not None):
        raise SequenceParallelConfigError(
            f"{name}: cfg_parallel / sp_degree build their groups from the whole launch; pass "
            f"process_group=None with them (or split the ranks yourself and pass one sequence-parallel "
            f"process_group without cfg_parallel / sp_degree).")
    reason = ""
    if cfg_parallel == "auto":
        from .cfg_parallel import choose_cfg_parallel

        use_cfg, reason = choose_cfg_parallel(family, world_size, sp_degree, cfg_capable, cfg_by_default)
        cfg_degree = 2 if use_cfg else 1
    elif cfg_parallel:
        if not cfg_capable:
            raise SequenceParallelConfigError(
                f"{name}: cfg_parallel=True is not available for this model family: how its pipelines run "
                f"classifier-free guidance (two transformer calls per step, or both passes in one batch) is not "
                f"declared for it; use cfg_parallel=False.")
        if world_size % 2:
            raise SequenceParallelConfigError(
                f"{name}: cfg_parallel=True needs an even number of ranks (one CFG group for the "
                f"conditional pass, one for the unconditional), got {world_size}. Launch "
                f"{' or '.join(str(w) for w in (world_size - 1, world_size + 1) if w >= 2)} ranks, or use "
                f"cfg_parallel=False.")
        cfg_degree = 2
    else:
        cfg_degree = 1
    if sp_degree is None:
        sp_degree = world_size // cfg_degree
    per_replica = cfg_degree * sp_degree
    if world_size % per_replica:
        ok = [d for d in _divisors(world_size // cfg_degree)] if world_size % cfg_degree == 0 else []
        raise SequenceParallelConfigError(
            f"{name}: world size {world_size} is not a multiple of cfg {cfg_degree} x sp_degree {sp_degree} "
            f"(world = replicas x cfg x sp). sp_degree values that work here: {ok or 'none'}.")
    return Layout(world_size // per_replica, cfg_degree, sp_degree, reason)


def split_for_replica(items: list, replica_index: int, num_replicas: int) -> list[tuple[int, object]]:
    """The ``(index, item)`` pairs replica ``replica_index`` handles: items ``i`` with ``i % num_replicas == replica_index``.

    Round-robin, so replicas differ by at most one item; every item is handled by exactly one replica.
    """
    return [(i, x) for i, x in enumerate(items) if i % num_replicas == replica_index]
