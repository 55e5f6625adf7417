"""Cases of modular pipelines (Diffusers' ``ModularPipeline``), run on every rank at world sizes 2 and 3.

Used by tests/test_modular.py. The tiny Wan modular pipelines (default blocks with the tiny Wan components)
in each dense mode, Wan 2.1 also with weight sharding and refusing CFG parallelism, each compared with the
same modular pipeline on one process. Modular pipelines of the other families are cases of
tests/cases_families.py (the ``MODULAR`` entries of tests/families/).
"""

from __future__ import annotations

import torch

from diffusers_sp import enable_sequence_parallel
from diffusers_sp.tiny_models import tiny_wan_pipeline

import families
from distributed import compare, error_of

CALL = dict(prompt="a cat runs on the grass", negative_prompt="rain", height=80, width=112, num_frames=9,
            num_inference_steps=2, output="latents")

#: The Wan modular pipelines and the tiny classic pipeline whose components they take
#: (:func:`diffusers_sp.tiny_models.tiny_wan_pipeline` kinds): Wan 2.1, Wan 2.2's two experts switched at the
#: boundary, and image-to-video for both.
VARIANTS = {"WanModularPipeline": "t2v", "Wan22ModularPipeline": "t2v_moe",
            "WanImage2VideoModularPipeline": "i2v", "Wan22Image2VideoModularPipeline": "i2v_moe"}


def _modular(name: str = "WanModularPipeline"):
    """Modular pipeline ``name`` (its default blocks without the decode step) with the tiny Wan components."""
    pipe = families.modular_pipeline(name, tiny_wan_pipeline(VARIANTS[name]))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _run(pipe):
    call = dict(CALL, image=families.image(112, 80)) if "Image2Video" in type(pipe).__name__ else CALL
    return pipe(**call, generator=torch.Generator().manual_seed(0))


def _against_one_process(name: str = "WanModularPipeline", **options) -> dict:
    pipe = _modular(name)
    ref = _run(pipe)
    handle = enable_sequence_parallel(pipe, **options)
    try:
        out, out2 = _run(pipe), _run(pipe)
        info = dict(mode=handle.mode, world_size=handle.world_size, sharded=handle.weights is not None,
                    transformers=len(handle._models))
    finally:
        handle.disable()
    return {"cmp": compare(ref, out), "cmp2": compare(ref, out2), "again": compare(ref, _run(pipe)), **info}


def case_ulysses():
    return _against_one_process(mode="ulysses")


def case_kv_gather():
    return _against_one_process(mode="kv_gather")


def case_shard_weights():
    return _against_one_process(mode="kv_gather", shard_weights=True)


def case_variants():
    """The other Wan modular pipelines, each in both dense modes."""
    return {f"{name}/{mode}": _against_one_process(name, mode=mode)
            for name in VARIANTS if name != "WanModularPipeline" for mode in ("ulysses", "kv_gather")}


def case_cfg_parallel_refused():
    return error_of(lambda: enable_sequence_parallel(_modular(), cfg_parallel=True))
