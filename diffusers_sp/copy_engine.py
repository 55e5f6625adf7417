"""Copy-engine transport: the Ulysses and K/V-gather exchanges through torch symmetric memory.

NCCL's collectives are kernels: they run on the SMs, so a collective in flight slows the attention
kernel it overlaps (measured on 2 H200s: splitting the attention into head groups and overlapping
each group's NCCL all-gather with the previous group's attention made the 14B step slower, 651 ->
690 ms; benchmarks/RESULTS.md). The GPU's copy engines (DMA) move data over NVLink without SMs.
This module gives the strategies access to them through PyTorch's symmetric memory
(``torch.distributed._symmetric_memory``: a buffer every rank of the group can address, whose
peers' parts are tensors on the local device) and the CUDA driver's pitched 2-D copy
(:func:`copy_rows`: ``cuMemcpy2DAsync``, which runs on a copy engine and reads or writes rows at any
pitch, so a head slice of a token-major tensor moves without being packed first). The idea of
low-contention, copy-engine collectives over symmetric memory comes from PyTorch's async tensor
parallelism (``_low_contention_all_gather`` and ``_pipelined_all_gather_and_consume`` in
``torch/distributed/_symmetric_memory``).

The pattern, used by :func:`diffusers_sp.processors.kv_gather.kv_gather_attention_copy_engine` and
:func:`diffusers_sp.processors.ulysses.ulysses_attention_copy_engine`, is push-based: on a side
stream that has waited for the compute stream's work so far (so this rank's earlier reads of its
buffer are done), a symmetric-memory barrier (every rank may now be written to) is followed, head
group by head group, by 2-D copies of this rank's rows straight from the model's tensors into each
peer's buffer, a barrier (every peer's rows of the group have arrived) and an event; a second
stream copies the rank's own rows on a copy engine too. The attention of group g waits only for
group g's events, so the transfer of group g + 1 runs under it. The transfers move the same bits as
NCCL would: results are bit-identical to the NCCL path. (Until b2c4ccf each rank packed its rows
into its own buffer with SM copies and its peers pulled them; the packing cost ~4 ms per 1.3B step.)

Bit-identity also relies on the local attention kernel computing each head independently of the
other heads in the call (true of SDPA's backends and flash-attn), since the copy-engine paths
attend head group by head group.

Requirements (checked by :func:`copy_engine_unavailable_reason`): CUDA tensors, an NCCL group of a
single-host launch with peer access between the GPUs (symmetric memory maps peer memory over
NVLink/PCIe), and torch 2.6 or newer. The buffer (:func:`workspace`) is sized for the largest call seen and kept between
calls until ``disable()`` (:func:`release_workspaces`): 2 x S x B x H x D elements for K/V-gather
(the gathered K and V, which the NCCL path allocates per call instead), about 5 x S x B x H x D / P
for Ulysses over P ranks (the gathered Q, K, V of the rank's heads and two output regions). :func:`symmetric_memory_bytes` reports it; on the GPU machines (torch 2.11)
``torch.cuda.max_memory_allocated`` did not include it. Whether ``release_workspaces`` returns the
memory to the device or to a pool of torch's symmetric-memory allocator (``TORCH_SYMMMEM_IMPLICIT_POOL``
in newer torch) is torch's choice and has not been measured. Before the first allocation the module
sets ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` in the process environment unless it is already set:
these copies never use NVLink multicast, and creating multicast objects costs resources (some
shared machines forbid it); later symmetric-memory users in the process see that setting too.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
from dataclasses import dataclass, field

import torch

from .groups import TIMEOUT_ENV, SPGroup, register_teardown
from .shards import balanced_sizes

logger = logging.getLogger("diffusers_sp")

#: Values of the ``sp_transport`` option.
TRANSPORTS = ("auto", "nccl", "copy_engine")


#: Head groups when ``overlap_head_groups="auto"``. Measured on 2 H200s with the push transport
#: (benchmarks/RESULTS.md): on the Wan 1.3B shape 3, 4 and 6 groups were neither
#: consistently faster nor slower than 2 (from 7.0 ms faster to 3.8 ms slower per step, while 2 groups
#: alone moved 4.9 ms between runs); at 14B, Ulysses with 3 groups and K/V-gather with 6 were 1.2 and
#: 3.2 ms slower than 2.
AUTO_HEAD_GROUPS = 2


def head_group_sizes(num_heads: int, head_groups: int | str) -> list[int]:
    """Heads per group of the copy-engine pipeline: ``min(G, H)`` balanced groups.

    Args:
        num_heads: H.
        head_groups: G, ``"auto"`` (:data:`AUTO_HEAD_GROUPS`) or a positive int.

    Raises:
        ValueError: ``head_groups`` is neither ``"auto"`` nor a positive int.
    """
    if head_groups == "auto":
        head_groups = AUTO_HEAD_GROUPS
    if isinstance(head_groups, bool) or not isinstance(head_groups, int) or head_groups < 1:
        raise ValueError(f"overlap_head_groups must be 'auto' or a positive int, got {head_groups!r}")
    return balanced_sizes(num_heads, min(head_groups, num_heads))


def copy_engine_unavailable_reason(group: SPGroup) -> str | None:
    """Why the copy-engine transport cannot run on ``group`` (``None``: it can).

    Checks, without any collective and with the same answer on every rank: more than one rank; an
    NCCL group (CUDA tensors); torch's symmetric memory with ``empty`` and ``rendezvous`` (torch 2.6
    and newer); a single-host launch (``LOCAL_WORLD_SIZE == WORLD_SIZE``, as ``torchrun`` and
    ``accelerate launch`` set them; multi-host launches are not used even when the group sits on
    one host); and peer access between every pair of visible GPUs (two or more must be visible).
    """
    if group.world_size == 1:
        return "one rank: nothing to transfer"
    if not torch.cuda.is_available():
        return "CUDA is not available (CPU ranks use gloo; the copy engines need CUDA ranks on NCCL)"
    if group.backend is None or "nccl" not in group.backend:
        return f"the group's backend is {group.backend!r}, not NCCL (CUDA)"
    c10d = getattr(torch._C, "_distributed_c10d", None)
    if getattr(c10d, "_SymmetricMemory", None) is None or importlib.util.find_spec(
            "torch.distributed._symmetric_memory") is None:
        return "this PyTorch has no symmetric memory (torch.distributed._symmetric_memory)"
    import torch.distributed._symmetric_memory as symm_mem

    if not (hasattr(symm_mem, "empty") and hasattr(symm_mem, "rendezvous")):
        return "this PyTorch's symmetric memory lacks empty/rendezvous (torch 2.6 or newer needed)"
    local_world, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
    if not local_world or not world:
        return "LOCAL_WORLD_SIZE or WORLD_SIZE is not set, so whether all ranks share one host is unknown"
    if int(local_world) != int(world):
        return f"the launch spans several hosts (LOCAL_WORLD_SIZE={local_world}, WORLD_SIZE={world})"
    count = torch.cuda.device_count()
    if count < 2:
        return "each process sees one GPU, so peer access between the GPUs cannot be checked"
    missing = [(a, b) for a in range(count) for b in range(count)
               if a != b and not torch.cuda.can_device_access_peer(a, b)]
    if missing:
        return f"GPUs {missing[0][0]} and {missing[0][1]} have no peer access"
    return None


class _Memcpy2D(ctypes.Structure):
    """The CUDA driver's ``CUDA_MEMCPY2D`` (cuda.h; field order and types as declared there)."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p), ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t), ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p), ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t),
    ]


