"""Modular pipelines (Diffusers' ModularPipeline) under sequence parallelism against one process,
CPU/gloo, world sizes 2 and 3 (one spawn each: tests/cases_modular.py)."""

from __future__ import annotations

import pytest

from distributed import assert_close, run_cases, values


@pytest.fixture(scope="module", params=(2, 3), ids=lambda p: f"P{p}")
def results(request):
    return request.param, run_cases("cases_modular", request.param)


@pytest.mark.parametrize("case", ["ulysses", "kv_gather", "shard_weights"])
def test_modular_wan_equals_one_process(results, case):
    P, res = results
    for rank, v in enumerate(values(res, case)):
        for key in ("cmp", "cmp2", "again"):
            assert_close(v[key], f"P={P} rank {rank} {case} {key}")
        assert v["world_size"] == P and v["sharded"] == (case == "shard_weights"), v


def test_modular_wan_variants_equal_one_process(results):
    """Wan 2.2 (two experts: both transformers split), Wan 2.1 and 2.2 image-to-video."""
    P, res = results
    for rank, v in enumerate(values(res, "variants")):
        assert len(v) == 6, sorted(v)
        for name, got in v.items():
            for key in ("cmp", "cmp2", "again"):
                assert_close(got[key], f"P={P} rank {rank} {name} {key}")
            assert got["transformers"] == (2 if "Wan22" in name else 1), (name, got)


def test_modular_cfg_parallel_refused_alike(results):
    P, res = results
    msgs = values(res, "cfg_parallel_refused")
    assert len(set(msgs)) == 1 and "cache_context" in msgs[0] and "cfg_parallel=False" in msgs[0], msgs
