"""torch.compile of a Wan transformer with diffusers-sp's processors installed (CPU).

* ``torch._dynamo.explain`` finds no graph break that the stock model does not have, for Ulysses
  and K/V-gather, at world size 1 (in this process) and 2 (gloo, functional collectives in the graph).
* ``torch.compile(model)`` gives the eager output.

Dynamo traces from the first call after ``enable_sequence_parallel`` (no eager call first), as a user's
``torch.compile(pipe.transformer)`` right after enabling does: state cached on a first eager call must
not hide a break. On failure the message lists each break with the user frames that caused it; set
``TORCH_LOGS=graph_breaks`` for the full story.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffusers_sp import enable_sequence_parallel
from diffusers_sp.tiny_models import tiny_wan_transformer

MODES = ("ulysses", "kv_gather")
TOL = 1e-5  # float32, relative to the output's scale (DESIGN.md, Testing)


def _model():
    return tiny_wan_transformer(num_layers=1)


def _inputs():
    g = torch.Generator().manual_seed(0)
    # 3 x 3 x 5 = 45 tokens: uneven over 2 ranks.
    return dict(hidden_states=torch.randn(1, 16, 3, 6, 10, generator=g), timestep=torch.tensor([500.0]),
                encoder_hidden_states=torch.randn(1, 8, 32, generator=g), return_dict=False)


def _explain(model, inputs):
    torch._dynamo.reset()
    try:
        return torch._dynamo.explain(model)(**inputs)
    finally:
        torch._dynamo.reset()


def _describe(report) -> list[str]:
    """One line per recorded break: the reason and the innermost user frames."""
    lines = []
    for b in report.break_reasons:
        frames = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(b.user_stack[-5:]))
        lines.append(f"{b.reason.strip().splitlines()[0]} @ {frames}")
    return lines


def _compiled_vs_eager(model, inputs) -> tuple[float, float]:
    with torch.no_grad():
        eager = model(**inputs)[0]
        torch._dynamo.reset()
        try:
            compiled = torch.compile(model)(**inputs)[0]
        finally:
            torch._dynamo.reset()
    return float((compiled - eager).abs().max()), float(eager.abs().max())


@pytest.fixture(scope="module")
def stock_report():
    with torch.no_grad():
        return _explain(_model(), _inputs())


def test_stock_model_baseline(stock_report):
    # Not our code; recorded so that a Diffusers change shows up here rather than as "ours adds breaks".
    assert stock_report.graph_break_count == 0, _describe(stock_report)


@pytest.mark.parametrize("mode", MODES)
def test_ours_adds_no_graph_break(stock_report, mode):
    model, inputs = _model(), _inputs()
    handle = enable_sequence_parallel(model, mode=mode)
    try:
        with torch.no_grad():
            report = _explain(model, inputs)
    finally:
        handle.disable()
    assert report.graph_break_count <= stock_report.graph_break_count, (
        f"{mode}: {report.graph_break_count} graph breaks ({report.graph_count} graphs) against "
        f"{stock_report.graph_break_count} for the stock model:\n  " + "\n  ".join(_describe(report)))


@pytest.mark.parametrize("mode", MODES)
def test_compiled_equals_eager(mode):
    model, inputs = _model(), _inputs()
    handle = enable_sequence_parallel(model, mode=mode)
    try:
        diff, scale = _compiled_vs_eager(model, inputs)
    finally:
        handle.disable()
    assert diff <= TOL * max(scale, 1.0), (mode, diff, scale)


# ---------------------------------------------------------------- world size 2 (gloo), via tests/distributed.py


def case_explain_distributed():
    """Runs on every rank: compiled vs eager for each mode, then explain (its error, if any, is returned)."""
    out = {}
    for mode in MODES:
        model, inputs = _model(), _inputs()
        handle = enable_sequence_parallel(model, mode=mode)
        try:
            r = out[mode] = {}
            r["diff"], r["scale"] = _compiled_vs_eager(model, inputs)
            try:
                with torch.no_grad():
                    report = _explain(model, inputs)
                r.update(graphs=report.graph_count, breaks=report.graph_break_count, reasons=_describe(report))
                if mode == "kv_gather":
                    # Grad mode on (the inference-only guard, a
                    # Function whose backward raises, broke the graph at every layer).
                    report = _explain(model, inputs)
                    r.update(grad_breaks=report.graph_break_count, grad_reasons=_describe(report))
            except Exception as exc:  # noqa: BLE001 - reported by the test (identical on every rank)
                r["explain_error"] = f"{type(exc).__name__}: {exc}"
        finally:
            handle.disable()
    return out


def test_distributed_compile(stock_report):
    from distributed import run_cases, values

    res = run_cases("test_compile", 2, cases=["explain_distributed"], timeout=600)
    problems = []
    for rank, v in enumerate(values(res, "explain_distributed")):
        for mode in MODES:
            r = v[mode]
            if r["diff"] > TOL * max(r["scale"], 1.0):
                problems.append(f"rank {rank} {mode}: compiled differs from eager by {r['diff']} (scale {r['scale']})")
            if "explain_error" in r:
                problems.append(f"rank {rank} {mode}: torch._dynamo.explain raised {r['explain_error']}")
            elif r["breaks"] > stock_report.graph_break_count:
                problems.append(f"rank {rank} {mode}: {r['breaks']} graph breaks ({r['graphs']} graphs):\n    "
                                + "\n    ".join(r["reasons"]))
            elif r.get("grad_breaks", 0) > stock_report.graph_break_count:
                problems.append(f"rank {rank} {mode} with grad on: {r['grad_breaks']} graph breaks:\n    "
                                + "\n    ".join(r["grad_reasons"]))
    assert not problems, "\n".join(problems)