_CU_MEMORYTYPE_DEVICE = 2  # cuda.h CUmemorytype
_MIN_ROW_BYTES = 64  # narrower rows (e.g. a strided last dim) are left to an SM copy
_DRIVER: list = []  # [cuMemcpy2DAsync_v2, cuGetErrorString] once loaded


def _driver():
    if not _DRIVER:
        lib = ctypes.CDLL("libcuda.so.1")  # the CUDA driver every CUDA process has loaded
        copy = lib.cuMemcpy2DAsync_v2
        copy.argtypes = [ctypes.POINTER(_Memcpy2D), ctypes.c_void_p]
        copy.restype = ctypes.c_int
        error = lib.cuGetErrorString
        error.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        error.restype = ctypes.c_int
        _DRIVER.extend((copy, error))
    return _DRIVER


def _pitched_rows(dst: torch.Tensor, src: torch.Tensor) -> tuple[int, int, int, int] | None:
    """``(rows, width, dst pitch, src pitch)`` in elements if ``dst`` and ``src`` (same shape) are
    both ``rows`` rows of ``width`` contiguous elements at a uniform pitch each; else ``None``."""
    dims = [(n, a, b) for n, a, b in zip(dst.shape, dst.stride(), src.stride()) if n != 1]
    width = 1
    while dims and dims[-1][1] == width and dims[-1][2] == width:
        width *= dims.pop()[0]
    if not dims:
        return 1, width, width, width
    rows, dst_pitch, src_pitch = dims.pop()
    if dst_pitch < width or src_pitch < width:  # overlapping rows (e.g. an expanded, stride-0 dim)
        return None
    for n, a, b in reversed(dims):  # outer dims must continue the row sequence in both tensors
        if a != dst_pitch * rows or b != src_pitch * rows:
            return None
        rows *= n
    return rows, width, dst_pitch, src_pitch


