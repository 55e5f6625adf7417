"""CogVideoX: CogVideoXTransformer3DModel (joint attention, text first, no text mask)."""

import torch

from diffusers_sp import tiny_models as tm
from families import Pipe, gen


def _inputs(g):
    return dict(hidden_states=torch.randn(2, 1, 4, 10, 14, generator=g),
                encoder_hidden_states=torch.randn(2, 8, 32, generator=g), timestep=torch.tensor([500, 250]))


def _forward():
    return tm.tiny_cogvideox_transformer(), _inputs(gen())


def _forward_rope():
    """CogVideoX 1.5 / 5b style: RoPE tables passed by the pipeline as image_rotary_emb, split at the input."""
    g = gen()
    rope = (torch.randn(35, 16, generator=g), torch.randn(35, 16, generator=g))
    return tm.tiny_cogvideox_transformer(use_rotary_positional_embeddings=True), dict(_inputs(g), image_rotary_emb=rope)


FORWARDS = {"": _forward, "rope": _forward_rope}

PIPELINES = {
    "CogVideoXPipeline": Pipe(tm.tiny_cogvideox_pipeline, lambda: dict(
        height=80, width=112, num_frames=1, max_sequence_length=8, guidance_scale=6.0)),
}
