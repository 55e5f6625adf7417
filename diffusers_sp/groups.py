"""Process groups for sequence parallelism.

By default the run is launched and initialised by Accelerate: :class:`accelerate.PartialState`
reads the launcher's environment (``accelerate launch`` or ``torchrun``) and initialises
``torch.distributed`` with NCCL on CUDA and gloo on CPU. The sequence-parallel group is then the
whole world. A caller may pass its own ``torch.distributed`` process group instead.

Nothing here holds a process group object: an :class:`SPGroup` keeps the group's registered name
and looks the group up when it is used. A process group's worker threads (gloo's run loops, NCCL's
watchdog) stop only when its last reference is dropped; one that survives until the interpreter
exits may release a finished collective's tensors after Python has begun finalizing, and the
thread then aborts the process ("terminate called without an active exception"). With names only,
:func:`destroy_process_groups` drops the last references and joins those threads while Python is
intact.
"""

from __future__ import annotations

import atexit
import gc
import os
from dataclasses import dataclass
from typing import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from .errors import SequenceParallelConfigError

#: Environment variable: seconds a collective may wait before the group gives up (default 600).
#: A failure on one rank then ends the others with an error instead of a hang.
TIMEOUT_ENV = "DIFFUSERS_SP_TIMEOUT_S"



def backend_name(process_group=None) -> str:
    """The collective backend of a process group (None: the default group): ``"nccl"``, ``"gloo"``, ...

    A group initialised with a per-device backend list (Accelerate's ``PartialState()`` on CPU makes
    ``"cpu:gloo"``) reports ``"undefined"`` or the list itself through ``dist.get_backend``; its backend
    names are then read
    from ``dist.get_backend_config`` and joined with ``"+"`` when there are several (``"gloo+nccl"``).
    """
    name = dist.get_backend(process_group)
    if name and name != "undefined" and ":" not in name:
        return name
    config = dist.get_backend_config(process_group)
    names = list(dict.fromkeys(part.split(":")[-1] for part in config.split(",") if part))
    return "+".join(names) or str(name)

@dataclass(frozen=True)
class SPGroup:
    """The ranks that share one sequence.

    Attributes:
        group_name: The registered name of the ``torch.distributed`` process group (what functional
            collectives take), or ``None`` when world size is 1 and no distributed run exists.
        rank: This process's rank inside ``group`` (0-based).
        world_size: Number of ranks P in ``group``.
        backend: ``"nccl"``, ``"gloo"`` (or another torch.distributed backend name), ``None`` alone.
    """

    group_name: str | None
    rank: int
    world_size: int
    backend: str | None

    @property
    def group(self) -> "dist.ProcessGroup | None":
        """The process group itself, looked up by name (``None`` alone); raises once the groups are
        destroyed (:func:`destroy_process_groups`)."""
        if self.group_name is None:
            return None
        return dist.distributed_c10d._resolve_process_group(self.group_name)

    def check_device(self, device: torch.device) -> None:
        """Raises SequenceParallelConfigError when tensors on ``device`` cannot use this group's backend."""
        if self.world_size == 1 or self.backend is None:
            return
        if "nccl" in self.backend and device.type != "cuda" and "gloo" not in self.backend:
            raise SequenceParallelConfigError(
                f"the sequence-parallel group uses NCCL, which needs CUDA tensors, but the model runs on "
                f"{device}. Move the pipeline to this rank's GPU (pipe.to(PartialState().device)) or "
                f"launch on CPU, where the group uses gloo."
            )
        if self.backend == "gloo" and device.type not in ("cpu",):
            raise SequenceParallelConfigError(
                f"the sequence-parallel group uses gloo, which runs the collectives used here on CPU "
                f"tensors only, but the model runs on {device}. Launch with CUDA visible so that the "
                f"group uses NCCL, or pass an NCCL process_group."
            )


def _launched_world_size() -> int:
    for key in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        if os.environ.get(key):
            return int(os.environ[key])
    return 1


