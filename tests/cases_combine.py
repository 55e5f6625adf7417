"""Cases run on every rank by tests/test_combine.py (see tests/distributed.py): sequence parallelism
together with Diffusers' caches, CPU offloading, quantization, layerwise casting, LoRA and IP-Adapter,
each against one process with the same setting; and the combinations that are refused.

Caches. Every cache runs on a tiny Wan pipeline (175 latent tokens, CFG on: two transformer calls
per step) and on a tiny Flux pipeline (35 image tokens, joint attention; SeaCache, which needs the
step and sigma in the cache context that FluxPipeline does not pass, runs a short denoising loop of
its own there), in both dense modes: Ulysses with the cache enabled before
``enable_sequence_parallel`` (``transformer.enable_cache``), K/V-gather with it applied afterwards
(the ``apply_*`` function). Each case returns, per run, the comparison with the one-process latents
and the number of calls in which the cached module was computed (the configurations skip some calls
but not all). After ``disable()`` the cache stays and the pipeline's output is the one-process
output again. The caches with CFG parallelism and replicas run in tests/cases_cfg.py (world sizes 2
and 4).
"""

from __future__ import annotations

import functools

import torch

from diffusers_sp import enable_sequence_parallel
from diffusers_sp.tiny_models import tiny_flux_pipeline, tiny_flux_transformer, tiny_wan_pipeline

from distributed import compare, error_of

STEPS = 6
WAN_CALL = dict(prompt="a cat runs on the grass", negative_prompt="rain", height=80, width=112, num_frames=17,
                guidance_scale=5.0, num_inference_steps=STEPS, output_type="latent")
FLUX_CALL = dict(prompt="a cat runs on the grass", height=10, width=14, max_sequence_length=8, guidance_scale=3.5,
                 num_inference_steps=STEPS, output_type="latent")


@functools.lru_cache(maxsize=None)
def _pipe(family: str):
    pipe = tiny_wan_pipeline("t2v") if family == "wan" else tiny_flux_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _config(name: str, family: str, pipe):
    """A fresh cache config (Diffusers' apply functions write callbacks into the config they get)."""
    from diffusers import (FasterCacheConfig, FirstBlockCacheConfig, MagCacheConfig, PyramidAttentionBroadcastConfig,
                           TaylorSeerCacheConfig)

    timestep = lambda: pipe.current_timestep  # noqa: E731
    if name == "first_block":
        # Ratios of the tiny models' first-block residual changes lie at 0.08-0.10 and 0.13-0.14 (Wan),
        # 0.37-0.40 and 0.55-0.59 (Flux): these thresholds skip about half of the calls, far from a tie.
        return FirstBlockCacheConfig(threshold=0.12 if family == "wan" else 0.45)
    if name == "mag":
        return MagCacheConfig(threshold=0.06, max_skip_steps=1, retention_ratio=0.2, num_inference_steps=STEPS,
                              mag_ratios=[1.0] * STEPS)
    if name == "pyramid":
        return PyramidAttentionBroadcastConfig(spatial_attention_block_skip_range=2,
                                               spatial_attention_timestep_skip_range=(-1, 1001),
                                               current_timestep_callback=timestep)
    if name == "taylorseer":
        # Diffusers' default identifiers ("^blocks.*attn", full match) miss Wan's attn1 / attn2.
        return TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=2, taylor_factors_dtype=torch.float32,
                                     cache_identifiers=[r"blocks\.\d+\.attn1"] if family == "wan" else None)
    if name == "faster":
        # is_guidance_distilled: these pipelines make two calls per step (Wan) or none for CFG (Flux);
        # FasterCache's unconditional-branch skipping needs CFG folded into the batch.
        # The first step (t = 1000) outside the range: with is_guidance_distilled its first call would
        # otherwise read an empty cache (Diffusers 0.42.1).
        return FasterCacheConfig(spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 990),
                                 current_timestep_callback=timestep, attention_weight_callback=lambda _: 0.5,
                                 is_guidance_distilled=True, tensor_format="BCFHW" if family == "wan" else "BCHW")
    if name == "sea":
        from diffusers import SeaCacheConfig

        return SeaCacheConfig(threshold=0.3, retention_steps=1, cache_end_steps=1, max_consecutive_cached=2,
                              raw_vision_callback=None if family == "wan" else _flux_raw_vision)
    raise ValueError(name)


