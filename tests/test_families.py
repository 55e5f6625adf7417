"""Every family under sequence parallelism equals one process (float32, CPU/gloo, P = 2, 3).

Each world size spawns its processes once and runs the cases of tests/cases_families.py inside them:
the joint-attention strategies on raw tensors, every forward of the tiny family configs in
tests/families/ (a batch of two prompts of different lengths where the family takes a text mask) and
the errors at both world sizes, and every pipeline, classic and modular, at P = 3.
"""

from __future__ import annotations

import functools
import importlib

import pytest

import families
from distributed import assert_close, case_names, run_cases, values

WORLD_SIZES = (2, 3)
MODES = ("ulysses", "kv_gather")
TOKENS = families.TOKENS  # image/video tokens of the forward cases (unless a Forward says): divides neither 2 nor 3
FORWARDS = tuple(families.forward_cases())
FORWARD_SPECS = families.forward_specs()
PIPELINES = families.pipeline_cases()
MODULAR = families.modular_cases()


#: The world size of the pipeline cases (classic and modular): a whole pipeline call per mode is most of a
#: spawn's time, and the sharding it exercises is the forwards', which run at every world size; 3 divides neither
#: the tokens nor most tiny configs' head counts.
PIPELINE_WORLD_SIZE = 3


@functools.lru_cache(maxsize=None)
def _run(P: int) -> dict:
    cases = None
    if P != PIPELINE_WORLD_SIZE:
        cases = [n for n in case_names(importlib.import_module("cases_families"))
                 if not n.startswith(("pipeline_", "modular_"))]
    return run_cases("cases_families", P, cases)


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda p: f"P{p}")
def results(request):
    return request.param, _run(request.param)


@pytest.mark.parametrize("case", ["prefix_bool_mask", "suffix_float_mask", "suffix_per_head_mask",
                                  "one_text_token_no_mask", "no_text"])


def test_joint_attention_strategies_exact(results, case):
    P, res = results
    for rank, v in enumerate(values(res, f"functional_{case}")):
        for mode in MODES:
            assert_close(v[mode], f"P={P} rank {rank} {case} {mode}")
            assert_close(v[f"{mode} start/finish"], f"P={P} rank {rank} {case} {mode} start/finish")


def test_grid_window_equals_the_whole_grid(results):
    P, res = results
    for rank, v in enumerate(values(res, "functional_grid_window")):
        for grid, metrics in v.items():
            assert_close(metrics, f"P={P} rank {rank} grid {grid}")


def test_linear_attention_sums_all_reduced(results):
    P, res = results
    per_rank = values(res, "functional_linear_attention")
    assert len({v["softmax_error"] for v in per_rank}) == 1
    for rank, v in enumerate(per_rank):
        assert_close(v["linear"], f"P={P} rank {rank} linear attention")
        assert "softmax attention call" in v["softmax_error"], v["softmax_error"]


def test_whole_queries_over_split_keys_exact(results):
    P, res = results
    per_rank = values(res, "functional_split_kv")
    assert len({v["wrong_length"] for v in per_rank}) == 1
    for rank, v in enumerate(per_rank):
        for mask in ("none", "bool_key_padding", "float_per_query", "bool_per_head"):
            assert_close(v[mask], f"P={P} rank {rank} split K/V {mask}")
        assert "this rank's shard" in v["wrong_length"], v["wrong_length"]


@pytest.mark.parametrize("case", ["bool_prefix", "float_suffix"])
def test_padding_mask_over_queries_and_keys_exact(results, case):
    """M[q, k] = m[q] and m[k] (CogView4's attention_mask, in its float form) runs exactly instead of
    being refused as query-dependent."""
    P, res = results
    for rank, v in enumerate(values(res, f"functional_padding_both_sides_{case}")):
        for mode in MODES:
            assert_close(v[mode], f"P={P} rank {rank} {case} {mode}")