def world_size_for(process_group=None) -> int:
    """World size that :func:`resolve_group` will return, without initialising anything.

    Lets validation run before the rendezvous (itself a collective) of ``init_process_group``.
    """
    if process_group is not None:
        if not dist.is_available() or not dist.is_initialized():
            raise SequenceParallelConfigError(
                "a process_group was passed but torch.distributed is not initialised. Launch with "
                "`accelerate launch` or `torchrun` and create the group after init_process_group, or "
                "pass process_group=None to let Accelerate set the run up."
            )
        if process_group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group returns on the ranks it leaves out
            raise SequenceParallelConfigError(
                f"this rank (global rank {dist.get_rank()}) is not a member of the process_group passed to "
                f"enable_sequence_parallel: call it only on the group's ranks, or give every rank the group it "
                f"belongs to (e.g. from torch.distributed.new_subgroups).")
        if not isinstance(process_group, dist.ProcessGroup):
            raise SequenceParallelConfigError(
                f"process_group must be a torch.distributed.ProcessGroup, got {type(process_group).__name__}."
            )
        return dist.get_world_size(process_group)
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return _launched_world_size()


def resolve_group(process_group=None) -> SPGroup:
    """Returns the sequence-parallel group, initialising the distributed run through Accelerate if needed.

    Args:
        process_group: A ``torch.distributed.ProcessGroup`` to use, or ``None`` for the whole world
            as launched by ``accelerate launch`` / ``torchrun`` (a single process when not launched).

    Raises:
        SequenceParallelConfigError: the group is not a ProcessGroup, torch.distributed is not
            initialised for a passed group, or the launcher's environment is incomplete.
    """
    world = world_size_for(process_group)
    if process_group is not None:
        return SPGroup(process_group.group_name, dist.get_rank(process_group), world, backend_name(process_group))
    if world == 1 and not (dist.is_available() and dist.is_initialized()):
        return SPGroup(None, 0, 1, None)
    if not dist.is_initialized():
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK") if not os.environ.get(k)]
        if missing:
            raise SequenceParallelConfigError(
                f"WORLD_SIZE={world} is set but {', '.join(missing)} is missing: start the script with "
                f"`accelerate launch --config_file examples/accelerate_<cpu|gpu>.yaml ...` or `torchrun "
                f"--nproc-per-node N ...` so that every rank can join the process group."
            )
        from accelerate import PartialState

        # Accelerate picks NCCL when CUDA is present and gloo on CPU (it needs cpu=True to do the
        # latter under torchrun, which sets LOCAL_RANK).
        cpu = not torch.cuda.is_available() or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true")
        timeout = timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, "600")))
        PartialState(cpu=cpu, timeout=timeout)
    _end_at_exit()
    return SPGroup(dist.group.WORLD.group_name, dist.get_rank(), dist.get_world_size(), backend_name(None))


_AT_EXIT: list = []


def _end_at_exit() -> None:
    """Registers :func:`destroy_process_groups` to run at exit (once), before Python finalizes: a
    run whose script ends without destroying its groups (whoever initialised them) then still ends
    them while Python is intact (see the module docstring). A no-op when they were destroyed already."""
    if not _AT_EXIT:
        _AT_EXIT.append(atexit.register(destroy_process_groups))


#: What :func:`destroy_process_groups` runs before the groups end, in order of registration. Modules
#: above this one that hold resources tied to a group register here (:func:`register_teardown`), so
#: that this module imports none of them.
_TEARDOWNS: list[Callable[[], None]] = []


def register_teardown(teardown: Callable[[], None]) -> Callable[[], None]:
    """Adds ``teardown`` (no arguments; it must not run a collective) to what
    :func:`destroy_process_groups` runs before destroying the groups; registering it again changes
    nothing. Returns ``teardown``, so it can decorate a function."""
    if teardown not in _TEARDOWNS:
        _TEARDOWNS.append(teardown)
    return teardown


def destroy_process_groups(*, barrier: bool = False) -> None:
    """Ends the launch's process groups and joins their worker threads; safe to call more than once.

    Call it on every rank after the last collective (the example scripts do, on success and on
    error). It forgets the groups diffusers-sp built (CFG, replica and sequence-parallel sub-groups),
    destroys every group with ``torch.distributed.destroy_process_group()`` (sub-groups in reverse
    order of creation, the default group last), and collects the garbage so that the groups' C++
    objects, and with them gloo's worker threads and NCCL's watchdog, end here rather than while the
    interpreter exits (see the module docstring). Enabled pipelines may stay alive: diffusers-sp
    objects hold only group names. It also runs at exit in any process that enabled sequence
    parallelism over a distributed run.

    Args:
        barrier: Wait for every rank first (a collective: pass ``True`` only where every rank reaches
            this call, e.g. at the end of a successful run; an error path must not wait for ranks
            that may never come).
    """
    _PARALLEL_GROUPS.clear()
    if dist.is_available() and dist.is_initialized():
        if barrier:
            dist.barrier()
        for teardown in _TEARDOWNS:  # e.g. the copy engine's symmetric buffers, which hold their group
            teardown()
        dist.destroy_process_group()
    gc.collect()


