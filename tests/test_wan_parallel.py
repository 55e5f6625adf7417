"""Wan under sequence parallelism equals one process (float32, CPU/gloo, world sizes 2, 3, 4).

Each world size spawns its processes once and runs every case of tests/cases_wan.py inside them.
"""

from __future__ import annotations

import pytest
import torch

from distributed import assert_close, run_cases, values

WORLD_SIZES = (2, 3, 4)


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda p: f"P{p}")
def results(request):
    return request.param, run_cases("cases_wan", request.param)


@pytest.mark.parametrize("case", ["transformer_t2v", "transformer_uneven_heads",
                                  "transformer_ti2v_per_token_timesteps", "transformer_i2v_image_context"])
def test_transformer_forward_equals_one_process(results, case):
    P, res = results
    for rank, v in enumerate(values(res, case)):
        for mode in ("ulysses", "kv_gather"):
            assert_close(v[mode], f"P={P} rank {rank} {case} {mode}")
            assert v[mode]["resolved"] == mode
        assert v["restored_bitwise"], f"P={P} rank {rank}: disable did not restore the outputs bit for bit"


@pytest.mark.parametrize("case,modes,transformers", [
    ("pipeline_t2v_latent", ("ulysses", "kv_gather"), 1),
    ("pipeline_t2v_decoded", ("kv_gather",), 1),
    ("pipeline_i2v", ("ulysses", "kv_gather"), 1),
    ("pipeline_wan22_two_transformers", ("ulysses", "kv_gather"), 2),
    ("pipeline_ti2v", ("ulysses",), 1),
])
def test_pipeline_equals_one_process(results, case, modes, transformers):
    P, res = results
    for rank, v in enumerate(values(res, case)):
        for mode in modes:
            assert_close(v[mode], f"P={P} rank {rank} {case} {mode}")
            assert v[mode]["transformers"] == transformers


def test_random_draws_agree_across_ranks(results):
    P, res = results
    vals = values(res, "random_draws_agree")
    for v in vals[1:]:
        assert torch.equal(v["latents"], vals[0]["latents"])
        assert torch.equal(v["after"], vals[0]["after"])


@pytest.mark.parametrize("case,needles", [
    ("error_ulysses_too_few_heads", ["WanTransformer3DModel", "1 heads", "kv_gather"]),
    ("error_unknown_mode", ["'ring'", "'ulysses'", "'kv_gather'"]),
    ("error_vsa_bad_sparsity", ["vsa_sparsity", "[0, 1)", "1.5"]),
    ("error_unknown_option", ["sparsity", "attention_kernel"]),
    ("error_already_enabled", ["already enabled", "disable_sequence_parallel"]),
    ("error_unsupported_model", ["AutoencoderKLWan", "WanPipeline", "WanTransformer3DModel"]),
    ("error_bad_process_group", ["ProcessGroup"]),
])
def test_errors_raised_identically_on_every_rank(results, case, needles):
    P, res = results
    msgs = values(res, case)
    assert len(set(msgs)) == 1, f"ranks disagree: {msgs}"
    assert msgs[0] != "no error", f"{case} did not raise"
    for needle in needles:
        assert needle in msgs[0], f"{needle!r} not in {msgs[0]!r}"


def test_group_usable_after_errors(results):
    P, res = results
    for v in values(res, "group_usable_after_errors"):
        assert v["sum"] == P * (P + 1) / 2
        assert_close(v["forward"]["kv_gather"], "forward after errors")
