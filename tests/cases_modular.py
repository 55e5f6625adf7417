"""Cases of modular pipelines (Diffusers' ``ModularPipeline``), run on every rank at world sizes 2 and 3.

Used by tests/test_modular.py. A tiny Wan modular pipeline (``WanBlocks().init_pipeline()`` with the
tiny Wan components) in each dense mode, with weight sharding, and refusing CFG parallelism, each
compared with the same modular pipeline on one process.
"""

from __future__ import annotations

import torch

from diffusers_sp import enable_sequence_parallel
from diffusers_sp.tiny_models import tiny_wan_pipeline

from distributed import compare, error_of

CALL = dict(prompt="a cat runs on the grass", negative_prompt="rain", height=80, width=112, num_frames=9,
            num_inference_steps=2, output="latents")


def _modular():
    from diffusers.modular_pipelines import WanBlocks

    classic = tiny_wan_pipeline("t2v")
    pipe = WanBlocks().init_pipeline()
    pipe.update_components(transformer=classic.transformer, text_encoder=classic.text_encoder,
                           tokenizer=classic.tokenizer, vae=classic.vae, scheduler=classic.scheduler)
    return pipe


def _run(pipe):
    return pipe(**CALL, generator=torch.Generator().manual_seed(0))


def _against_one_process(**options) -> dict:
    pipe = _modular()
    ref = _run(pipe)
    handle = enable_sequence_parallel(pipe, **options)
    try:
        out, out2 = _run(pipe), _run(pipe)
        info = dict(mode=handle.mode, world_size=handle.world_size, sharded=handle.weights is not None)
    finally:
        handle.disable()
    return {"cmp": compare(ref, out), "cmp2": compare(ref, out2), "again": compare(ref, _run(pipe)), **info}


def case_ulysses():
    return _against_one_process(mode="ulysses")


def case_kv_gather():
    return _against_one_process(mode="kv_gather")


def case_shard_weights():
    return _against_one_process(mode="kv_gather", shard_weights=True)


def case_cfg_parallel_refused():
    return error_of(lambda: enable_sequence_parallel(_modular(), cfg_parallel=True))
