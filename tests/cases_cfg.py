"""Cases of CFG parallelism, replicas and the parallel VAE decode, run on every rank at world sizes 2 and 4.

Used by tests/test_cfg_parallel.py, tests/test_replicas.py and tests/test_vae_parallel.py, which share
one spawn per world size through :func:`results` (see tests/distributed.py).

Every reference is computed by the same process without any parallelism, before enabling, so a
bit-for-bit comparison is meaningful (same threads, same kernels).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from diffusers_sp import enable_sequence_parallel
from diffusers_sp.tiny_models import tiny_tokenizer, tiny_wan_pipeline, tiny_wan_vae

from distributed import compare

CALL = dict(height=80, width=112, num_frames=17, num_inference_steps=3, output_type="latent")
PROMPTS = ("a cat runs on the grass", "a red bird flies over the blue water", "a small dog swims in the sky")


@functools.lru_cache(maxsize=None)
def _pipe(kind: str):
    return tiny_wan_pipeline(kind)


def _run(pipe, **kw):
    call = dict(CALL, prompt=PROMPTS[0], negative_prompt="rain", guidance_scale=5.0)
    call.update(kw)
    return torch.as_tensor(pipe(**call, generator=torch.Generator().manual_seed(0)).frames)


def _cfg_pipeline(kind: str, **kw) -> dict:
    pipe = _pipe(kind)
    pipe.set_progress_bar_config(disable=True)
    ref = _run(pipe, **kw)
    handle = enable_sequence_parallel(pipe, mode="kv_gather", cfg_parallel=True)
    try:
        out = _run(pipe, **kw)
        out2 = _run(pipe, **kw)  # a second call: state from the first must not leak into it
        stats = [dict(h.stats) for h in handle._cfg_hooks]
        layout = dict(cfg_rank=handle.cfg_rank, cfg_degree=handle.cfg_degree, sp=handle.world_size,
                      num_replicas=handle.num_replicas, replica_index=handle.replica_index)
    finally:
        handle.disable()
    restored = torch.equal(_run(pipe, **kw), ref)
    return {"cmp": compare(ref, out), "cmp2": compare(ref, out2), "stats": stats, "layout": layout,
            "restored": restored}


def case_cfg_wan_t2v():
    return _cfg_pipeline("t2v")


def case_cfg_wan_i2v():
    from PIL import Image

    image = Image.fromarray((torch.rand(80, 112, 3, generator=torch.Generator().manual_seed(3)) * 255)
                            .to(torch.uint8).numpy())
    return _cfg_pipeline("i2v", image=image)


def case_cfg_wan22_two_transformers():
    return _cfg_pipeline("t2v_moe")


def case_cfg_wan_guidance_off():
    """guidance_scale 1: no uncond call; both CFG groups compute every call (exact, no speed-up)."""
    return _cfg_pipeline("t2v", guidance_scale=1.0)


def _tiny_cogvideox_pipeline():
    from diffusers import AutoencoderKLCogVideoX, CogVideoXDDIMScheduler, CogVideoXPipeline
    from transformers import T5Config, T5EncoderModel

    from diffusers_sp.tiny_models import tiny_cogvideox_transformer

    torch.manual_seed(0)
    vae = AutoencoderKLCogVideoX(in_channels=3, out_channels=3, down_block_types=("CogVideoXDownBlock3D",) * 4,
                                 up_block_types=("CogVideoXUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8),
                                 latent_channels=4, layers_per_block=1, norm_num_groups=2,
                                 temporal_compression_ratio=4).eval()
    text_encoder = T5EncoderModel(T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=32, num_layers=2, num_heads=4,
                                           relative_attention_num_buckets=8)).eval()
    pipe = CogVideoXPipeline(tokenizer=tiny_tokenizer(), text_encoder=text_encoder, vae=vae,
                             transformer=tiny_cogvideox_transformer(), scheduler=CogVideoXDDIMScheduler())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def case_cfg_batched_cogvideox():
    """CogVideoX folds uncond and cond into a batch of 2: each CFG group runs one half."""
    pipe = _tiny_cogvideox_pipeline()
    call = dict(prompt=PROMPTS[0], negative_prompt="rain", height=112, width=80, num_frames=9, num_inference_steps=3,
                guidance_scale=6.0, max_sequence_length=8, output_type="latent")
    ref = torch.as_tensor(pipe(**call, generator=torch.Generator().manual_seed(0)).frames)
    handle = enable_sequence_parallel(pipe, mode="kv_gather", cfg_parallel=True)
    try:
        out = torch.as_tensor(pipe(**call, generator=torch.Generator().manual_seed(0)).frames)
        stats = [dict(h.stats) for h in handle._cfg_hooks]
    finally:
        handle.disable()
    return {"cmp": compare(ref, out), "stats": stats}


def case_cfg_auto():
    pipe = _pipe("t2v")
    handle = enable_sequence_parallel(pipe, mode="auto", cfg_parallel="auto")
    try:
        return {"cfg_degree": handle.cfg_degree, "sp": handle.world_size}
    finally:
        handle.disable()


def case_cfg_pag_refused():
    """An SD3 PAG pipeline runs [uncond, cond, perturbed] as one batch that its PAG processors cut into those
    passes: cfg_parallel=True is refused on every rank at enable, 'auto' leaves CFG parallelism off."""
    from diffusers import StableDiffusion3PAGPipeline

    from diffusers_sp.tiny_models import tiny_sd3_pipeline
    from distributed import error_of

    parts = tiny_sd3_pipeline().components
    pipe = StableDiffusion3PAGPipeline(**{k: v for k, v in parts.items() if k not in ("image_encoder", "feature_extractor")})
    refused = error_of(lambda: enable_sequence_parallel(pipe, mode="kv_gather", cfg_parallel=True))
    handle = enable_sequence_parallel(pipe, mode="kv_gather", cfg_parallel="auto")
    try:
        return {"refused": refused, "auto": (handle.cfg_degree, handle.world_size)}
    finally:
        handle.disable()


def case_replicas_prompts():
    """sp_degree = world / 2: two replicas; the prompts are spread over them, each output written once."""
    from diffusers_sp.replicas import split_for_replica

    pipe = _pipe("t2v")
    world = dist.get_world_size()
    handle = enable_sequence_parallel(pipe, mode="kv_gather", sp_degree=world // 2)
    outputs = {}
    try:
        for index, prompt in split_for_replica(list(PROMPTS), handle.replica_index, handle.num_replicas):
            out = _run(pipe, prompt=prompt)
            if handle.is_output_rank:
                outputs[index] = out
        info = dict(replica_index=handle.replica_index, num_replicas=handle.num_replicas, sp=handle.world_size,
                    rank=handle.rank, output_rank=handle.is_output_rank)
    finally:
        handle.disable()
    refs = {}
    if dist.get_rank() == 0:  # single-process references, one per prompt
        refs = {i: _run(pipe, prompt=p) for i, p in enumerate(PROMPTS)}
    return {"outputs": outputs, "info": info, "refs": refs}


def _tiled_vae():
    vae = tiny_wan_vae()
    # 32-pixel tiles with a 24-pixel stride: a 7 x 10 latent (56 x 80 pixels) decodes as 3 x 4 = 12 tiles,
    # a 10 x 14 latent (the pipeline case) as 4 x 5 = 20.
    vae.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_stride_height=24,
                      tile_sample_stride_width=24)
    return vae


def case_vae_wan_tiled_decode():
    from diffusers_sp.groups import resolve_group
    from diffusers_sp.vae import make_parallel_tiled_decode, track_peak_memory

    vae = _tiled_vae()
    z = torch.randn(1, 16, 2, 7, 10, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        with track_peak_memory() as single_mem:
            ref = vae.decode(z).sample
        parallel = make_parallel_tiled_decode(vae, resolve_group())
        with track_peak_memory() as par_mem:
            out = parallel(z).sample
    return {"cmp": compare(ref, out), "peak_single": single_mem.peak, "peak_parallel": par_mem.peak,
            "output_bytes": ref.numel() * ref.element_size()}


def case_vae_wan_pipeline():
    """parallel_vae=True through the pipeline (decoded frames) against one process with the same tiling."""
    pipe = _pipe("t2v")
    original_vae = pipe.vae
    pipe.vae = _tiled_vae()
    try:
        ref = _run(pipe, output_type="pt")
        handle = enable_sequence_parallel(pipe, mode="kv_gather", parallel_vae=True)
        try:
            out = _run(pipe, output_type="pt")
        finally:
            handle.disable()
        restored = "tiled_decode" not in vars(pipe.vae) and pipe.vae.use_tiling
    finally:
        pipe.vae = original_vae
    return {"cmp": compare(ref, out), "restored": restored}


def _check_vae(vae, z, **kw):
    from diffusers_sp.groups import resolve_group
    from diffusers_sp.vae import make_parallel_tiled_decode

    with torch.no_grad():
        ref = vae.tiled_decode(z, **kw).sample
        out = make_parallel_tiled_decode(vae, resolve_group())(z, **kw).sample
    return compare(ref, out)


def _vae_hunyuan_video():
    from diffusers import AutoencoderKLHunyuanVideo

    torch.manual_seed(0)
    vae = AutoencoderKLHunyuanVideo(in_channels=3, out_channels=3, latent_channels=4,
                                    down_block_types=("HunyuanVideoDownBlock3D",) * 4,
                                    up_block_types=("HunyuanVideoUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8),
                                    layers_per_block=1, norm_num_groups=4, spatial_compression_ratio=8,
                                    temporal_compression_ratio=4).eval()
    vae.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_stride_height=24,
                      tile_sample_stride_width=24)
    return _check_vae(vae, torch.randn(1, 4, 2, 9, 11, generator=torch.Generator().manual_seed(1)))


def _vae_cogvideox():
    from diffusers import AutoencoderKLCogVideoX

    torch.manual_seed(0)
    vae = AutoencoderKLCogVideoX(in_channels=3, out_channels=3, down_block_types=("CogVideoXDownBlock3D",) * 4,
                                 up_block_types=("CogVideoXUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8),
                                 latent_channels=4, layers_per_block=1, norm_num_groups=2,
                                 temporal_compression_ratio=4).eval()
    vae.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32, tile_overlap_factor_height=0.25,
                      tile_overlap_factor_width=0.25)
    return _check_vae(vae, torch.randn(1, 4, 3, 9, 11, generator=torch.Generator().manual_seed(1)))


def _vae_ltx():
    from diffusers import AutoencoderKLLTXVideo

    torch.manual_seed(0)
    vae = AutoencoderKLLTXVideo(
        in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1), spatio_temporal_scaling=(True, True, False, False),
        decoder_spatio_temporal_scaling=(True, True, False, False), decoder_inject_noise=(False,) * 5,
        upsample_residual=(False,) * 4, upsample_factor=(1, 1, 1, 1), timestep_conditioning=False, patch_size=1,
        patch_size_t=1, encoder_causal=True, decoder_causal=False).eval()
    vae.enable_tiling(tile_sample_min_height=16, tile_sample_min_width=16, tile_sample_stride_height=12,
                      tile_sample_stride_width=12)
    return _check_vae(vae, torch.randn(1, 8, 2, 9, 11, generator=torch.Generator().manual_seed(1)), temb=None)


def case_vae_other_families():
    """HunyuanVideo, CogVideoX and LTX VAEs (tiny, random weights): shared tiles equal their own tiled_decode."""
    return {"hunyuan_video": _vae_hunyuan_video(), "cogvideox": _vae_cogvideox(), "ltx": _vae_ltx()}


def case_layout_disagrees():
    """Ranks asking for different layouts (which would hang in the sub-group creation or run
    unsplit): at world size 2 rank 0 passes cfg_parallel=True and rank 1 False; at 4 ranks 0-1
    pass sp_degree=2 and ranks 2-3 sp_degree=1. Every rank must raise the same error, before the
    sub-groups are built."""
    from distributed import error_of

    pipe = _pipe("t2v")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 2:
        kwargs = dict(cfg_parallel=rank == 0)
    else:
        kwargs = dict(sp_degree=2 if rank < 2 else 1)
    plain = error_of(lambda: enable_sequence_parallel(pipe, mode="kv_gather", **kwargs))
    # With a transport that one side would refuse before any collective (the copy engines on gloo),
    # that side raised alone and the other waited in the check until the timeout.
    refused = error_of(lambda: enable_sequence_parallel(pipe, mode="kv_gather", sp_transport="copy_engine", **kwargs))
    return {"plain": plain, "copy_engine": refused}


def case_group_usable_after():
    x = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(x)
    return x.item()


# ------------------------------------------------ caches with CFG parallelism and replicas
# First Block Cache decides from a statistic over the tokens; with CFG parallelism it must be taken
# over the ranks that compute one call of one process: the SP group of a CFG group (two calls per
# step: each group keeps the cache state of its own pass, "cond" or "uncond"), or the whole replica
# (CFG folded into a batch that the two groups split). Thresholds as in tests/cases_combine.py: far
# from every ratio the tiny models produce, and skipping some calls but not all.

CACHE_STEPS = 6


def _tail_calls(model):
    """Counts the calls in which the last block computed (First Block Cache skips it)."""
    blocks = model.blocks if hasattr(model, "blocks") else (
        model.single_transformer_blocks if hasattr(model, "single_transformer_blocks") else model.transformer_blocks)
    calls = []
    return calls, next(iter(blocks[-1].children())).register_forward_hook(lambda *a: calls.append(1))


def _cached_run(pipe, call, **enable):
    """Latents and computed tail calls of one call, one process (no ``enable``) or enabled."""
    handle = enable_sequence_parallel(pipe, mode="kv_gather", **enable) if enable else None
    calls, hook = _tail_calls(pipe.transformer)
    try:
        out = pipe(**call, generator=torch.Generator().manual_seed(0))
        latents = torch.as_tensor(out.frames if hasattr(out, "frames") else out.images)
        stats = [dict(h.stats) for h in handle._cfg_hooks] if handle is not None else []
        layout = dict(cfg_rank=handle.cfg_rank, replica_index=handle.replica_index) if handle is not None else {}
    finally:
        hook.remove()
        if handle is not None:
            handle.disable()
    return latents, len(calls), stats, layout


def _cache_case(pipe, call, threshold: float, **enable) -> dict:
    from diffusers import FirstBlockCacheConfig

    pipe.set_progress_bar_config(disable=True)
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
    try:
        ref, ref_calls, _, _ = _cached_run(pipe, call)
        out, calls, stats, layout = _cached_run(pipe, call, **enable)
    finally:
        pipe.transformer.disable_cache()
    return {"cmp": compare(ref, out), "ref_calls": ref_calls, "calls": calls, "stats": stats, "layout": layout}


def case_cache_cfg_wan():
    """Wan: two calls per step, the unconditional one computed by CFG group 1 during the first."""
    call = dict(CALL, prompt=PROMPTS[0], negative_prompt="rain", guidance_scale=5.0, num_inference_steps=CACHE_STEPS)
    return _cache_case(_pipe("t2v"), call, 0.12, cfg_parallel=True)


def case_cache_cfg_flux_true_cfg():
    """Flux with true CFG: step 0 runs both calls on both groups, later steps one each (learned from
    step 0), so CFG group 1's unconditional passes must land in the "uncond" cache state."""
    from diffusers_sp.tiny_models import tiny_flux_pipeline

    call = dict(prompt=PROMPTS[0], negative_prompt="rain", true_cfg_scale=2.0, height=10, width=14,
                max_sequence_length=8, guidance_scale=3.5, num_inference_steps=CACHE_STEPS, output_type="latent")
    return _cache_case(tiny_flux_pipeline(), call, 0.45, cfg_parallel=True)