def _split_pitched(dst: torch.Tensor, src: torch.Tensor, budget: int) -> list | None:
    """Pieces ``(dst, src, plan)`` covering the copy, each one pitched 2-D copy: the whole copy if
    possible, else split along the smallest dim outside the contiguous rows (a batch or head dim),
    recursively; ``None`` if more than ``budget`` pieces would be needed. Dims are first ordered by
    ``dst``'s strides (outermost first), which leaves the copy unchanged."""
    order = sorted(range(dst.dim()), key=lambda d: -dst.stride(d))
    dst, src = dst.permute(order), src.permute(order)
    plan = _pitched_rows(dst, src)
    if plan is not None:
        return [(dst, src, plan)]
    inner = dst.dim()
    width = 1
    while inner and dst.stride(inner - 1) == width and src.stride(inner - 1) == width:
        inner -= 1
        width *= dst.shape[inner]
    candidates = [d for d in range(inner) if dst.shape[d] > 1]
    if not candidates:
        return None
    dim = min(candidates, key=lambda d: dst.shape[d])
    if dst.shape[dim] > budget:
        return None
    pieces = []
    for i in range(dst.shape[dim]):
        sub = _split_pitched(dst.select(dim, i), src.select(dim, i), budget // dst.shape[dim])
        if sub is None:
            return None
        pieces += sub
    return pieces


def _plan_copy(dst: torch.Tensor, src: torch.Tensor, max_copies: int) -> list | None:
    """The pitched 2-D copies :func:`copy_rows` issues (see :func:`_split_pitched`), or ``None``
    when it should not: lazy negation/conjugation bits (a byte copy would drop them), more than
    ``max_copies`` pieces, or rows narrower than 64 bytes (an SM copy does those better)."""
    if src.is_neg() or src.is_conj() or dst.is_neg() or dst.is_conj():
        return None
    pieces = _split_pitched(dst, src, max_copies)
    if pieces is None or any(width * dst.element_size() < _MIN_ROW_BYTES for _, _, (_, width, _, _) in pieces):
        return None
    return pieces


def copy_rows(dst: torch.Tensor, src: torch.Tensor, max_copies: int = 64) -> bool:
    """Copies ``src`` into ``dst`` on a copy engine: pitched 2-D copies on the current stream of the
    current device.

    ``Tensor.copy_`` runs non-contiguous copies as SM kernels; the driver's ``cuMemcpy2DAsync``
    (CUDA driver API, called through ctypes) moves "rows" of contiguous bytes at any source and
    destination pitch on a copy engine, between local memory and peers' symmetric memory alike
    (measured on 2 H200s over NVLink: a head slice of a token-major ``[16380, 12, 128]`` bf16 tensor,
    rows of 768-3072 bytes, is pushed to the peer at 310-370 GB/s, as fast as a contiguous copy of
    the same bytes, and a GEMM running meanwhile slowed by 3 % against 37 % with an SM copy). This is
    what lets a rank send one head slice of a token-major ``[S, H, D]`` tensor (rows of ``h * D``
    elements at pitch ``H * D``) without packing it first.

    Args:
        dst, src: CUDA tensors of one shape and dtype (either may be a view into a peer's symmetric
            buffer). Each pair of matching pieces must be rows of contiguous elements at a uniform
            pitch: the whole tensors (e.g. ``[S, h, D]`` slices of ``[S, H, D]`` tensors), or, after
            splitting along their smallest other dims (batch, heads), at most ``max_copies`` pieces.
        max_copies: The most 2-D copies to issue for one call.

    Returns:
        ``True`` if the copy was issued on copy engines; ``False`` if the layouts do not split into
        pitched rows of at least 64 bytes within ``max_copies``, or either tensor carries a lazy
        negation/conjugation bit, in which case nothing was copied and the caller copies with
        ``Tensor.copy_``.

    Raises:
        ValueError: shapes or dtypes differ, or a tensor is not a CUDA tensor.
        OSError: the CUDA driver library (``libcuda.so.1``) cannot be loaded.

    A piece the driver refuses (NVIDIA documents that ``cuMemcpy2DAsync`` may reject pitches it
    cannot handle) is copied with ``Tensor.copy_`` instead, in stream order, with a warning logged
    once per error: raising there would leave this rank out of the copy-engine protocol while its
    peers wait at the next barrier.

    The caller keeps both tensors alive (``record_stream``) until the current stream has run the copy.
    """
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(f"copy_rows needs one shape and dtype, got {tuple(dst.shape)} {dst.dtype} "
                         f"and {tuple(src.shape)} {src.dtype}")
    if not (dst.is_cuda and src.is_cuda):
        raise ValueError(f"copy_rows needs CUDA tensors, got {dst.device} and {src.device}")
    if dst.numel() == 0:
        return True
    pieces = _plan_copy(dst, src, max_copies)
    if pieces is None:
        return False
    copy, error = _driver()
    _issue(pieces, copy, error, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    return True


_REFUSALS_LOGGED: set = set()


def _issue(pieces, copy, error, stream) -> None:
    """Issues the pitched 2-D copies of a :func:`_plan_copy` plan with the driver's ``copy``
    (``cuMemcpy2DAsync``) on ``stream``; a piece it refuses (non-zero status) is copied with
    ``Tensor.copy_`` on the current stream instead, and the refusal logged once per error code."""
    for d, s, (rows, width, dst_pitch, src_pitch) in pieces:
        size = d.element_size()
        spec = _Memcpy2D(srcMemoryType=_CU_MEMORYTYPE_DEVICE, srcDevice=s.data_ptr(), srcPitch=src_pitch * size,
                         dstMemoryType=_CU_MEMORYTYPE_DEVICE, dstDevice=d.data_ptr(), dstPitch=dst_pitch * size,
                         WidthInBytes=width * size, Height=rows)
        status = copy(ctypes.byref(spec), stream)
        if status != 0:
            if status not in _REFUSALS_LOGGED:
                _REFUSALS_LOGGED.add(status)
                text = ctypes.c_char_p()
                error(status, ctypes.byref(text))
                logger.warning("cuMemcpy2DAsync refused a copy with CUDA error %s (%s; rows=%d, width=%d B, "
                               "pitches %d/%d B); copying it, and any other it refuses with this error, with "
                               "Tensor.copy_", status, (text.value or b"unknown").decode(), rows, width * size,
                               dst_pitch * size, src_pitch * size)
            d.copy_(s)


def copy_or_fallback(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copies ``src`` into ``dst`` on the current stream: :func:`copy_rows` (copy engines), or
    ``Tensor.copy_`` (an SM kernel, which also reaches peers' symmetric memory over NVLink) where the
    layouts do not split into at most 64 pitched 2-D copies.

    Args:
        dst, src: CUDA tensors of one shape and dtype on the current device (views of peers'
            symmetric memory count as local), any layout.

    Raises:
        ValueError: shapes or dtypes differ, or a tensor is not on CUDA (see :func:`copy_rows`).
    """
    if not copy_rows(dst, src):
        dst.copy_(src)


@dataclass
class _Workspace:
    """A symmetric buffer of one group on one device, with its handle, streams and events."""

    buffer: torch.Tensor  # uint8, symmetric
    handle: object  # torch's _SymmetricMemory
    stream: torch.cuda.Stream  # barriers and the copies to peers
    local: torch.cuda.Stream  # copy-engine copies within this GPU, beside the copies to peers
    free: torch.cuda.Event = field(default_factory=torch.cuda.Event)  # after the latest call's last barrier
    events: list = field(default_factory=list)
    calls: int = 0  # Ulysses calls since allocation: picks the output region (equal on every rank)

    def event(self, i: int) -> torch.cuda.Event:
        while len(self.events) <= i:
            self.events.append(torch.cuda.Event())
        return self.events[i]

    def follow(self, compute: torch.cuda.Stream, tensors) -> None:
        """Makes both copy streams wait for the work enqueued on ``compute`` so far, and keeps
        ``tensors`` (which the copies read) alive until the copy streams have run what follows."""
        for stream in (self.stream, self.local):
            stream.wait_stream(compute)
            for t in tensors:
                t.record_stream(stream)


_WORKSPACES: dict = {}  # (group name, device index) -> _Workspace


def _retire(ws: _Workspace) -> None:
    """Waits until no peer can still write into ``ws``'s buffer (the latest call's last barrier has
    passed, on the current stream, and the device is idle), so that the buffer may be dropped."""
    device = ws.buffer.device
    torch.cuda.current_stream(device).wait_event(ws.free)
    torch.cuda.synchronize(device)


def workspace(group: SPGroup, nbytes: int, device: torch.device) -> _Workspace:
    """The group's workspace on ``device``: a symmetric uint8 buffer of at least ``nbytes`` bytes,
    its symmetric-memory handle, the side and local streams and the events (allocated or grown
    collectively).

    The buffer is kept for later calls. A call needing more than it holds retires it (waits for its
    latest barrier and synchronizes the device), then allocates and rendezvouses a new one, with
    ``calls`` back at 0; the streams are kept. Every rank makes the same calls with the same shapes,
    so growth happens on all ranks at the same call; the rendezvous is a collective over ``group``.
    """
    import torch.distributed._symmetric_memory as symm_mem

    key = (group.group_name, device.index)
    ws = _WORKSPACES.get(key)
    if ws is not None and ws.buffer.numel() >= nbytes:
        return ws
    if ws is None:
        # High priority: the barrier kernels on it get an SM as soon as one frees up.
        stream = torch.cuda.Stream(device=device, priority=-1)
        local = torch.cuda.Stream(device=device, priority=-1)
    else:
        stream, local = ws.stream, ws.local
        _retire(_WORKSPACES.pop(key))
        ws = None  # the old buffer goes before the new one is allocated
    # Our copies never use NVLink multicast; do not let the rendezvous create multicast objects.
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(buffer, group.group)
    ws = _Workspace(buffer=buffer, handle=handle, stream=stream, local=local)
    _WORKSPACES[key] = ws
    return ws


def barrier_timeout_ms() -> int:
    """The barrier timeout: the group's collective timeout (:data:`~diffusers_sp.groups.TIMEOUT_ENV`) in ms."""
    return int(float(os.environ.get(TIMEOUT_ENV, "600")) * 1000)


def symmetric_memory_bytes() -> int:
    """Bytes of symmetric memory this process holds for the copy-engine transport (all groups and
    devices). Not counted by ``torch.cuda.memory_allocated``: add it when reporting memory."""
    return sum(ws.buffer.numel() for ws in _WORKSPACES.values())


@register_teardown
def release_workspaces(group: SPGroup | None = None) -> None:
    """Frees the symmetric buffers of ``group`` (``None``: of every group); the next call allocates again.

    Waits on the current stream for each buffer's latest barrier, after which no peer writes into
    it, then synchronizes the device. Called by ``SequenceParallelHandle.disable``; every rank of the
    group must call it at the same point (the next allocation is a collective).
    """
    for key in list(_WORKSPACES):
        if group is not None and key[0] != group.group_name:
            continue
        _retire(_WORKSPACES.pop(key))
