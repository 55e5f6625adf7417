"""Sequence parallelism together with Diffusers' caches, CPU offloading, quantization, layerwise casting,
LoRA and IP-Adapter, CPU/gloo, against one process with the same setting.

The distributed cases run in one spawn per world size: tests/cases_combine.py at world sizes 2 and 3
(token counts 175 and 35 divide neither), the caches with CFG parallelism and replicas in
tests/cases_cfg.py at 2 and 4 (shared with test_cfg_parallel.py). The rest runs in this process.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from diffusers_sp import enable_sequence_parallel
from diffusers_sp.cfg_parallel import BATCHED_TOLERANCE
from diffusers_sp.tiny_models import tiny_wan_transformer
from distributed import FLOAT32_TOL as TOL, run_cases, values, within


def _needs(package: str):
    """Skips a test whose cases need ``package`` (in the ``test`` extra) when it is not installed."""
    return pytest.mark.skipif(importlib.util.find_spec(package) is None,
                              reason=f"{package} is not installed (pip install -e '.[test]')")


@pytest.fixture(scope="module", params=(2, 3), ids=lambda p: f"P{p}")
def results(request):
    return request.param, run_cases("cases_combine", request.param)


CACHES = ["wan_first_block", "wan_mag", "wan_sea", "wan_pyramid", "wan_taylorseer", "wan_faster",
          "flux_first_block", "flux_mag", "flux_sea", "flux_pyramid", "flux_taylorseer", "flux_faster"]
#: What diffusers-sp sets on a cache's objects while enabled (diffusers_sp.caches), per cache.
ADAPTED = {"first_block": [("FBCHeadBlockHook", "_should_compute_remaining_blocks")],
           "sea": [("SeaCacheRootHook", "raw_vision_callback"), ("SeaCacheSharedState", "resolve_gate")]}


@pytest.mark.parametrize("case", CACHES)
def test_cache_equals_one_process(results, case):
    """Same latents as one process with the same cache, and the same calls skipped (some, not all),
    with the cache enabled before (Ulysses) or applied after (K/V-gather) enabling; after disable()
    the cache works as the user left it, without diffusers-sp's attributes."""
    P, res = results
    cache = case.split("_", 1)[1]
    for rank, v in enumerate(values(res, case)):
        where = f"P={P} rank {rank} {case}"
        assert 0 < v["calls"] < v["total"], f"{where}: the configuration must skip some calls but not all: {v}"
        for mode in ("ulysses", "kv_gather"):
            assert within(v[mode], TOL), f"{where} {mode}: {v[mode]}"
            assert v[mode]["calls"] == v["calls"], f"{where} {mode}: other calls skipped than in one process: {v}"
        assert v["ulysses"]["adapted"] == ADAPTED.get(cache, []), f"{where}: {v['ulysses']['adapted']}"
        if "after_disable" in v:
            assert v["after_disable"]["equal"] and v["after_disable"]["calls"] == v["calls"], f"{where}: {v}"
            assert v["after_disable"]["left"] == [], f"{where}: {v['after_disable']}"


def test_cache_under_vsa(results):
    P, res = results
    for rank, v in enumerate(values(res, "wan_first_block_vsa")):
        where = f"P={P} rank {rank}"
        assert 0 < v["calls"] < v["total"], f"{where}: {v}"
        assert within(v["vsa"], TOL) and v["vsa"]["calls"] == v["calls"], f"{where}: {v}"
        assert v["vsa"]["adapted"] == ADAPTED["first_block"], f"{where}: {v}"


def test_mag_cache_calibration_ratios_cover_the_sequence(results):
    P, res = results
    out = values(res, "wan_mag_calibration")
    for rank, v in enumerate(out):
        assert v["adapted"] == [("MagCacheBlockHook", "_perform_calibration_step")]
        assert len(v["ref"]) == len(v["out"]) == 2  # "cond" and "uncond"
        for ref, got in zip(v["ref"], v["out"]):
            assert got == pytest.approx(ref, rel=1e-5), f"P={P} rank {rank}: {v}"
        assert v["out"] == out[0]["out"], f"P={P}: rank {rank} printed other ratios than rank 0"


@pytest.mark.parametrize("case", ["offload_model", "offload_sequential"])
def test_cpu_offload_either_order(results, case):
    """Two pipeline calls in a row (model offload re-wraps the transformer after each), with the
    offload enabled before and after sequence parallelism; disable() leaves the offload working."""
    P, res = results
    for rank, v in enumerate(values(res, case)):
        for key in ("before", "after"):
            for i, m in enumerate(v[key]):
                assert within(m, TOL), f"P={P} rank {rank} {case} {key} call {i}: {m}"
        assert v["before_disabled"]["equal"] and v["after_disabled"]["equal"], f"P={P} rank {rank} {case}: {v}"


@pytest.mark.parametrize("case,weight", [pytest.param("torchao_int8_through_config", "int8", marks=_needs("torchao")),
                                         pytest.param("torchao_float8_quantize", "float8", marks=_needs("torchao")),
                                         ("layerwise_casting", None)])