def _apply(name: str, model, config) -> None:
    from diffusers.hooks import (apply_faster_cache, apply_first_block_cache, apply_mag_cache,
                                 apply_pyramid_attention_broadcast, apply_sea_cache, apply_taylorseer_cache)

    {"first_block": apply_first_block_cache, "mag": apply_mag_cache, "pyramid": apply_pyramid_attention_broadcast,
     "taylorseer": apply_taylorseer_cache, "faster": apply_faster_cache, "sea": apply_sea_cache}[name](model, config)


def _remove(model, config) -> None:
    """Removes a cache however it was added (Diffusers' disable_cache removes the hooks of the config's type)."""
    model._cache_config = config
    model.disable_cache()


def _counted(name: str, model):
    """The module whose forward runs exactly when the cache computes (the tail block for the caches that
    skip blocks, the first self-attention's query projection for those that skip attention)."""
    blocks = model.blocks if hasattr(model, "blocks") else model.single_transformer_blocks
    if name in ("first_block", "mag", "sea"):
        return next(iter(blocks[-1].children()))
    first = model.blocks[0].attn1 if hasattr(model, "blocks") else model.transformer_blocks[0].attn
    return first.to_q


def _adapted(handle) -> list:
    """``(class, attribute)`` of what diffusers-sp set on the cache's objects (diffusers_sp.caches)."""
    return sorted({(type(obj).__name__, attr) for obj, attr, _, _ in handle._models[0].caches._undo})


def _ours_left(model) -> list:
    """Attributes of diffusers-sp's cache adaptations still on the model's hooks after disable()."""
    names = {"_should_compute_remaining_blocks", "_perform_calibration_step", "resolve_gate"}
    left = []
    for module in model.modules():
        registry = module.__dict__.get("_diffusers_hook")
        for hook in (registry.hooks.values() if registry is not None else ()):
            for obj in (hook, getattr(hook, "shared_state", None)):
                if obj is not None and names & set(vars(obj)):
                    left.append(type(obj).__name__)
    return left


def _run(pipe, call, name, model):
    calls = []
    handle = _counted(name, model).register_forward_hook(lambda *a: calls.append(1))
    try:
        out = pipe(**call, generator=torch.Generator().manual_seed(0)).frames if hasattr(pipe, "vae_scale_factor_temporal") \
            else pipe(**call, generator=torch.Generator().manual_seed(0)).images
    finally:
        handle.remove()
    return torch.as_tensor(out), len(calls)


#: Caches whose objects diffusers-sp changes while enabled (diffusers_sp.caches): their output after
#: disable() is checked too.
_ADAPTED = ("first_block", "sea")


def _pipeline_case(name: str, family: str) -> dict:
    pipe = _pipe(family)
    call = WAN_CALL if family == "wan" else FLUX_CALL
    model = pipe.transformer
    config = _config(name, family, pipe)
    model.enable_cache(config)
    ref, ref_calls = _run(pipe, call, name, model)
    results = {"calls": ref_calls, "total": STEPS * (2 if family == "wan" else 1)}
    # Ulysses: the cache enabled before sequence parallelism.
    handle = enable_sequence_parallel(pipe, mode="ulysses")
    out, calls = _run(pipe, call, name, model)
    results["ulysses"] = dict(compare(ref, out), calls=calls, adapted=_adapted(handle))
    handle.disable()
    if name in _ADAPTED:
        out, calls = _run(pipe, call, name, model)
        results["after_disable"] = dict(compare(ref, out), calls=calls, left=_ours_left(model))
    model.disable_cache()
    # K/V-gather: the cache applied after enabling, through its apply_* function.
    handle = enable_sequence_parallel(pipe, mode="kv_gather")
    config = _config(name, family, pipe)
    _apply(name, model, config)
    out, calls = _run(pipe, call, name, model)
    results["kv_gather"] = dict(compare(ref, out), calls=calls)
    handle.disable()
    _remove(model, config)
    return results


def case_wan_first_block():
    return _pipeline_case("first_block", "wan")


def case_wan_mag():
    return _pipeline_case("mag", "wan")


def case_wan_sea():
    return _pipeline_case("sea", "wan")


def case_wan_pyramid():
    return _pipeline_case("pyramid", "wan")


def case_wan_taylorseer():
    return _pipeline_case("taylorseer", "wan")


def case_wan_faster():
    return _pipeline_case("faster", "wan")


def case_flux_first_block():
    return _pipeline_case("first_block", "flux")


def case_flux_mag():
    return _pipeline_case("mag", "flux")


