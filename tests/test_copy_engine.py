"""The copy-engine transport's copy planner on CPU: the pitched 2-D copies that ``copy_rows`` would issue
(``cuMemcpy2DAsync`` needs a GPU) are executed here with ``torch.as_strided`` on the same storages, so a
wrong plan copies wrong elements and fails. The copy-engine attention paths themselves need two GPUs
(tests/test_gpu_nccl.py)."""

from __future__ import annotations

import pytest
import torch

from diffusers_sp.copy_engine import _plan_copy, _split_pitched, copy_rows


def run_plan(dst: torch.Tensor, src: torch.Tensor, budget: int = 64) -> int | None:
    """Executes ``_split_pitched``'s plan as 2-D strided copies; returns the number of pieces."""
    pieces = _split_pitched(dst, src, budget)
    if pieces is None:
        return None
    for d, s, (rows, width, dst_pitch, src_pitch) in pieces:
        torch.as_strided(d, (rows, width), (dst_pitch, 1)).copy_(torch.as_strided(s, (rows, width), (src_pitch, 1)))
    return len(pieces)


def numbered(*shape: int) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)


S, H, D = 37, 12, 8


@pytest.mark.parametrize("name,make,pieces", [
    # Ulysses/K/V-gather pushes: a head slice of a token-major [B, S, H, D] tensor into [S, B, h, D] rows.
    ("token-major head slice, B=1",
     lambda: (torch.empty(S, 1, 3, D), numbered(1, S, H, D).permute(1, 0, 2, 3)[:, :, 3:6]), 1),
    ("token-major head slice, B=2",
     lambda: (torch.empty(S, 2, 3, D), numbered(2, S, H, D).permute(1, 0, 2, 3)[:, :, 6:9]), 2),
    ("head-major input, B=2",
     lambda: (torch.empty(S, 2, 3, D), numbered(2, H, S, D).permute(2, 0, 1, 3)[:, :, 3:6]), 6),
    ("rows of a peer's output region", lambda: (torch.empty(2, 20, H, D)[:, :, 4:7], numbered(2, S, 3, D)[:, 5:25]), 2),
    # K/V-gather: a head group's output [B, n, L, D] into the joined [B, L, H, D] buffer, passed as [B, H, L, D] views.
    ("group output into the joined output",
     lambda: (torch.empty(1, S, H, D).permute(0, 2, 1, 3)[:, 3:6], numbered(1, S, 3, D).permute(0, 2, 1, 3)), 1),
    ("contiguous", lambda: (torch.empty(4, 5, D), numbered(4, 5, D)), 1),
    ("size-1 dims and a single row", lambda: (torch.empty(1, 1, 1, D), numbered(1, 3, 1, D)[:, 1:2]), 1),
])
def test_plan_copies_exactly(name, make, pieces):
    dst, src = make()
    dst.fill_(float("nan"))
    assert run_plan(dst, src) == pieces, name
    assert torch.equal(dst, src), name


def test_plan_refuses_beyond_budget():
    dst = torch.empty(S, 2, 3, D)
    src = numbered(2, H, S, D).permute(2, 0, 1, 3)[:, :, :3]  # needs 2 x 3 pieces
    assert _split_pitched(dst, src, 5) is None
    assert run_plan(dst, src, 6) == 6 and torch.equal(dst, src)


def test_plan_pitch_across_dims():
    # Every other row of [6, 8, D]: one uniform pitch (2 D) across both outer dims, one copy.
    dst, src = torch.full((6, 4, D), float("nan")), numbered(6, 8, D)[:, ::2]
    assert run_plan(dst, src) == 1 and torch.equal(dst, src)
    # Every other row of [6, 9, D]: the pitch breaks between outer rows, so the plan splits along
    # the smaller dim (5 copies of 6 rows at pitches 5 D and 9 D).
    dst, src = torch.full((6, 5, D), float("nan")), numbered(6, 9, D)[:, ::2]
    assert run_plan(dst, src) == 5 and torch.equal(dst, src)


