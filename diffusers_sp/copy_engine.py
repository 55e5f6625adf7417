"""Copy-engine transport: K/V all-gather through torch symmetric memory, overlapped with attention.

NCCL's collectives are kernels: they run on the SMs, so a collective in flight slows the attention
kernel it overlaps (measured on 2 H200s: splitting the attention into head groups and overlapping
each group's NCCL all-gather with the previous group's attention made the 14B step slower, 651 ->
690 ms; benchmarks/RESULTS.md). The GPU's copy engines (DMA) move data over NVLink without SMs.
This module uses them through PyTorch's symmetric memory (``torch.distributed._symmetric_memory``:
a buffer every rank of the group can address, whose peers' parts are tensors on the local device;
``Tensor.copy_`` between contiguous same-dtype CUDA tensors is a ``cudaMemcpyAsync``, which the
driver runs on a copy engine). The pull-based scheme and the idea of low-contention, copy-engine
collectives come from PyTorch's async tensor parallelism (``_low_contention_all_gather`` and
``_pipelined_all_gather_and_consume`` in ``torch/distributed/_symmetric_memory``).

K/V-gather over the copy engines (:func:`kv_gather_copy_engine`), per attention call:

1. Each rank writes its K and V shard into its own symmetric buffer, at its rows of the full
   sequence, head group by head group (layout ``[2 (K, V), G, S, B, H/G, D]``): one copy kernel per
   tensor, on the compute stream.
2. On a side stream: a symmetric-memory barrier (every rank has written), then for each head group
   the copy-engine pulls of every peer's rows of that group into the same rows of the local buffer,
   then an event per group; a second barrier (every rank has finished reading its peers) frees the
   buffer for the next call.
3. On the compute stream: attention of head group g starts when group g's event has fired, while the
   copy engines already move group g + 1. Only the first group's transfer is exposed.

The result is bit-identical to the NCCL path (the same rows reach the same places; attention of a
head subset computes exactly the same per-head values). Requirements (checked by
:func:`copy_engine_unavailable_reason`): CUDA tensors, an NCCL group whose ranks are all on one host
(symmetric memory maps peer memory over NVLink/PCIe), and a PyTorch with symmetric memory. The
buffer holds the full K and V of the largest call seen (like the gathered K/V of the NCCL path, but
kept between calls): 2 x S x B x H x D elements.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .groups import TIMEOUT_ENV, SPGroup

#: Values of the ``sp_transport`` option.
TRANSPORTS = ("auto", "nccl", "copy_engine")


def copy_engine_unavailable_reason(group: SPGroup) -> str | None:
    """Why the copy-engine transport cannot run on ``group`` (``None``: it can).

    Checks, without any collective: more than one rank; an NCCL group (CUDA tensors); torch's CUDA
    symmetric memory; all ranks of the group on this host (global ranks within this node's block of
    ``LOCAL_WORLD_SIZE`` consecutive ranks, the layout ``torchrun`` and ``accelerate launch`` use).
    """
    if group.world_size == 1:
        return "one rank: nothing to transfer"
    if group.backend is None or "nccl" not in group.backend:
        return f"the group's backend is {group.backend!r}, not NCCL (CUDA)"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    c10d = getattr(torch._C, "_distributed_c10d", None)
    if getattr(c10d, "_SymmetricMemory", None) is None or importlib.util.find_spec(
            "torch.distributed._symmetric_memory") is None:
        return "this PyTorch has no symmetric memory (torch.distributed._symmetric_memory)"
    local_world = os.environ.get("LOCAL_WORLD_SIZE")
    if not local_world:
        return "LOCAL_WORLD_SIZE is not set, so whether all ranks share one host is unknown"
    local_world = int(local_world)
    ranks = dist.get_process_group_ranks(group.group)
    nodes = {r // local_world for r in ranks}
    if len(nodes) != 1:
        return f"the group spans {len(nodes)} hosts (symmetric memory needs the ranks on one host)"
    return None


@dataclass
class _Workspace:
    """A symmetric buffer of one group on one device, with its handle, side stream and events."""

    buffer: torch.Tensor  # uint8, symmetric
    handle: object  # torch's _SymmetricMemory
    stream: torch.cuda.Stream
    free: torch.cuda.Event = field(default_factory=torch.cuda.Event)  # peers done reading
    events: list = field(default_factory=list)

    def event(self, i: int) -> torch.cuda.Event:
        while len(self.events) <= i:
            self.events.append(torch.cuda.Event())
        return self.events[i]


_WORKSPACES: dict = {}  # (group name, device index) -> _Workspace


def workspace(group: SPGroup, nbytes: int, device: torch.device) -> _Workspace:
    """The group's symmetric buffer of at least ``nbytes`` bytes (allocated or grown collectively).

    Every rank makes the same calls with the same shapes, so growth happens on all ranks at the
    same call; the rendezvous is a collective over ``group``.
    """
    import torch.distributed._symmetric_memory as symm_mem

    key = (group.group.group_name, device.index)
    ws = _WORKSPACES.get(key)
    if ws is not None and ws.buffer.numel() >= nbytes:
        return ws
    if ws is None:
        # High priority: the barrier kernels on it get an SM as soon as one frees up.
        stream = torch.cuda.Stream(device=device, priority=-1)
    else:
        # Peers may still read the old buffer until the last call's closing barrier.
        torch.cuda.current_stream(device).wait_event(ws.free)
        torch.cuda.synchronize(device)
        stream = ws.stream
        del _WORKSPACES[key]
    # Our copies never use NVLink multicast; do not let the rendezvous create multicast objects.
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(buffer, group.group)
    ws = _Workspace(buffer=buffer, handle=handle, stream=stream)
    _WORKSPACES[key] = ws
    return ws


def barrier_timeout_ms() -> int:
    """The barrier timeout: the group's collective timeout (:data:`~diffusers_sp.groups.TIMEOUT_ENV`) in ms."""
    return int(float(os.environ.get(TIMEOUT_ENV, "600")) * 1000)