def case_cache_cfg_batched_cogvideox():
    """CogVideoX: one call per step on a batch of 2 that the CFG groups split: one decision per call,
    the statistic over both halves."""
    from diffusers_sp.tiny_models import tiny_cogvideox_pipeline

    call = dict(prompt=PROMPTS[0], negative_prompt="rain", height=80, width=112, num_frames=1, max_sequence_length=8,
                guidance_scale=6.0, num_inference_steps=CACHE_STEPS, output_type="latent")
    return _cache_case(tiny_cogvideox_pipeline(), call, 0.1, cfg_parallel=True)


def case_cache_replicas_wan():
    """Replicas of P/2 ranks each (sp_degree=P/2), no CFG parallelism: each replica decides alone."""
    call = dict(CALL, prompt=PROMPTS[0], negative_prompt="rain", guidance_scale=5.0, num_inference_steps=CACHE_STEPS)
    return _cache_case(_pipe("t2v"), call, 0.12, sp_degree=dist.get_world_size() // 2)


def case_cache_cfg_refused():
    """Pyramid Attention Broadcast keeps one state for both calls of a step; with two-call CFG
    parallelism each group sees one of them: refused at enable, and at the next call when applied after."""
    from diffusers import PyramidAttentionBroadcastConfig
    from diffusers.hooks import apply_pyramid_attention_broadcast

    from distributed import error_of

    pipe = _pipe("t2v")
    config = lambda: PyramidAttentionBroadcastConfig(  # noqa: E731
        spatial_attention_block_skip_range=2, current_timestep_callback=lambda: pipe.current_timestep)
    pipe.transformer.enable_cache(config())
    try:
        at_enable = error_of(lambda: enable_sequence_parallel(pipe, mode="kv_gather", cfg_parallel=True))
    finally:
        pipe.transformer.disable_cache()
    handle = enable_sequence_parallel(pipe, mode="kv_gather", cfg_parallel=True)
    try:
        apply_pyramid_attention_broadcast(pipe.transformer, config())
        at_call = error_of(lambda: _run(pipe))
    finally:
        handle.disable()
        pipe.transformer._cache_config = config()
        pipe.transformer.disable_cache()
    # FasterCache's unconditional-branch skipping on a model whose CFG is one batch split between the groups.
    from diffusers import FasterCacheConfig

    from diffusers_sp.tiny_models import tiny_cogvideox_transformer

    model = tiny_cogvideox_transformer()
    model.enable_cache(FasterCacheConfig(current_timestep_callback=lambda: 500, tensor_format="BFCHW"))
    faster = error_of(lambda: enable_sequence_parallel(model, mode="kv_gather", cfg_parallel=True))
    return {"at_enable": at_enable, "at_call": at_call, "faster_batched": faster}


_RESULTS: dict = {}


def results(world_size: int) -> dict:
    """``run_cases("cases_cfg", world_size)``, run once per world size per pytest run; at world size 4
    the spawn also runs the cases of tests/cases_hybrid.py (as ``"cases_hybrid:<case>"``, read by
    tests/test_hybrid.py), so that the two share it."""
    import sys

    from distributed import case_names, run_cases

    if world_size not in _RESULTS:
        cases = case_names(sys.modules[__name__])
        if world_size == 4:
            import cases_hybrid

            cases += [f"cases_hybrid:{name}" for name in cases_hybrid.cases_at(world_size)]
        _RESULTS[world_size] = run_cases("cases_cfg", world_size, cases=cases)
    return _RESULTS[world_size]
