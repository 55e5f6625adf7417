"""Mochi 1: MochiTransformer3DModel (joint attention, text last, text mask applied per sample)."""

import torch

from diffusers_sp import tiny_models as tm
from families import FEW_TOKENS, Forward, Pipe, gen, ragged_mask


def _forward():
    g = gen()
    return tm.tiny_mochi_transformer(), dict(
        hidden_states=torch.randn(2, 12, 1, 10, 14, generator=g), encoder_hidden_states=torch.randn(2, 7, 32, generator=g),
        encoder_attention_mask=ragged_mask([7, 4], 7), timestep=torch.tensor([500, 250]))


def _forward_few_tokens():
    """One frame of 2 x 4 latents: 2 tokens, fewer than 3 ranks, with ragged prompts."""
    g = gen()
    return tm.tiny_mochi_transformer(), dict(
        hidden_states=torch.randn(2, 12, 1, 2, 4, generator=g), encoder_hidden_states=torch.randn(2, 7, 32, generator=g),
        encoder_attention_mask=ragged_mask([7, 4], 7), timestep=torch.tensor([500, 250]))

FORWARDS = {"ragged_prompts": _forward, "few_tokens": Forward(_forward_few_tokens, tokens=FEW_TOKENS)}

PIPELINES = {
    "MochiPipeline": Pipe(tm.tiny_mochi_pipeline, lambda: dict(height=80, width=112, num_frames=1,
                                                               max_sequence_length=8, guidance_scale=4.5)),
}