def case_flux_pyramid():
    return _pipeline_case("pyramid", "flux")


def case_flux_taylorseer():
    return _pipeline_case("taylorseer", "flux")


def case_flux_faster():
    return _pipeline_case("faster", "flux")


def case_wan_first_block_vsa():
    """First Block Cache under video sparse attention (tokens in tile order: the residual's sums do
    not depend on the order), against VSA on a one-rank group with the same cache. VSA at sparsity
    0.5 moves the tiny model's ratios to 0.09-0.12 and 0.14-0.18: threshold 0.13."""
    from diffusers import FirstBlockCacheConfig

    from cases_vsa import _solo_group

    pipe = _pipe("wan")
    model = pipe.transformer
    model.enable_cache(FirstBlockCacheConfig(threshold=0.13))
    try:
        handle = enable_sequence_parallel(pipe, mode="vsa", process_group=_solo_group(), vsa_sparsity=0.5)
        try:
            ref, ref_calls = _run(pipe, WAN_CALL, "first_block", model)
        finally:
            handle.disable()
        handle = enable_sequence_parallel(pipe, mode="vsa", vsa_sparsity=0.5)
        try:
            out, calls = _run(pipe, WAN_CALL, "first_block", model)
            adapted = _adapted(handle)
        finally:
            handle.disable()
    finally:
        model.disable_cache()
    return {"calls": ref_calls, "total": 2 * STEPS, "vsa": dict(compare(ref, out), calls=calls, adapted=adapted)}


# ----------------------------------------------------------------------------- SeaCache on Flux
# FluxPipeline enters cache_context("cond") without the step index and sigma SeaCache needs, so a
# short Euler loop calls the tiny Flux transformer the way SeaCache expects.

_FLUX_GRID = (5, 7)  # latent height and width in patches: 35 image tokens


def _flux_raw_vision(module, args, kwargs):
    """SeaCache's callback for Flux: the packed latents ``[B, 35, C]`` as ``(C, T=1, H, W)`` per sample.
    It must see every token: diffusers-sp hands it the call before the split."""
    hidden = kwargs["hidden_states"]
    return [h.transpose(0, 1).reshape(h.shape[-1], 1, *_FLUX_GRID) for h in hidden]


def _flux_loop(model, steps: int = STEPS):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 35, 4, generator=g)
    text = torch.randn(1, 7, 32, generator=g)
    pooled = torch.randn(1, 32, generator=g)
    ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(5.0), torch.arange(7.0), indexing="ij"), -1)
    sigmas = torch.linspace(1.0, 0.1, steps + 1)
    with torch.no_grad():
        for i in range(steps):
            with model.cache_context("cond", step_index=i, sigma=float(sigmas[i]), num_inference_steps=steps):
                v = model(hidden_states=x, encoder_hidden_states=text, pooled_projections=pooled,
                          timestep=sigmas[i:i + 1], guidance=torch.tensor([3.5]), img_ids=ids.reshape(-1, 3),
                          txt_ids=torch.zeros(7, 3), return_dict=False)[0]
            x = x + (sigmas[i + 1] - sigmas[i]) * v
    return x


def case_flux_sea():
    from diffusers.hooks import apply_sea_cache

    model = tiny_flux_transformer(guidance_embeds=True)
    counted = _counted("sea", model)

    def run():
        calls = []
        handle = counted.register_forward_hook(lambda *a: calls.append(1))
        try:
            return _flux_loop(model), len(calls)
        finally:
            handle.remove()

    model.enable_cache(_config("sea", "flux", None))
    ref, ref_calls = run()
    results = {"calls": ref_calls, "total": STEPS}
    handle = enable_sequence_parallel(model, mode="ulysses")
    out, calls = run()
    results["ulysses"] = dict(compare(ref, out), calls=calls, adapted=_adapted(handle))
    handle.disable()
    out, calls = run()
    results["after_disable"] = dict(compare(ref, out), calls=calls, left=_ours_left(model))
    model.disable_cache()
    handle = enable_sequence_parallel(model, mode="kv_gather")
    config = _config("sea", "flux", None)
    apply_sea_cache(model, config)
    out, calls = run()
    results["kv_gather"] = dict(compare(ref, out), calls=calls)
    handle.disable()
    _remove(model, config)
    return results


