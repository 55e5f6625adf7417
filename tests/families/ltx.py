"""LTX-Video: LTXVideoTransformer3DModel (text in cross-attention, text mask)."""

import torch

from diffusers_sp import tiny_models as tm
from families import Pipe, gen, ragged_mask


def _forward():
    g = gen()
    return tm.tiny_ltx_transformer(), dict(
        hidden_states=torch.randn(2, 35, 8, generator=g), encoder_hidden_states=torch.randn(2, 7, 32, generator=g),
        encoder_attention_mask=ragged_mask([7, 4], 7), timestep=torch.tensor([500, 250]), num_frames=1, height=5,
        width=7)


FORWARDS = {"ragged_prompts": _forward}

PIPELINES = {
    "LTXPipeline": Pipe(tm.tiny_ltx_pipeline, lambda: dict(height=160, width=224, num_frames=1, max_sequence_length=8,
                                                           guidance_scale=3.0)),
}