@dataclass(frozen=True)
class HybridMesh:
    """The two levels of a sequence-parallel group of ``P = U x R`` ranks in ``mode="hybrid"``.

    From USP (J. Fang, S. Zhao, "USP: A Unified Sequence Parallelism Approach for Long Context
    Generative AI", arXiv 2405.07719): sequence-parallel rank ``p = o * U + u`` belongs to the Ulysses
    (inner) group ``o`` of the ``U`` consecutive ranks ``o * U .. o * U + U - 1`` and to the K/V-gather
    (outer) group ``u`` of the ``R`` ranks ``u, U + u, .., (R - 1) * U + u``. Launchers number ranks host
    by host, so an inner group of consecutive ranks shares a host whenever U divides the host size.

    Attributes:
        ulysses: This rank's inner group (``U`` ranks; its rank is ``u``).
        kv_gather: This rank's outer group (``R`` ranks; its rank is ``o``).
    """

    ulysses: SPGroup
    kv_gather: SPGroup

    @property
    def ulysses_degree(self) -> int:
        return self.ulysses.world_size

    @property
    def kv_gather_degree(self) -> int:
        return self.kv_gather.world_size

    def split_sizes(self, sizes: list[int]) -> tuple[list[int], list[int]]:
        """``sizes`` (tokens per rank of the whole group, ``P`` entries) as ``(tokens per rank of this
        rank's inner group, tokens per inner group)``: the token chunk of inner group ``o`` is the
        concatenation of its ranks' shards, and the chunks in order of ``o`` are the whole sequence."""
        U, R = self.ulysses_degree, self.kv_gather_degree
        if len(sizes) != U * R:
            raise ValueError(f"{len(sizes)} shard sizes for a {U} x {R} mesh")
        o = self.kv_gather.rank
        return list(sizes[o * U:(o + 1) * U]), [sum(sizes[i * U:(i + 1) * U]) for i in range(R)]


@dataclass(frozen=True)
class ParallelGroups:
    """The groups of a ``replicas x cfg x sp`` launch, cut from one torch ``DeviceMesh``.

    Global rank ``g = (replica * cfg_degree + cfg_rank) * sp_degree + sp_rank``: the ranks of one
    sequence-parallel group are consecutive, the two CFG groups of a replica sit next to each other.

    The groups are cut from a ``torch.distributed.device_mesh.DeviceMesh`` of shape
    ``(replicas, cfg, sp)`` with dim names ``("replica", "cfg", "sp")`` (device type ``"cuda"`` on
    NCCL, ``"cpu"`` on gloo), which is not kept: it holds its process groups.

    Attributes:
        sp: This rank's sequence-parallel group (``sp_degree`` ranks).
        cfg: The ``cfg_degree`` ranks (1 or 2) holding the same sequence shard in the two CFG groups.
        replica: Every rank working on the same sample (``cfg_degree * sp_degree`` ranks): latents,
            RNG state and the parallel VAE decode are shared over it.
        world: The whole launch.
        replica_index: Which replica this rank belongs to (0-based); ``num_replicas`` of them.
        cfg_rank: 0 (conditional pass / first half of a CFG batch) or 1 (unconditional / second half).
        hybrid: ``None``, or the :class:`HybridMesh` that factors ``sp`` into ``kv_gather x ulysses``
            (``world = replicas x cfg x kv_gather x ulysses``).
    """

    sp: SPGroup
    cfg: SPGroup
    replica: SPGroup
    world: SPGroup
    replica_index: int
    num_replicas: int
    cfg_rank: int
    cfg_degree: int
    hybrid: HybridMesh | None = None


_PARALLEL_GROUPS: dict = {}