def test_copy_rows_checks_shapes_and_dtypes():
    with pytest.raises(ValueError, match="one shape and dtype"):
        copy_rows(torch.empty(2, 3), torch.empty(3, 2))
    with pytest.raises(ValueError, match="one shape and dtype"):
        copy_rows(torch.empty(2, 3), torch.empty(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="needs CUDA tensors"):  # never handed to the driver
        copy_rows(torch.empty(2, 3), torch.empty(2, 3))


def test_plan_refuses_overlapping_rows():
    # An expanded (stride-0) source dim: rows overlap, so no single pitched copy; pieces or None.
    dst, src = torch.full((5, 3, D), float("nan")), numbered(1, 3, D).expand(5, 3, D)
    n = run_plan(dst, src)
    assert n == 5 and torch.equal(dst, src)


def test_copies_that_must_not_be_byte_copies_are_refused():
    # A lazily negated view: its bytes are the un-negated values, so only Tensor.copy_ is right.
    x = numbered(2, 3, D)
    assert _plan_copy(torch.empty(2, 3, D), torch._neg_view(x), 64) is None
    assert _plan_copy(torch.empty(2, 3, D), x, 64) is not None
    # A strided last dim would mean rows of one element: left to an SM copy.
    assert _plan_copy(torch.empty(7, 3, D), numbered(7, 3, 2 * D)[:, :, ::2], 64) is None


def test_refused_pieces_fall_back_to_tensor_copy(caplog):
    """A piece the driver refuses is copied with Tensor.copy_ (raising would leave this rank out of the
    copy-engine protocol while its peers wait at the next barrier), and the refusal is logged once."""
    import ctypes
    import logging

    from diffusers_sp import copy_engine

    srcs = [torch.arange(4 * 6 * 8, dtype=torch.float32).view(4, 6, 8) + 1000 * i for i in range(3)]
    dsts = [torch.zeros(4, 3, 8) for _ in range(3)]
    pieces = [p for d, s in zip(dsts, srcs) for p in _plan_copy(d, s[:, 2:5], 64)]
    assert len(pieces) == 3
    heights = []

    def driver_copy(spec, stream):  # accepts the first piece (and, being fake, copies nothing), refuses the rest
        heights.append(spec._obj.Height)
        return 0 if len(heights) == 1 else 1

    def driver_error(status, text):
        ctypes.cast(text, ctypes.POINTER(ctypes.c_char_p))[0] = b"invalid argument"
        return 0

    copy_engine._REFUSALS_LOGGED.discard(1)
    with caplog.at_level(logging.WARNING, logger="diffusers_sp"):
        copy_engine._issue(pieces, driver_copy, driver_error, None)
    assert heights == [4, 4, 4]
    assert torch.equal(dsts[0], torch.zeros(4, 3, 8))  # issued to the "driver": not copied again
    for d, s in zip(dsts[1:], srcs[1:]):
        assert torch.equal(d, s[:, 2:5])
    warnings = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(warnings) == 1 and "invalid argument" in warnings[0] and "error 1" in warnings[0]


@pytest.mark.parametrize("mode,kv_first,requested,expected", [
    ("kv_gather", False, "auto", "copy_engine"),  # K/V-gather without the K/V-first path pipelines on the copy engines
    ("kv_gather", True, "auto", "nccl"),  # with it (Wan), NCCL's all-gather runs under the query projection
    ("kv_gather", True, "copy_engine", "copy_engine"),  # asked for explicitly: still the copy engines
    ("ulysses", True, "auto", "copy_engine"),  # Ulysses keeps the copy engines either way
    ("ulysses", False, "auto", "copy_engine"),
    ("kv_gather", False, "nccl", "nccl"),
    ("vsa", False, "auto", "nccl"),
])
def test_auto_transport_rule(monkeypatch, mode, kv_first, requested, expected):
    """``sp_transport="auto"`` on one 2-rank group where the copy engines could run (faked here: CPU
    CI has no CUDA): K/V-gather takes NCCL only when the family's K/V-first path is on."""
    from types import SimpleNamespace

    import diffusers_sp.planning as planning

    monkeypatch.setattr(planning, "copy_engine_unavailable_reason", lambda group: None)
    monkeypatch.setattr(planning.dist, "get_world_size", lambda *a, **k: 2)
    group = SimpleNamespace(world_size=2, rank=0)
    traits = SimpleNamespace(name="WanPipeline", models=[SimpleNamespace(name="transformer", joint_text=None)])
    assert planning.resolve_transport(requested, mode, group, traits, kv_first=kv_first) == expected


def test_enable_passes_whether_the_kv_first_path_runs(monkeypatch):
    """``enable_sequence_parallel`` tells the transport rule whether the K/V-first path is on: Wan with
    ``overlap_query_projection`` (default True) yes, with it False no, a family without the path no."""
    import diffusers_sp.planning as planning
    from diffusers_sp import enable_sequence_parallel
    from diffusers_sp import tiny_models as tm

    seen = []
    real = planning.resolve_transport

    def spy(*args, **kwargs):
        seen.append(kwargs.get("kv_first"))
        return real(*args, **kwargs)

    monkeypatch.setattr(planning, "resolve_transport", spy)
    for model, options in ((tm.tiny_wan_transformer(), {}), (tm.tiny_wan_transformer(), {"overlap_query_projection": False}),
                           (tm.tiny_cogvideox_transformer(), {})):
        enable_sequence_parallel(model, mode="kv_gather", **options).disable()
    assert seen == [True, False, False]
