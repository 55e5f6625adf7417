"""torch.compile of a Wan transformer with diffusers-sp's processors installed (CPU).

* ``torch._dynamo.explain`` finds no graph break that the stock model does not have, for Ulysses
  and K/V-gather, at world size 1 (in this process) and 2 (gloo, functional collectives in the graph).
* ``torch.compile(model)`` gives the eager output.

* With CPU stand-ins for FlashAttention-4 and the Triton VSA kernel (tests/kernel_stand_ins.py), every
  mode (Ulysses, K/V-gather, hybrid, VSA) compiles the transformer blocks with ``fullgraph=True``
  (Diffusers' regional compilation) and the kernels run inside the compiled graphs as the custom
  operators ``diffusers_sp::fa4_attention``, ``fa4_key_padding_attention`` (ragged text) and
  ``vsa_fine_stage_triton``; the compiled output equals the eager one; the whole model traces
  without a graph break (the stock model has none either).

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
from kernel_stand_ins import FA4_DENSE_OP, FA4_VARLEN_OP, VSA_TRITON_OP, recording_backend, stand_in_kernels

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


# ---------------------------------------------------------------- the kernels inside compiled blocks

# mode -> the options it is enabled with, and the custom operator its self-attention runs as.
KERNEL_MODES = {"ulysses": ({}, FA4_DENSE_OP), "kv_gather": ({}, FA4_DENSE_OP),
                "hybrid": ({"ulysses_degree": 1}, FA4_DENSE_OP),
                "vsa": ({"vsa_sparsity": 0.5}, VSA_TRITON_OP)}


def _ragged_hunyuan():
    import families

    return families.forward_cases()["hunyuan_video_ragged_prompts"]()


def compiled_blocks(mode: str, make=None) -> dict:
    """With the kernels stood in for: the graph breaks of the whole model (``torch._dynamo.explain``),
    then eager against ``compile_repeated_blocks(fullgraph=True)``: the difference, the stand-ins' calls
    in each run, the operators in the compiled graphs, the handle's report. A graph break in a block
    raises (fullgraph) and is returned as ``error``."""
    from collections import Counter

    options, _ = KERNEL_MODES[mode]
    with stand_in_kernels() as calls:
        if make is None:
            model, inputs = _model(), _inputs()
        else:
            model, kwargs = make()
            inputs = dict(kwargs, return_dict=False)
        handle = enable_sequence_parallel(model, mode=mode, **options)
        out = {"kernel": handle.kernel_choice().name, "compiled_kernel": handle.kernel_choice(compiled=True).name}
        try:
            with torch.no_grad():
                # The whole model first (dynamo from the first call, no eager call before it), then the blocks.
                report = _explain(model, inputs)
                out.update(breaks=report.graph_break_count, reasons=_describe(report))
                calls.clear()
                eager = model(**inputs)[0]
                out["eager_calls"] = dict(calls)
                calls.clear()
                targets = Counter()
                model.compile_repeated_blocks(fullgraph=True, backend=recording_backend(targets))
                try:
                    compiled = model(**inputs)[0]
                except Exception as exc:  # noqa: BLE001 - reported by the test
                    return dict(out, error=f"{type(exc).__name__}: {str(exc)[:2000]}")
        finally:
            handle.disable()
        out.update(diff=float((compiled - eager).abs().max()), scale=float(eager.abs().max()),
                   compiled_calls=dict(calls), ops={t: n for t, n in targets.items() if t.startswith("diffusers_sp.")})
    return out


def kernel_problems(label: str, mode: str, r: dict, op: str | None = None) -> list[str]:
    """What is wrong with one :func:`compiled_blocks` result (empty when nothing is)."""
    op = op or KERNEL_MODES[mode][1]
    if "error" in r:
        return [f"{label}: compiling the blocks with fullgraph=True failed: {r['error']}"]
    problems = []
    if r["breaks"]:
        problems.append(f"{label}: {r['breaks']} graph breaks in the whole model:\n    " + "\n    ".join(r["reasons"]))
    if r["diff"] > TOL * max(r["scale"], 1.0):
        problems.append(f"{label}: compiled differs from eager by {r['diff']} (scale {r['scale']})")
    if not r["ops"].get(op):
        problems.append(f"{label}: {op} is not in the compiled graphs (custom operators there: {r['ops']})")
    stand_in = {FA4_DENSE_OP: "fa4_dense", FA4_VARLEN_OP: "fa4_varlen", VSA_TRITON_OP: "vsa_triton"}[op]
    if not r["compiled_calls"].get(stand_in) or r["compiled_calls"].get(stand_in) != r["eager_calls"].get(stand_in):
        problems.append(f"{label}: the kernel ran {r['compiled_calls']} compiled, {r['eager_calls']} eager")
    if op != VSA_TRITON_OP and (r["kernel"], r["compiled_kernel"]) != ("flash_attn_4", "flash_attn_4"):
        problems.append(f"{label}: the handle reports {r['kernel']} eager and {r['compiled_kernel']} compiled")
    return problems


@pytest.mark.parametrize("mode", list(KERNEL_MODES))
def test_kernels_run_inside_compiled_blocks(mode):
    r = compiled_blocks(mode)
    assert not kernel_problems(mode, mode, r), kernel_problems(mode, mode, r)


@pytest.mark.parametrize("mode", ["ulysses", "kv_gather"])
def test_key_padding_mask_runs_fa4_varlen_inside_compiled_blocks(mode):
    r = compiled_blocks(mode, make=_ragged_hunyuan)
    problems = kernel_problems(f"{mode} ragged text", mode, r, op=FA4_VARLEN_OP)
    assert not problems, problems


def test_without_the_kernels_the_handle_reports_sdpa_compiled_too():
    # No stand-ins: on CPU the choice is SDPA, eager and compiled alike.
    model = _model()
    handle = enable_sequence_parallel(model, mode="ulysses")
    try:
        assert handle.kernel_choice().name == handle.kernel_choice(compiled=True).name == "sdpa"
    finally:
        handle.disable()


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


def case_kernels_in_compiled_blocks():
    """Runs on every rank: :func:`compiled_blocks` for every mode, and the ragged-text model under K/V-gather."""
    out = {mode: compiled_blocks(mode) for mode in KERNEL_MODES}
    out["kv_gather ragged text"] = compiled_blocks("kv_gather", make=_ragged_hunyuan)
    return out


def test_distributed_compile(stock_report):
    from distributed import run_cases, values

    res = run_cases("test_compile", 2, cases=["explain_distributed", "kernels_in_compiled_blocks"], timeout=600)
    problems = []
    for rank, v in enumerate(values(res, "kernels_in_compiled_blocks")):
        for mode in KERNEL_MODES:
            problems += kernel_problems(f"rank {rank} {mode}", mode, v[mode])
        problems += kernel_problems(f"rank {rank} kv_gather ragged text", "kv_gather", v["kv_gather ragged text"],
                                    op=FA4_VARLEN_OP)
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


@pytest.mark.parametrize("mode", ["ulysses", "vsa"])
def test_compiled_kernels_across_shapes_and_with_gradients(mode):
    """One compiled model, the kernels stood in for: new latent sizes recompile and still run the kernel
    operators (equal to eager); with gradients on, the forward-only operators give way (FA4 to SDPA, the
    Triton fine stage to the reference) and the backward runs."""
    options, _ = KERNEL_MODES[mode]
    stand_in = "fa4_dense" if mode == "ulysses" else "vsa_triton"
    g = torch.Generator().manual_seed(1)
    with stand_in_kernels() as calls:
        model = _model()
        handle = enable_sequence_parallel(model, mode=mode, **options)
        try:
            compiled = torch.compile(model, backend="aot_eager")
            for frames, height, width in ((3, 6, 10), (2, 6, 10), (4, 8, 10)):
                inputs = dict(_inputs(), hidden_states=torch.randn(1, 16, frames, height, width, generator=g))
                with torch.no_grad():
                    eager = model(**inputs)[0]
                    calls.clear()
                    out = compiled(**inputs)[0]
                assert calls[stand_in] == 1, (frames, height, width, dict(calls))
                assert float((out - eager).abs().max()) <= TOL * max(float(eager.abs().max()), 1.0)
            calls.clear()
            compiled(**_inputs())[0].sum().backward()
            assert not calls, dict(calls)
            assert model.blocks[0].attn1.to_q.weight.grad.abs().sum() > 0
        finally:
            handle.disable()