def case_wan_mag_calibration():
    """MagCache's calibration (no skipping) prints the mean per-token norm ratio of each step: averaged
    over the whole sequence, it is one process's."""
    import ast
    import contextlib
    import io

    from diffusers import MagCacheConfig

    pipe = _pipe("wan")
    call = dict(WAN_CALL, num_inference_steps=3)

    def ratios():
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            pipe(**call, generator=torch.Generator().manual_seed(0))
        return [ast.literal_eval(line) for line in printed.getvalue().splitlines() if line.startswith("[1")]

    pipe.transformer.enable_cache(MagCacheConfig(calibrate=True, num_inference_steps=3))
    try:
        ref = ratios()
        handle = enable_sequence_parallel(pipe, mode="ulysses")
        out = ratios()
        adapted = _adapted(handle)
        handle.disable()
    finally:
        pipe.transformer.disable_cache()
    return {"ref": ref, "out": out, "adapted": adapted}


# --------------------------------------------------------------------------------- offloading
# Wan pipeline, two steps, two calls in a row (enable_model_cpu_offload re-wraps the transformer
# after every pipeline call), each order of enabling.

OFFLOAD_CALL = dict(WAN_CALL, num_inference_steps=2)


def _latents(pipe, call=OFFLOAD_CALL):
    return torch.as_tensor(pipe(**call, generator=torch.Generator().manual_seed(0)).frames)


def _sequential_offload(pipe):
    """What ``pipe.enable_sequential_cpu_offload()`` does to the transformer (Accelerate's
    ``cpu_offload``: weights on the meta device, a hook on every module with weights that loads them
    for its forward), with the execution device spelled ``cpu``: Diffusers passes ``cpu:0``, which
    Accelerate 1.15 fails to move back to the meta device after a forward on CPU, with or without
    diffusers-sp."""
    from accelerate import cpu_offload

    cpu_offload(pipe.transformer, execution_device=torch.device("cpu"),
                offload_buffers=len(pipe.transformer._parameters) > 0)


def _offload_case(kind: str) -> dict:
    pipe = tiny_wan_pipeline("t2v")
    pipe.set_progress_bar_config(disable=True)
    ref = _latents(pipe)
    offload = (lambda: pipe.enable_model_cpu_offload(device="cpu")) if kind == "model" else \
        (lambda: _sequential_offload(pipe))
    results = {}
    offload()  # before enabling
    handle = enable_sequence_parallel(pipe, mode="ulysses")
    results["before"] = [compare(ref, _latents(pipe)) for _ in range(2)]
    handle.disable()
    results["before_disabled"] = compare(ref, _latents(pipe))
    pipe.remove_all_hooks()
    from accelerate.hooks import remove_hook_from_module

    remove_hook_from_module(pipe.transformer, recurse=True)
    handle = enable_sequence_parallel(pipe, mode="kv_gather")
    offload()  # after enabling
    results["after"] = [compare(ref, _latents(pipe)) for _ in range(2)]
    handle.disable()
    results["after_disabled"] = compare(ref, _latents(pipe))
    return results


def case_offload_model():
    return _offload_case("model")


def case_offload_sequential():
    return _offload_case("sequential")


# ------------------------------------------------------------------- quantization, casting, LoRA

def _wan_inputs():
    g = torch.Generator().manual_seed(1)
    return dict(hidden_states=torch.randn(1, 16, 5, 10, 14, generator=g), timestep=torch.tensor([500.0]),
                encoder_hidden_states=torch.randn(1, 12, 32, generator=g), return_dict=False)


def _forward(model, kwargs=None):
    with torch.no_grad():
        return model(**(kwargs or _wan_inputs()))[0]


def _both_modes(model, ref, kwargs=None) -> dict:
    out = {}
    for mode in ("ulysses", "kv_gather"):
        handle = enable_sequence_parallel(model, mode=mode)
        try:
            out[mode] = compare(ref, _forward(model, kwargs))
        finally:
            handle.disable()
    out["restored"] = torch.equal(_forward(model, kwargs), ref)
    return out


def case_torchao_int8_through_config():
    """Weight-only int8 through Diffusers' ``TorchAoConfig`` (``from_pretrained`` of a saved tiny model)."""
    import tempfile

    from diffusers import TorchAoConfig, WanTransformer3DModel
    from torchao.quantization import Int8WeightOnlyConfig

    from diffusers_sp.tiny_models import tiny_wan_transformer

    with tempfile.TemporaryDirectory() as folder:
        tiny_wan_transformer().save_pretrained(folder)
        model = WanTransformer3DModel.from_pretrained(
            folder, quantization_config=TorchAoConfig(Int8WeightOnlyConfig()), torch_dtype=torch.float32).eval()
    kind = type(model.blocks[0].attn1.to_q.weight)
    return dict(_both_modes(model, _forward(model)), weight=f"{kind.__module__}.{kind.__name__}")