@pytest.mark.parametrize("side", ["prefix", "suffix"])
def test_joint_sequence_plan_entries_exact(results, side):
    """Text joined to the split sequence inside a model's forward (JointSequence plan entries): the
    sequence part is split and gathered, the text part stays whole and in place; a family hook runs
    before the plan's splits on its module."""
    P, res = results
    for rank, v in enumerate(values(res, f"joint_sequence_plan_{side}")):
        assert v["equal"], f"P={P} rank {rank} {side}: {v}"
        assert v["family_hook"]["equal"], f"P={P} rank {rank} {side} with a family hook: {v}"
        assert v["seq_len"] == TOKENS
        assert "no split of this forward has set the sequence length" in v["no_earlier_split"], v


@pytest.mark.parametrize("case", ["block_causal_mask_no_text", "block_causal_mask_prefix", "outer_float_mask_prefix",
                                  "per_head_mask_suffix", "key_padding_mask_suffix"])
def test_full_sequence_masks_exact(results, case):
    """Masks a model builds over the full sequence before its split (query-dependent ones included)."""
    P, res = results
    for rank, v in enumerate(values(res, f"functional_full_{case}")):
        for mode in MODES:
            assert_close(v[mode], f"P={P} rank {rank} {case} {mode}")


def test_gather_input_for_a_submodule_that_needs_every_token(results):
    P, res = results
    for rank, v in enumerate(values(res, "functional_gather_input")):
        for order in ("token order", "permuted"):
            assert_close(v[order], f"P={P} rank {rank} {order}")


@pytest.mark.parametrize("case", FORWARDS)
def test_transformer_forward_equals_one_process(results, case):
    """Dense modes equal one process; VSA (where a case asks for it) equals VSA on one rank."""
    P, res = results
    for rank, v in enumerate(values(res, f"transformer_{case}")):
        for key in families.result_keys(FORWARD_SPECS[case].modes):
            assert_close(v[key], f"P={P} rank {rank} {case} {key}")
            assert v[key]["resolved"] == key.partition("/")[0]
            assert v[key]["seq_len"] == FORWARD_SPECS[case].tokens, "the forward did not run split"
            assert v[key]["wrapped"] >= 2
        assert v["restored_bitwise"], f"P={P} rank {rank}: disable did not restore the outputs bit for bit"


#: Every pipeline case: the classic pipelines and the modular ones (a Diffusers modular pipeline built from the
#: tiny components of a classic case), by their case name in tests/cases_families.py.
PIPELINE_CASES = {f"pipeline_{name}": spec for name, spec in PIPELINES.items()} | \
                 {f"modular_{name}": spec for name, spec in MODULAR.items()}


@pytest.mark.parametrize("case", tuple(PIPELINE_CASES))
def test_pipeline_equals_one_process(case):
    P, res = PIPELINE_WORLD_SIZE, _run(PIPELINE_WORLD_SIZE)
    spec = PIPELINE_CASES[case]
    for rank, v in enumerate(values(res, case)):
        for mode in spec.modes:
            assert_close(v[mode], f"P={P} rank {rank} {case} {mode}")
            assert v[mode]["seq_len"] == spec.tokens, "the transformer did not run split as expected"


REFUSED = [(f"refused_forward_{name}", spec.match) for name, spec in families.refused_forwards().items()] + \
          [(f"refusal_{name}", spec.match) for name, spec in families.refusal_cases().items()]


@pytest.mark.parametrize("case,match", REFUSED, ids=[case for case, _ in REFUSED])
def test_refused_pipeline_or_forward_refused_alike_on_every_rank(results, case, match):
    P, res = results
    msgs = values(res, case)
    assert len(set(msgs)) == 1, msgs
    assert msgs[0] != "no error" and match in msgs[0], msgs[0]


def test_inner_pipelines_agree_after_rng_drift(results):
    P, res = results
    for rank, v in enumerate(values(res, "rng_drift_inner_pipelines")):
        assert_close(v, f"P={P} rank {rank} VisualClozePipeline, stochastic scheduler after RNG drift")


def test_query_dependent_mask_raises_on_every_rank(results):
    P, res = results
    msgs = values(res, "error_query_dependent_mask")
    for mode in MODES:
        per_rank = {m[mode] for m in msgs}
        assert len(per_rank) == 1, per_rank
        msg = per_rank.pop()
        assert "depends on the query position" in msg and "key padding" in msg, msg


