"""Collectives along the sequence or head dimension, uneven sizes included.

All collectives are the functional ones of ``torch.distributed._functional_collectives`` (pure
functions of tensors, which keeps ``torch.compile`` working); they run on NCCL (CUDA) and gloo (CPU).
Sizes are balanced shards (see :func:`diffusers_sp.shards.balanced_sizes`), so every rank knows
every other rank's size without asking.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from .groups import SPGroup

# `all_gather_single` replaced `all_gather_tensor` (same arguments) in torch 2.13; earlier
# releases have only `all_gather_tensor`.
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def _wait(x: torch.Tensor) -> torch.Tensor:
    return funcol.wait_tensor(x) if isinstance(x, funcol.AsyncCollectiveTensor) else x


def _in_flight(group: SPGroup, finish: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``finish`` (the wait of a collective just issued) on NCCL; on other backends (gloo, CPU) the
    wait happens now and the returned function hands back its result.

    On CPU there is nothing to overlap (gloo's threads and the compute share the cores), and a gloo
    worker once aborted with "malloc(): unaligned tcache chunk detected" while two functional
    collectives were in flight at once; waiting at once keeps one in flight at a time on gloo.
    """
    if group.backend is not None and "nccl" in group.backend:
        return finish
    result = finish()
    return lambda: result


def all_to_all_flat(x: torch.Tensor, send_sizes: Sequence[int], recv_sizes: Sequence[int],
                    group: SPGroup) -> torch.Tensor:
    """All-to-all of a flat buffer with per-rank sizes.

    Args:
        x: 1-D tensor, the concatenation of the chunks for ranks 0..P-1, ``len(x) == sum(send_sizes)``.
        send_sizes: Elements sent to each rank (length P).
        recv_sizes: Elements received from each rank (length P).
        group: The sequence-parallel group.

    Returns:
        1-D tensor of ``sum(recv_sizes)`` elements: the chunks received from ranks 0..P-1 in order.
    """
    return start_all_to_all_flat(x, send_sizes, recv_sizes, group)()


def start_all_to_all_flat(x: torch.Tensor, send_sizes: Sequence[int], recv_sizes: Sequence[int],
                          group: SPGroup) -> Callable[[], torch.Tensor]:
    """Issues :func:`all_to_all_flat` and returns a function that waits for it and returns its result
    (as :func:`start_all_gather_dim0`: work queued in between overlaps the collective)."""
    if group.world_size == 1:
        return lambda: x
    pending = funcol.all_to_all_single(x, list(recv_sizes), list(send_sizes), group.group_name)
    return _in_flight(group, lambda: _wait(pending))


def all_gather_dim0(x: torch.Tensor, sizes: Sequence[int], group: SPGroup) -> torch.Tensor:
    """All-gather along dim 0 when rank ``i`` holds ``sizes[i]`` rows (sizes may differ by one or more).

    Args:
        x: ``[sizes[rank], *rest]`` tensor (made contiguous first: no copy when it already is).
        sizes: Rows held by each rank.
        group: The sequence-parallel group.

    Returns:
        ``[sum(sizes), *rest]``: the rows of ranks 0..P-1 in order.

    Uneven shards are padded to ``max(sizes)`` rows, gathered in one collective, and the padding
    rows dropped with one ``index_select``.
    """
    return start_all_gather_dim0(x, sizes, group)()


def start_all_gather_dim0(x: torch.Tensor, sizes: Sequence[int], group: SPGroup) -> Callable[[], torch.Tensor]:
    """Issues :func:`all_gather_dim0` and returns a function that waits for it and returns its result.

    Work queued on the current stream between the two calls runs while the collective is in flight
    (eagerly, the functional collective runs on the process group's own stream and the wait is a
    stream wait, not a host sync). On gloo the collective completes before this returns (see
    :func:`_in_flight`). Same arguments and result as :func:`all_gather_dim0`.
    """
    if group.world_size == 1:
        return lambda: x
    longest = max(sizes)
    if x.shape[0] != longest:
        x = torch.cat([x, x.new_zeros((longest - x.shape[0],) + tuple(x.shape[1:]))], dim=0)
    pending = _all_gather(x.contiguous(), 0, group.group_name)

    def finish() -> torch.Tensor:
        gathered = _wait(pending)
        if all(s == longest for s in sizes):
            return gathered
        keep = torch.cat([torch.arange(i * longest, i * longest + s, device=x.device) for i, s in enumerate(sizes)])
        return gathered.index_select(0, keep)

    return _in_flight(group, finish)


def all_gather_along(x: torch.Tensor, dim: int, sizes: Sequence[int], group: SPGroup) -> torch.Tensor:
    """All-gather along ``dim`` with uneven per-rank sizes; see :func:`all_gather_dim0`.

    Args:
        x: Tensor with ``sizes[rank]`` entries along ``dim``.
        dim: Dimension to gather along (negative allowed).
        sizes: Entries along ``dim`` held by each rank.

    Returns:
        The tensor with ``sum(sizes)`` entries along ``dim``, ranks in order.
    """
    if group.world_size == 1:
        return x
    dim = dim % x.ndim
    moved = x.movedim(dim, 0).contiguous()
    return all_gather_dim0(moved, sizes, group).movedim(0, dim)


def broadcast_tensor(x: torch.Tensor, group: SPGroup, src: int = 0) -> torch.Tensor:
    """Returns rank ``src``'s copy of ``x`` on every rank (same shape and dtype on every rank)."""
    if group.world_size == 1:
        return x
    y = x.clone(memory_format=torch.contiguous_format)  # one copy: broadcast writes in place
    dist.broadcast(y, src=dist.get_global_rank(group.group, src), group=group.group)
    return y


def all_reduce_sum(x: torch.Tensor, group: SPGroup) -> torch.Tensor:
    """The sum of ``x`` over the ranks of ``group`` (same shape on every rank), on every rank."""
    if group.world_size == 1:
        return x
    return _wait(funcol.all_reduce(x.contiguous(), "sum", group.group_name))