def case_torchao_float8_quantize():
    """Weight-only float8 through torchao's ``quantize_``."""
    from torchao.quantization import Float8WeightOnlyConfig, quantize_

    from diffusers_sp.tiny_models import tiny_wan_transformer

    model = tiny_wan_transformer()
    quantize_(model, Float8WeightOnlyConfig())
    kind = type(model.blocks[0].attn1.to_q.weight)
    return dict(_both_modes(model, _forward(model)), weight=f"{kind.__module__}.{kind.__name__}")


def case_layerwise_casting():
    """Weights stored in float8, computed in float32 (``enable_layerwise_casting``), before enabling;
    and enabled after enabling."""
    from diffusers_sp.tiny_models import tiny_wan_transformer

    model = tiny_wan_transformer()
    model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    results = _both_modes(model, _forward(model))
    plain = tiny_wan_transformer()
    ref = None
    handle = enable_sequence_parallel(plain, mode="kv_gather")
    try:
        plain.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
        out = _forward(plain)
    finally:
        handle.disable()
    ref = _forward(plain)
    results["cast_after_enable"] = compare(ref, out)
    return results


def _lora_state_dict():
    """A random LoRA for the tiny Wan transformer in Diffusers' format: attention projections and
    ``proj_out``, the linear layer that diffusers-sp's gather sits on (PEFT replaces it by a LoRA layer)."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from diffusers_sp.tiny_models import tiny_wan_transformer

    source = tiny_wan_transformer(seed=7)
    torch.manual_seed(7)
    source.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights=False,
                                  target_modules=["to_q", "to_k", "to_v", "to_out.0", "proj_out"]))
    return {f"transformer.{k}": v.clone() for k, v in get_peft_model_state_dict(source).items()}


def case_lora():
    """``load_lora_weights`` before and after enabling, unfused and fused (``fuse_lora``), and unloaded
    while enabled: each forward equals one process's in the same state."""
    pipe = tiny_wan_pipeline("t2v")
    model = pipe.transformer
    lora = _lora_state_dict()
    base = _forward(model)
    pipe.load_lora_weights(dict(lora), adapter_name="style")
    unfused = _forward(model)
    pipe.fuse_lora()
    fused = _forward(model)
    pipe.unfuse_lora()
    unfused = _forward(model)  # W + BA - BA: not W to the last bit
    results = {"lora_changes_output": not torch.allclose(base, unfused)}
    results["loaded_before"] = _both_modes(model, unfused)
    pipe.unload_lora_weights()
    base = _forward(model)  # after fuse_lora / unfuse_lora: W + BA - BA
    handle = enable_sequence_parallel(pipe, mode="kv_gather")
    try:
        pipe.load_lora_weights(dict(lora), adapter_name="style")
        results["loaded_after"] = compare(unfused, _forward(model))
        pipe.fuse_lora()
        results["fused_after"] = compare(fused, _forward(model))
        pipe.unfuse_lora()
        pipe.unload_lora_weights()
        results["unloaded_after"] = compare(base, _forward(model))
    finally:
        handle.disable()
    return results


# ------------------------------------------------------------------------------------ IP-Adapter