def test_vsa_refuses_a_query_dependent_mask_on_every_rank(results):
    P, res = results
    msgs = values(res, "error_vsa_with_block_causal_mask")
    assert len(set(msgs)) == 1, msgs
    assert "VSA supports video self-attention without text tokens or masks" in msgs[0], msgs[0]
    assert "an attention mask" in msgs[0] and "'kv_gather'" in msgs[0], msgs[0]


def test_cp_plan_path_refuses_text_in_a_marked_call(results):
    P, res = results
    got = values(res, "error_cp_plan_text_in_marked_call")
    assert got[0]["family"] == "cp_plan:Flux2WithoutFamily"
    for mode in MODES:
        msgs = {v[mode] for v in got}
        assert len(msgs) == 1, msgs  # the same on every rank
        msg = msgs.pop()
        assert "Flux2WithoutFamily: Flux2AttnProcessor" in msg and "also holds 8 other tokens" in msg, msg
        assert f"35 tokens over {P} ranks" in msg and "its Diffusers _cp_plan lacks" in msg, msg


def test_fewer_heads_than_ranks(results):
    P, res = results
    for v in values(res, "error_ulysses_fewer_heads_than_ranks"):
        assert "kv_gather" in v["ulysses_error"] and "1 heads" in v["ulysses_error"]
        assert v["auto"]["resolved"] == "kv_gather"
        assert_close(v["auto"], f"P={P} auto with 1 head")


def test_copy_engine_transport_refused_on_gloo(results):
    P, res = results
    per_rank = values(res, "error_copy_engine_on_gloo")
    assert len({v["error"] for v in per_rank}) == 1 and len({v["joint_text_error"] for v in per_rank}) == 1
    for rank, v in enumerate(per_rank):
        assert "sp_transport='copy_engine' cannot run here" in v["error"], v["error"]
        assert "not NCCL" in v["error"] or "CUDA is not available" in v["error"], v["error"]
        assert "joint text" in v["joint_text_error"] and "mode='kv_gather'" in v["joint_text_error"], v
        assert v["auto"]["transport"] == "gloo"  # the backend that runs
        assert_close(v["auto"], f"P={P} rank {rank} kv_gather with sp_transport='auto' on gloo")


def test_head_groups_must_agree_across_ranks(results):
    P, res = results
    msgs = values(res, "error_head_groups_disagree")
    assert len(set(msgs)) == 1
    assert "ranks disagree" in msgs[0], msgs[0]
    assert "overlap_head_groups: rank 0 " in msgs[0], msgs[0]  # names the option that differs


def test_rank_outside_the_passed_group_is_told_so(results):
    P, res = results
    got = values(res, "error_not_a_group_member")
    assert got[0] == {"world_size": 1}
    for rank, v in enumerate(got[1:], start=1):
        assert "is not a member of the process_group" in v["error"], (rank, v)
        assert f"global rank {rank}" in v["error"], (rank, v)


def test_processor_replaced_after_enable_raises(results):
    P, res = results
    for rank, v in enumerate(values(res, "error_processor_replaced")):
        assert "was replaced after enable_sequence_parallel" in v["error"], (rank, v["error"])
        assert "FusedCogVideoXAttnProcessor2_0" in v["error"], v["error"]
        assert_close(v["fused_before_enable"], f"P={P} rank {rank}: fused before enabling")
        assert_close(v["after_disable"], f"P={P} rank {rank}: after disable, fused")
        assert_close(v["after_unfuse"], f"P={P} rank {rank}: after disable, unfused")
        assert v["leftover"] == [], v["leftover"]


def test_helios_pyramid_block_noise_is_drawn():
    """The tiny HeliosPyramidPipeline's block noise (a float32 Cholesky factorisation of
    ``(1 + gamma) I - gamma 11^T``) is drawn on any CPU and BLAS build: with the scheduler's default
    ``gamma = 1/3`` that covariance is singular and the factorisation failed on some machines."""
    import torch

    from families import helios

    pipe = helios.tiny_helios_pyramid_pipeline()
    gamma = pipe.scheduler.config.gamma
    cov = torch.eye(4) * (1 + gamma) - torch.ones(4, 4) * gamma
    assert torch.linalg.eigvalsh(cov).min() > 0.1
    noise = pipe.sample_block_noise(1, 4, 2, 4, 6, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(noise).all()
