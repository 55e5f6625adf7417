"""Flux: FluxTransformer2DModel (joint attention, text first, no text mask)."""

import torch

from diffusers_sp import tiny_models as tm
from families import Pipe, gen


def _ids(batched: bool = False):
    ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(5.0), torch.arange(7.0), indexing="ij"), -1)
    return ids.reshape(1, -1, 3) if batched else ids.reshape(-1, 3)


def _forward():
    g = gen()
    return tm.tiny_flux_transformer(guidance_embeds=True), dict(
        hidden_states=torch.randn(2, 35, 4, generator=g), encoder_hidden_states=torch.randn(2, 7, 32, generator=g),
        pooled_projections=torch.randn(2, 32, generator=g), timestep=torch.tensor([0.5, 0.25]),
        guidance=torch.tensor([3.5, 3.5]), img_ids=_ids(), txt_ids=torch.zeros(7, 3))


def _forward_3d_ids():
    """The deprecated ``[B, S, 3]`` ids Diffusers still accepts (its forward takes ``ids[0]``): the 3-D
    ``img_ids`` once passed unsplit, and each rank's RoPE covered every image token."""
    g = gen()
    return tm.tiny_flux_transformer(guidance_embeds=True), dict(
        hidden_states=torch.randn(1, 35, 4, generator=g), encoder_hidden_states=torch.randn(1, 7, 32, generator=g),
        pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([0.5]),
        guidance=torch.tensor([3.5]), img_ids=_ids(batched=True), txt_ids=torch.zeros(1, 7, 3))


FORWARDS = {"": _forward, "3d_ids": _forward_3d_ids}

PIPELINES = {
    "FluxPipeline": Pipe(tm.tiny_flux_pipeline, lambda: dict(height=10, width=14, max_sequence_length=8,
                                                             guidance_scale=3.5)),
}