def case_ip_adapter():
    """FluxIPAdapterAttnProcessor (an image prompt attended by the image queries) in both modes, with
    as many image-prompt tokens as the last rank's shard has image tokens: the length at which the
    wrapper once took the image-prompt call for the self-attention. The scale is then changed through
    the pipeline's ``set_ip_adapter_scale`` while enabled."""
    import torch.distributed as dist
    from diffusers.models.embeddings import ImageProjection, MultiIPAdapterImageProjection
    from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor

    from diffusers_sp.sharding import balanced_sizes

    world = dist.get_world_size() if dist.is_initialized() else 1
    tokens = balanced_sizes(35, world)[-1]
    pipe = tiny_flux_pipeline()
    model = pipe.transformer
    torch.manual_seed(11)
    for block in model.transformer_blocks:
        block.attn.set_processor(FluxIPAdapterAttnProcessor(hidden_size=48, cross_attention_dim=8, num_tokens=(4,)))
    model.encoder_hid_proj = MultiIPAdapterImageProjection(
        [ImageProjection(image_embed_dim=8, cross_attention_dim=8, num_image_text_embeds=4)])
    g = torch.Generator().manual_seed(2)
    ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(5.0), torch.arange(7.0), indexing="ij"), -1)
    kwargs = dict(hidden_states=torch.randn(1, 35, 4, generator=g), encoder_hidden_states=torch.randn(1, 7, 32, generator=g),
                  pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([0.5]),
                  guidance=torch.tensor([3.5]), img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(7, 3),
                  joint_attention_kwargs={"ip_hidden_states": [torch.randn(1, tokens, 8, generator=g)]},
                  return_dict=False)
    with_ip = _forward(model, kwargs)
    pipe.set_ip_adapter_scale(0.25)
    quarter = _forward(model, kwargs)
    pipe.set_ip_adapter_scale(1.0)
    results = {"ip_tokens": tokens, "ip_changes_output": not torch.allclose(with_ip, quarter)}
    results.update(_both_modes(model, with_ip, kwargs))
    handle = enable_sequence_parallel(pipe, mode="kv_gather")
    try:
        pipe.set_ip_adapter_scale(0.25)
        results["scale_set_while_enabled"] = compare(quarter, _forward(model, kwargs))
        results["processor_type_seen_by_diffusers"] = type(model.transformer_blocks[0].attn.processor).__name__
    finally:
        handle.disable()
    results["weights_still_registered"] = any("to_k_ip" in n for n, _ in model.named_parameters())
    return results


# --------------------------------------------------------------------------------------- refusals

def _context_parallel_config():
    import torch.distributed as dist
    from diffusers import ContextParallelConfig

    return ContextParallelConfig(ulysses_degree=dist.get_world_size())


def case_error_diffusers_parallelism_before():
    """A model with Diffusers' parallelism recorded on it (``model._parallel_config``, what
    ``enable_parallelism`` and ``from_pretrained(parallel_config=...)`` set; building its device mesh
    needs an accelerator, so the record is made directly here), then enable_sequence_parallel:
    refused at enable."""
    from diffusers.models._modeling_parallel import ParallelConfig

    from diffusers_sp.tiny_models import tiny_wan_transformer

    model = tiny_wan_transformer()
    model._parallel_config = ParallelConfig(context_parallel_config=_context_parallel_config())
    return error_of(lambda: enable_sequence_parallel(model, mode="kv_gather"))


def case_error_diffusers_parallelism_after():
    """enable_sequence_parallel, then Diffusers' ``apply_context_parallel`` hooks (what
    ``enable_parallelism`` registers): refused at the next forward, before any collective of either."""
    from diffusers.hooks import apply_context_parallel

    from diffusers_sp.tiny_models import tiny_wan_transformer

    model = tiny_wan_transformer()
    handle = enable_sequence_parallel(model, mode="ulysses")
    try:
        apply_context_parallel(model, _context_parallel_config(), type(model)._cp_plan)
        return error_of(lambda: _forward(model))
    finally:
        handle.disable()


def case_error_token_mixing_hooks():
    """Hooks that change the attention inside the processor or mix neighbouring tokens: LayerSkip's
    attention-score skipping (skip-layer guidance) at enable, Smoothed Energy Guidance's query blur
    added after enabling at the next forward. (Registered directly: Diffusers' apply_layer_skip cannot
    place them on these tiny models.)"""
    from diffusers.hooks import HookRegistry
    from diffusers.hooks.layer_skip import AttentionProcessorSkipHook
    from diffusers.hooks.smoothed_energy_guidance_utils import SmoothedEnergyGuidanceHook

    from diffusers_sp.tiny_models import tiny_wan_transformer

    model = tiny_wan_transformer()
    registry = HookRegistry.check_if_exists_or_initialize(model.blocks[0].attn1)
    registry.register_hook(AttentionProcessorSkipHook(None, skip_attention_scores=True), "layer_skip")
    at_enable = error_of(lambda: enable_sequence_parallel(model, mode="kv_gather"))
    registry.remove_hook("layer_skip")
    handle = enable_sequence_parallel(model, mode="kv_gather")
    try:
        HookRegistry.check_if_exists_or_initialize(model.blocks[0].attn1.to_q).register_hook(
            SmoothedEnergyGuidanceHook(1.0), "seg")
        at_forward = error_of(lambda: _forward(model))
    finally:
        handle.disable()
    return {"layer_skip": at_enable, "seg": at_forward}
