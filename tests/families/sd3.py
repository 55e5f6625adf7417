"""Stable Diffusion 3 / 3.5: SD3Transformer2DModel (joint attention, text last)."""

import torch

from diffusers_sp import tiny_models as tm
from families import Pipe, gen


def _forward():
    g = gen()
    return tm.tiny_sd3_transformer(), dict(
        hidden_states=torch.randn(2, 4, 5, 7, generator=g), encoder_hidden_states=torch.randn(2, 7, 32, generator=g),
        pooled_projections=torch.randn(2, 64, generator=g), timestep=torch.tensor([500, 250]))


FORWARDS = {"": _forward}

PIPELINES = {
    "StableDiffusion3Pipeline": Pipe(tm.tiny_sd3_pipeline, lambda: dict(height=5, width=7, max_sequence_length=8,
                                                                        guidance_scale=5.0)),
}
