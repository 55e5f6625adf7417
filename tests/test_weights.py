"""Weight sharding (``shard_weights=True``, FSDP2) against replicated weights, CPU/gloo, world sizes 2, 3, 4.

Every mode gives the replicated output (the all-gathered weights are the same numbers; at 4 ranks
Ulysses and the layouts that need four ranks), on the first and a second call; each rank holds about 1/N
of every transformer's and text encoder's parameters before and after a call (FSDP's shards are rows of
each parameter, so small ones round up: at most SHARE_SLACK x 1/N); ``disable()`` gives back the original
whole parameters and classes; bad values and refused combinations raise alike on every rank. One spawn per
world size (tests/cases_weights.py).
"""

from __future__ import annotations

import functools

import pytest

from distributed import run_cases, values, within

#: Bytes a rank may hold of each sharded module, as a multiple of 1/N of the whole: FSDP shards each
#: parameter by rows and pads the last shard, which tiny models' small parameters feel.
SHARE_SLACK = 1.15


#: The cases of the four-rank spawn: the layouts that need four ranks (CFG parallelism cfg 2 x sp 2, hybrid
#: ulysses 2 x kv_gather 2, two replicas of sp 2), Ulysses, the bare transformer and the refusals; every other
#: case runs at 2 and 3 ranks (4 processes on CI's two cores are the slowest spawn of this module).
FOUR_RANK_CASES = ("wan_ulysses", "wan_cfg_parallel", "wan_hybrid", "wan_replicas", "bare_transformer", "bad_value",
                   "group_offloading_refused", "still_usable_after_refusal")


@functools.lru_cache(maxsize=None)
def _run(P: int) -> dict:
    return run_cases("cases_weights", P, list(FOUR_RANK_CASES) if P == 4 else None)


@pytest.fixture(scope="module", params=(2, 3, 4), ids=lambda p: f"P{p}")
def results(request):
    return request.param, _run(request.param)


#: (world size, case): every mode at 2 and 3 ranks (Ulysses on the 3-head Flux too), with First Block Cache, a
#: caller's process_group, Wan 2.2's two transformers and the parallel VAE; Ulysses, CFG parallelism, hybrid and
#: two replicas of sp 2 at 4.
CASES = ([(P, case) for P in (2, 3) for case in ("wan_ulysses", "wan_kv_gather", "wan_vsa", "flux_kv_gather",
                                                 "flux_ulysses", "wan_first_block_cache", "wan_process_group",
                                                 "wan22_two_transformers", "wan_parallel_vae")]
         + [(4, case) for case in FOUR_RANK_CASES[:4]])


@pytest.mark.parametrize("P,case", CASES, ids=[f"P{P}-{c}" for P, c in CASES])
def test_sharded_weights_give_the_replicated_output(P, case):
    res = _run(P)
    for rank, v in enumerate(values(res, case)):
        for key in ("cmp", "cmp2", "again"):
            assert within(v[key]), f"P={P} rank {rank} {case} {key}: {v[key]}"
        N = v["fsdp_group"]
        assert N == (P // 2 if case in ("wan_cfg_parallel", "wan_replicas") else P), v["fsdp_group"]
        for name, total in v["full"].items():
            for when in ("before", "after"):
                held = v[when][name]
                share = (P if name.startswith("text_encoder") and case != "wan_replicas" else N)
                assert held <= SHARE_SLACK * total / share, f"P={P} rank {rank} {case} {name} {when}: {held} of {total}"
        assert v["restored"], f"P={P} rank {rank} {case}: disable() did not give back the original parameters"
        assert not any(c.startswith("FSDP") for c in v["classes"].values()), v["classes"]


def test_bad_value_refused_alike(results):
    P, res = results
    msgs = values(res, "bad_value")
    assert len(set(msgs)) == 1 and "shard_weights must be True" in msgs[0] and "'yes'" in msgs[0], msgs


def test_group_offloading_refused_alike(results):
    P, res = results
    msgs = values(res, "group_offloading_refused")
    assert len(set(msgs)) == 1 and "group offloading" in msgs[0] and "shard_weights=False" in msgs[0], msgs


def test_usable_after_refusals(results):
    P, res = results
    assert all(shape[0] == 1 for shape in values(res, "still_usable_after_refusal"))


def test_no_case_raised(results):
    P, res = results
    for name, per_rank in res.items():
        assert all(r[0] == "ok" for r in per_rank), f"P={P} {name}: {[r[1] for r in per_rank if r[0] != 'ok']}"


@pytest.mark.parametrize("P", (2, 3), ids=lambda p: f"P{p}")
@pytest.mark.parametrize("case", ["wan_loaded_for_sharding", "flux_loaded_for_sharding"])
def test_loaded_for_sharding_equals_from_pretrained(P, case):
    """load_pipeline_for_sharding leaves the transformer and text encoders empty (meta) until
    shard_weights=True reads each rank's shards: the output equals the pipeline loaded whole, and
    enabling without shard_weights is refused alike on every rank."""
    res = _run(P)
    for rank, v in enumerate(values(res, case)):
        assert within(v["cmp"]) and v["meta_before"] > 0, f"P={P} rank {rank} {case}: {v}"
        assert "shard_weights=True" in v["refused"] and "load_pipeline_for_sharding" in v["refused"], v["refused"]
        for name, total in v["full"].items():
            assert v["held"][name] <= SHARE_SLACK * total / P, f"P={P} rank {rank} {case} {name}: {v}"


@pytest.mark.parametrize("P", (2, 3), ids=lambda p: f"P{p}")
def test_lora_before_and_after_enabling(P):
    """LoRA with sharded weights, loaded before enabling and while enabled (the second enable of the
    same pipeline works: disable() leaves no FSDP state behind), equals the replicated pipeline."""
    res = _run(P)
    for rank, v in enumerate(values(res, "wan_lora")):
        assert within(v["before"]) and within(v["after"]), f"P={P} rank {rank}: {v}"


@pytest.mark.parametrize("kind", ["torchao", "layerwise_casting"])
def test_quantized_or_cast_weights_refused(kind):
    """Weights FSDP2 cannot all-gather as they are (torchao's quantized tensors) or that a hook re-casts
    around every forward (layerwise casting) are refused by the check every rank runs before any
    collective, with what would work."""
    import torch

    from diffusers_sp import SequenceParallelConfigError
    from diffusers_sp.tiny_models import tiny_wan_transformer
    from diffusers_sp.weights import check_shardable

    model = tiny_wan_transformer()
    if kind == "torchao":
        pytest.importorskip("torchao")
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        quantize_(model, Int8WeightOnlyConfig())
        expected = "quantized"
    else:
        model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
        expected = "layerwise casting"
    with pytest.raises(SequenceParallelConfigError, match=f"{expected}.*shard_weights=False"):
        check_shardable("WanPipeline", [("transformer", model)])


def test_bare_transformer(results):
    P, res = results
    for rank, v in enumerate(values(res, "bare_transformer")):
        assert within(v["cmp"]) and within(v["again"]), f"P={P} rank {rank}: {v}"
        assert v["held"][""] <= SHARE_SLACK * v["full"] / P, v