def build_parallel_groups(num_replicas: int, cfg_degree: int, sp_degree: int,
                          ulysses_degree: int | None = None) -> ParallelGroups:
    """Builds (once per shape and launch; cached) the ``replicas x cfg x sp`` groups, and with
    ``ulysses_degree`` the :class:`HybridMesh` that factors each ``sp`` group into
    ``kv_gather x ulysses`` (``sp_degree / ulysses_degree`` x ``ulysses_degree``).

    A collective over the whole launch: every rank must call it with the same arguments, and every
    rank creates every group, in the same order. The arguments must already be validated
    (``num_replicas * cfg_degree * sp_degree`` = world size, ``ulysses_degree`` divides
    ``sp_degree``), see :func:`diffusers_sp.replicas.resolve_layout` and
    :func:`diffusers_sp.validation.resolve_mode`.

    Returns:
        :class:`ParallelGroups`. With one process and no distributed run, every group is that process.
    """
    world = resolve_group(None)
    if world.world_size == 1:
        mesh = HybridMesh(world, world) if ulysses_degree is not None else None
        return ParallelGroups(world, world, world, world, 0, 1, 0, 1, mesh)
    if num_replicas * cfg_degree * sp_degree != world.world_size:
        raise SequenceParallelConfigError(
            f"replicas {num_replicas} x cfg {cfg_degree} x sp {sp_degree} != world size {world.world_size}")
    if ulysses_degree is not None and sp_degree % ulysses_degree:
        raise SequenceParallelConfigError(f"ulysses_degree {ulysses_degree} does not divide sp {sp_degree}")
    key = (num_replicas, cfg_degree, sp_degree, ulysses_degree, world.world_size, world.group_name)
    if key in _PARALLEL_GROUPS:
        return _PARALLEL_GROUPS[key]
    from torch.distributed.device_mesh import init_device_mesh

    device_type = "cuda" if "nccl" in (world.backend or "") else "cpu"
    mesh = init_device_mesh(device_type, (num_replicas, cfg_degree, sp_degree),
                            mesh_dim_names=("replica", "cfg", "sp"))
    backend = world.backend

    def sub(dim: str) -> SPGroup:
        return SPGroup(mesh.get_group(dim).group_name, mesh.get_local_rank(dim), mesh.size(mesh.mesh_dim_names.index(dim)),
                       backend)

    per_replica = cfg_degree * sp_degree
    if num_replicas == 1:
        replica = world
    else:
        group, _ = dist.new_subgroups_by_enumeration(
            [list(range(r * per_replica, (r + 1) * per_replica)) for r in range(num_replicas)])
        replica = SPGroup(group.group_name, world.rank % per_replica, per_replica, backend)
    hybrid = None if ulysses_degree is None else _hybrid_mesh(world, sp_degree, ulysses_degree)
    out = ParallelGroups(sp=sub("sp"), cfg=sub("cfg"), replica=replica, world=world,
                         replica_index=world.rank // per_replica, num_replicas=num_replicas,
                         cfg_rank=(world.rank // sp_degree) % cfg_degree, cfg_degree=cfg_degree, hybrid=hybrid)
    _PARALLEL_GROUPS[key] = out
    return out


def _hybrid_mesh(world: SPGroup, sp_degree: int, ulysses_degree: int) -> HybridMesh:
    """The :class:`HybridMesh` of this rank: every sequence-parallel group (``sp_degree`` consecutive
    global ranks) cut into inner groups of ``ulysses_degree`` consecutive ranks and outer groups of
    the ranks with the same index in their inner group. Every rank creates every group (inner ones
    first), as ``torch.distributed.new_group`` requires; only the names of this rank's are kept."""
    U, R = ulysses_degree, sp_degree // ulysses_degree
    blocks = range(0, world.world_size, sp_degree)
    inner = [[b + o * U + u for u in range(U)] for b in blocks for o in range(R)]
    outer = [[b + o * U + u for o in range(R)] for b in blocks for u in range(U)]
    p = world.rank % sp_degree
    made = []
    for ranks, size, rank in ((inner, U, p % U), (outer, R, p // U)):
        group, _ = dist.new_subgroups_by_enumeration(ranks)
        made.append(SPGroup(group.group_name, rank, size, world.backend))
    return HybridMesh(ulysses=made[0], kv_gather=made[1])
