"""Process groups for sequence parallelism.

By default the run is launched and initialised by Accelerate: :class:`accelerate.PartialState`
reads the launcher's environment (``accelerate launch`` or ``torchrun``) and initialises
``torch.distributed`` with NCCL on CUDA and gloo on CPU. The sequence-parallel group is then the
whole world. A caller may pass its own ``torch.distributed`` process group instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .validation import SequenceParallelConfigError

#: Environment variable: seconds a collective may wait before the group gives up (default 600).
#: A failure on one rank then ends the others with an error instead of a hang.
TIMEOUT_ENV = "DIFFUSERS_SP_TIMEOUT_S"


@dataclass(frozen=True)
class SPGroup:
    """The ranks that share one sequence.

    Attributes:
        group: The ``torch.distributed`` process group, or ``None`` when world size is 1 and no
            distributed run exists.
        rank: This process's rank inside ``group`` (0-based).
        world_size: Number of ranks P in ``group``.
        backend: ``"nccl"``, ``"gloo"`` (or another torch.distributed backend name), ``None`` alone.
    """

    group: "dist.ProcessGroup | None"
    rank: int
    world_size: int
    backend: str | None

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
        return SPGroup(process_group, dist.get_rank(process_group), world, dist.get_backend(process_group))
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
    return SPGroup(dist.group.WORLD, dist.get_rank(), dist.get_world_size(), dist.get_backend())
