"""Cases of weight sharding (``shard_weights=True``, FSDP2), run on every rank at world sizes 2, 3 and 4.

Used by tests/test_weights.py. Each case compares a pipeline with its weights sharded against the same
pipeline, same mode and world size, with its weights replicated (the reference): the gathered weights
are the same numbers, so the outputs must be too. It also reports the bytes of parameters each rank
holds, before and after a call, and whether ``disable()`` gives back the original, whole parameters.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from diffusers_sp import enable_sequence_parallel
from diffusers_sp.tiny_models import tiny_flux_pipeline, tiny_wan_pipeline, tiny_wan_transformer
from diffusers_sp.weights import parameter_bytes

from distributed import compare, error_of

WAN_CALL = dict(prompt="a cat runs on the grass", negative_prompt="rain", height=80, width=112, num_frames=9,
                num_inference_steps=2, guidance_scale=5.0, output_type="latent")
FLUX_CALL = dict(prompt="a small red bird", height=40, width=56, num_inference_steps=2, output_type="latent")


def _run(pipe, call):
    out = pipe(**call, generator=torch.Generator().manual_seed(0))
    return torch.as_tensor(out.frames if hasattr(out, "frames") else out.images)


def _components(pipe) -> dict:
    return {name: getattr(pipe, name) for name in ("transformer", "text_encoder", "text_encoder_2")
            if isinstance(getattr(pipe, name, None), torch.nn.Module)}


def _sharded_against_replicated(build, call, **options) -> dict:
    """The pipeline of ``build()`` with ``options``, replicated then sharded, and what each rank holds."""
    pipe = build()
    pipe.set_progress_bar_config(disable=True)
    own = _run(pipe, call)  # no sequence parallelism: what disable() must give back
    originals = {name: {k: v.clone() for k, v in m.state_dict().items()} for name, m in _components(pipe).items()}
    full = {name: parameter_bytes(m) for name, m in _components(pipe).items()}
    handle = enable_sequence_parallel(pipe, **options)
    ref = _run(pipe, call)
    handle.disable()
    handle = enable_sequence_parallel(pipe, shard_weights=True, **options)
    try:
        before = handle.local_weight_bytes()
        out, out2 = _run(pipe, call), _run(pipe, call)  # a second call must be exact as well
        after = {name: parameter_bytes(m) for name, m in _components(pipe).items()}
        fsdp_group = handle.weights.modules[0].group.world_size
    finally:
        handle.disable()
    restored = all(
        type(p) is torch.nn.Parameter and torch.equal(p, originals[name][key])
        for name, m in _components(pipe).items() for key, p in m.named_parameters())
    classes = {name: type(m).__name__ for name, m in _components(pipe).items()}
    again = _run(pipe, call)  # after disable(): the model's own output again
    return {"cmp": compare(ref, out), "cmp2": compare(ref, out2), "full": full, "before": before, "after": after,
            "restored": restored, "classes": classes, "again": compare(own, again), "fsdp_group": fsdp_group}


def case_wan_ulysses():
    return _sharded_against_replicated(lambda: tiny_wan_pipeline("t2v"), WAN_CALL, mode="ulysses")


def case_wan_kv_gather():
    return _sharded_against_replicated(lambda: tiny_wan_pipeline("t2v"), WAN_CALL, mode="kv_gather")


def case_wan_vsa():
    return _sharded_against_replicated(lambda: tiny_wan_pipeline("t2v"), WAN_CALL, mode="vsa", vsa_sparsity=0.5)


def case_flux_kv_gather():
    return _sharded_against_replicated(tiny_flux_pipeline, FLUX_CALL, mode="kv_gather")


def case_flux_ulysses():
    """Up to 3 ranks: the tiny Flux has 3 heads, and Ulysses needs one per rank."""
    if dist.get_world_size() > 3:
        return None
    return _sharded_against_replicated(tiny_flux_pipeline, FLUX_CALL, mode="ulysses")


def case_wan_cfg_parallel():
    """World size 4: cfg 2 x sp 2 (Wan runs CFG as two calls: its transformer is sharded over sp)."""
    if dist.get_world_size() != 4:
        return None
    return _sharded_against_replicated(lambda: tiny_wan_pipeline("t2v"), WAN_CALL, mode="kv_gather",
                                       cfg_parallel=True)


def case_wan_hybrid():
    """World size 4: Ulysses inside pairs of ranks, K/V-gather across them."""
    if dist.get_world_size() != 4:
        return None
    return _sharded_against_replicated(lambda: tiny_wan_pipeline("t2v"), WAN_CALL, mode="hybrid", ulysses_degree=2)


def _with_first_block_cache():
    from diffusers import FirstBlockCacheConfig

    pipe = tiny_wan_pipeline("t2v")
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.12))
    return pipe


def case_wan_first_block_cache():
    """Diffusers' First Block Cache (it skips the blocks after the first when their input barely
    changed): every rank of the FSDP group skips the same steps, so the gathers stay paired."""
    return _sharded_against_replicated(_with_first_block_cache, dict(WAN_CALL, num_inference_steps=4),
                                       mode="kv_gather")


def case_wan_replicas():
    """World size 4: two replicas of sp 2, each holding its own shards of the whole model."""
    if dist.get_world_size() != 4:
        return None
    return _sharded_against_replicated(lambda: tiny_wan_pipeline("t2v"), WAN_CALL, mode="kv_gather", sp_degree=2)


def case_wan_lora():
    """LoRA loaded before enabling, then (after disable(), unload and a second enable of the same
    pipeline) loaded while the weights are sharded: both equal the replicated pipeline with the LoRA.
    The LoRA's own matrices are new parameters that FSDP does not manage: whole on every rank."""
    from cases_combine import _lora_state_dict

    pipe = tiny_wan_pipeline("t2v")
    pipe.set_progress_bar_config(disable=True)
    lora = _lora_state_dict()
    pipe.load_lora_weights(dict(lora), adapter_name="style")
    handle = enable_sequence_parallel(pipe, mode="kv_gather")
    ref = _run(pipe, WAN_CALL)
    handle.disable()
    handle = enable_sequence_parallel(pipe, mode="kv_gather", shard_weights=True)
    before = _run(pipe, WAN_CALL)
    handle.disable()
    pipe.unload_lora_weights()
    handle = enable_sequence_parallel(pipe, mode="kv_gather", shard_weights=True)  # the same modules again
    try:
        pipe.load_lora_weights(dict(lora), adapter_name="style")
        after = _run(pipe, WAN_CALL)
    finally:
        handle.disable()
    return {"before": compare(ref, before), "after": compare(ref, after)}