def test_quantized_and_cast_models(results, case, weight):
    P, res = results
    for rank, v in enumerate(values(res, case)):
        if weight is not None:  # a torchao tensor subclass (Int8Tensor, Float8Tensor in torchao 0.18)
            assert v["weight"].startswith("torchao.") and weight in v["weight"].lower(), f"P={P} rank {rank} {case}: {v}"
        for mode in ("ulysses", "kv_gather"):
            assert within(v[mode], TOL), f"P={P} rank {rank} {case} {mode}: {v[mode]}"
        assert v["restored"], f"P={P} rank {rank} {case}: disable() changed the output"
        if "cast_after_enable" in v:
            assert within(v["cast_after_enable"], TOL), f"P={P} rank {rank} {case}: {v}"


@_needs("peft")
def test_lora_loaded_fused_unloaded(results):
    P, res = results
    for rank, v in enumerate(values(res, "lora")):
        where = f"P={P} rank {rank}"
        assert v["lora_changes_output"], where
        for mode in ("ulysses", "kv_gather"):
            assert within(v["loaded_before"][mode], TOL), f"{where} {mode}: {v}"
        assert v["loaded_before"]["restored"], where
        for key in ("loaded_after", "fused_after", "unloaded_after"):
            assert within(v[key], TOL), f"{where} {key}: {v[key]}"


def test_ip_adapter(results):
    P, res = results
    for rank, v in enumerate(values(res, "ip_adapter")):
        where = f"P={P} rank {rank}"
        assert v["ip_tokens"] == (17 if P == 2 else 11), where  # the last rank's share of 35 image tokens
        assert v["ip_changes_output"], where
        for mode in ("ulysses", "kv_gather"):
            assert within(v[mode], TOL), f"{where} {mode}: {v}"
        assert v["restored"] and within(v["scale_set_while_enabled"], TOL), f"{where}: {v}"
        assert v["weights_still_registered"], where


def _same_everywhere(res, case) -> str:
    msgs = values(res, case)
    assert all(m == msgs[0] for m in msgs), msgs
    return msgs[0]


def test_refusals_same_on_every_rank(results):
    P, res = results
    for case in ("error_diffusers_parallelism_before", "error_diffusers_parallelism_after"):
        msg = _same_everywhere(res, case)
        assert "Diffusers' own parallelism" in msg and "Use one of the two" in msg, f"P={P} {case}: {msg}"
    msgs = _same_everywhere(res, "error_token_mixing_hooks")
    assert "AttentionProcessorSkipHook" in msgs["layer_skip"] and "skip_attention_scores" in msgs["layer_skip"]
    assert "SmoothedEnergyGuidanceHook" in msgs["seg"] and "mixes neighbouring tokens" in msgs["seg"]


# ------------------------------------------------- caches with CFG parallelism and replicas (cases_cfg.py)

@pytest.fixture(scope="module", params=(2, 4), ids=lambda p: f"P{p}")
def cfg_results(request):
    from cases_cfg import results as run_results

    return request.param, run_results(request.param)


@pytest.mark.parametrize("case,tol", [("cache_cfg_wan", TOL), ("cache_cfg_flux_true_cfg", TOL),
                                      ("cache_cfg_batched_cogvideox", BATCHED_TOLERANCE),
                                      ("cache_replicas_wan", TOL)])
def test_cache_with_cfg_parallelism_and_replicas(cfg_results, case, tol):
    P, res = cfg_results
    for rank, v in enumerate(values(res, case)):
        where = f"P={P} rank {rank} {case}"
        assert within(v["cmp"], tol), f"{where}: {v}"
        assert 0 < v["calls"] <= v["ref_calls"] < 2 * 6, f"{where}: {v}"  # some calls skipped, in one process too
        if case == "cache_cfg_batched_cogvideox" or case == "cache_replicas_wan":
            assert v["calls"] == v["ref_calls"], f"{where}: each rank computes what one process computes: {v}"
        if case == "cache_cfg_wan":
            assert v["stats"][0]["parallel"] == 6 and v["stats"][0]["missed"] == 0, f"{where}: {v}"


def test_cache_kept_across_cfg_passes_refused(cfg_results):
    P, res = cfg_results
    msg = _same_everywhere(res, "cache_cfg_refused")
    for when in ("at_enable", "at_call"):
        assert "PyramidAttentionBroadcastHook" in msg[when] and "cfg_parallel=False" in msg[when], msg
    assert "FasterCacheDenoiserHook" in msg["faster_batched"] and "whole CFG batch" in msg["faster_batched"], msg


# ------------------------------------------------------------------------------------ in this process

def _kwargs():
    g = torch.Generator().manual_seed(0)
    return dict(hidden_states=torch.randn(1, 16, 5, 10, 14, generator=g), timestep=torch.tensor([500.0]),
                encoder_hidden_states=torch.randn(1, 7, 32, generator=g))


