"""QwenImage: QwenImageTransformer2DModel (joint attention, text first, text mask)."""

import torch

from diffusers_sp import tiny_models as tm
from families import Pipe, gen, ragged_mask


def _forward():
    g = gen()
    return tm.tiny_qwenimage_transformer(), dict(
        hidden_states=torch.randn(2, 35, 16, generator=g), encoder_hidden_states=torch.randn(2, 8, 16, generator=g),
        encoder_hidden_states_mask=ragged_mask([8, 3], 8), timestep=torch.tensor([0.5, 0.25]),
        img_shapes=[[(1, 5, 7)]] * 2)


FORWARDS = {"ragged_prompts": _forward}

PIPELINES = {
    # QwenImage runs CFG as two calls; a negative prompt turns true CFG on.
    "QwenImagePipeline": Pipe(tm.tiny_qwenimage_pipeline, lambda: dict(
        height=40, width=56, negative_prompt=["rain", "snow at night over the city"], true_cfg_scale=4.0)),
}