def case_wan_process_group():
    """A process_group of the caller's: it serves FSDP's all-gathers too."""
    group = dist.new_group(list(range(dist.get_world_size())))
    return _sharded_against_replicated(lambda: tiny_wan_pipeline("t2v"), WAN_CALL, mode="kv_gather",
                                       process_group=group)


def case_wan22_two_transformers():
    """Wan 2.2: transformer and transformer_2 (switched at the boundary step), both sharded."""
    return _sharded_against_replicated(lambda: tiny_wan_pipeline("t2v_moe"), WAN_CALL, mode="kv_gather")


def case_wan_parallel_vae():
    """With the parallel VAE decode (the VAE itself is not sharded): the decoded video."""
    return _sharded_against_replicated(lambda: tiny_wan_pipeline("t2v"), dict(WAN_CALL, output_type="pt"),
                                       mode="kv_gather", parallel_vae=True)


def case_bare_transformer():
    """A transformer passed alone (no pipeline): its blocks and root sharded, reported under ``""``."""
    model = tiny_wan_transformer()
    g = torch.Generator().manual_seed(1)
    kwargs = dict(hidden_states=torch.randn(1, 16, 3, 10, 14, generator=g), timestep=torch.tensor([500]),
                  encoder_hidden_states=torch.randn(1, 8, 32, generator=g))
    full = parameter_bytes(model)
    with torch.no_grad():
        ref = model(**kwargs).sample
        handle = enable_sequence_parallel(model, shard_weights=True)
        try:
            out, held = model(**kwargs).sample, handle.local_weight_bytes()
        finally:
            handle.disable()
        again = model(**kwargs).sample
    return {"cmp": compare(ref, out), "again": compare(ref, again), "held": held, "full": full}


def case_bad_value():
    """A value other than True / False, refused on every rank alike before any collective."""
    return error_of(lambda: enable_sequence_parallel(tiny_wan_pipeline("t2v"), shard_weights="yes"))


def case_group_offloading_refused():
    """Diffusers' group offloading moves the same weights FSDP shards: refused with what would work."""
    pipe = tiny_wan_pipeline("t2v")
    pipe.transformer.enable_group_offload(torch.device("cpu"), offload_type="block_level", num_blocks_per_group=1)
    return error_of(lambda: enable_sequence_parallel(pipe, shard_weights=True))


def case_still_usable_after_refusal():
    """After the refusals above, every rank still enables and runs (no rank left in a collective)."""
    pipe = tiny_wan_pipeline("t2v")
    pipe.set_progress_bar_config(disable=True)
    handle = enable_sequence_parallel(pipe, shard_weights=True)
    try:
        return tuple(_run(pipe, dict(WAN_CALL, num_inference_steps=1)).shape)
    finally:
        handle.disable()


def _saved_pipeline(build) -> str:
    """``build()`` saved with ``save_pretrained`` by rank 0 to a folder every rank then reads."""
    import tempfile

    box = [None]
    if dist.get_rank() == 0:
        box[0] = tempfile.mkdtemp(prefix="diffusers_sp_weights_")
        build().save_pretrained(box[0])
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _loaded_for_sharding(pipeline_cls, build, call, **options) -> dict:
    """A pipeline saved to disk, loaded with empty big weights (load_pipeline_for_sharding) and enabled
    with shard_weights=True, against the same folder loaded whole by from_pretrained."""
    from diffusers_sp import load_pipeline_for_sharding

    folder = _saved_pipeline(build)
    whole = pipeline_cls.from_pretrained(folder, dtype=torch.float32)
    whole.set_progress_bar_config(disable=True)
    handle = enable_sequence_parallel(whole, **options)
    ref = _run(whole, call)
    handle.disable()
    empty = load_pipeline_for_sharding(pipeline_cls, folder, dtype=torch.float32)
    empty.set_progress_bar_config(disable=True)
    meta_before = sum(p.is_meta for m in _components(empty).values() for p in m.parameters())
    refused = error_of(lambda: enable_sequence_parallel(empty, **options))
    handle = enable_sequence_parallel(empty, shard_weights=True, **options)
    try:
        out = _run(empty, call)
        held = handle.local_weight_bytes()
    finally:
        handle.disable()
    full = {name: parameter_bytes(m) for name, m in _components(whole).items()}
    return {"cmp": compare(ref, out), "meta_before": meta_before, "refused": refused, "held": held, "full": full}


def case_wan_loaded_for_sharding():
    from diffusers import WanPipeline

    return _loaded_for_sharding(WanPipeline, lambda: tiny_wan_pipeline("t2v"), WAN_CALL, mode="kv_gather")


def case_flux_loaded_for_sharding():
    from diffusers import FluxPipeline

    return _loaded_for_sharding(FluxPipeline, tiny_flux_pipeline, FLUX_CALL, mode="kv_gather")