def test_one_rank_leaves_caches_alone():
    """At world size 1 nothing is reduced: Diffusers' own First Block Cache method runs (so the decision is
    bitwise one process's); the cache hooks carry no attribute of ours, before or after disable()."""
    from diffusers import FirstBlockCacheConfig

    model = tiny_wan_transformer()
    model.enable_cache(FirstBlockCacheConfig(threshold=0.05))
    handle = enable_sequence_parallel(model, mode="kv_gather")
    head = model.blocks[0]._diffusers_hook.hooks["fbc_leader_block_hook"]
    assert "_should_compute_remaining_blocks" not in vars(head)
    handle.disable()
    model.disable_cache()


def test_forward_chain_innermost_under_caches_and_accelerate():
    """A hook placed with register_innermost sits below a cache's hook and inside Accelerate's wrapper:
    Accelerate's remove_hook_from_module (what enable_model_cpu_offload does after every call) keeps
    it, and unregister takes it out from under the cache's new_forward hook without dropping that hook
    (Diffusers' own remove_hook rewires the outer hook's forward, not its original_forward)."""
    from accelerate.hooks import ModelHook as AccelerateHook
    from accelerate.hooks import add_hook_to_module, remove_hook_from_module
    from diffusers.hooks import HookRegistry, ModelHook

    from diffusers_sp.forward_chain import register_innermost, unregister

    calls = []

    class Outer(ModelHook):
        def new_forward(self, module, *args, **kwargs):
            calls.append("outer")
            return self.fn_ref.original_forward(*args, **kwargs)

    class Inner(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            calls.append("inner")
            return args, kwargs

    model = torch.nn.Linear(3, 3)
    x = torch.randn(2, 3)
    ref = model(x)
    add_hook_to_module(model, AccelerateHook())
    HookRegistry.check_if_exists_or_initialize(model).register_hook(Outer(), "cache")
    register_innermost(model, Inner(), "ours")
    assert torch.equal(model(x), ref) and calls == ["outer", "inner"]
    assert model._diffusers_hook._hook_order == ["ours", "cache"]
    remove_hook_from_module(model)  # drops whatever sits above Accelerate's wrapper: the cache's hook
    calls.clear()
    assert torch.equal(model(x), ref) and calls == ["inner"]

    model = torch.nn.Linear(3, 3)
    ref = model(x)
    wrapped = register_innermost(model, Inner(), "ours")
    HookRegistry.check_if_exists_or_initialize(model).register_hook(Outer(), "cache")  # a cache enabled afterwards
    unregister(model, "ours", wrapped)
    calls.clear()
    assert torch.equal(model(x), ref) and calls == ["outer"]
    assert model._diffusers_hook._hook_order == ["cache"]


def test_ip_adapter_weights_stay_registered():
    """An IP-Adapter processor (an nn.Module with the image-prompt projections) stays the attention
    module's child while wrapped: .to(), state_dict() and offloading still reach its weights under
    their own names; disable() puts it back as the processor."""
    from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor

    from diffusers_sp.tiny_models import tiny_flux_transformer

    model = tiny_flux_transformer()
    processor = FluxIPAdapterAttnProcessor(hidden_size=48, cross_attention_dim=8, num_tokens=(4,))
    model.transformer_blocks[0].attn.set_processor(processor)
    keys = set(model.state_dict())
    handle = enable_sequence_parallel(model, mode="kv_gather")
    attn = model.transformer_blocks[0].attn
    assert attn.processor is not processor and attn.processor.inner is processor
    assert set(model.state_dict()) == keys
    handle.disable()
    assert attn.processor is processor and set(model.state_dict()) == keys


def test_unload_ip_adapter_while_enabled_is_refused_at_the_next_forward():
    """unload_ip_adapter() builds new processors of the classes it finds: with the model's own processors
    put in place for the call it works, and the next forward refuses the replaced processors until
    sequence parallelism is enabled again."""
    from diffusers.models.embeddings import ImageProjection, MultiIPAdapterImageProjection
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor, FluxIPAdapterAttnProcessor

    from diffusers_sp import SequenceParallelConfigError
    from diffusers_sp.tiny_models import tiny_flux_pipeline

    pipe = tiny_flux_pipeline()
    model = pipe.transformer
    model.transformer_blocks[0].attn.set_processor(
        FluxIPAdapterAttnProcessor(hidden_size=48, cross_attention_dim=8, num_tokens=(4,)))
    model.encoder_hid_proj = MultiIPAdapterImageProjection(
        [ImageProjection(image_embed_dim=8, cross_attention_dim=8, num_image_text_embeds=4)])
    handle = enable_sequence_parallel(pipe, mode="kv_gather")
    pipe.unload_ip_adapter()
    assert type(model.transformer_blocks[0].attn.processor) is FluxAttnProcessor
    with pytest.raises(SequenceParallelConfigError, match="unload_ip_adapter"):
        pipe(prompt="a cat", height=10, width=14, max_sequence_length=8, num_inference_steps=1, output_type="latent")
    handle.disable()
    enable_sequence_parallel(pipe, mode="kv_gather").disable()
