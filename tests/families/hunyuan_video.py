"""HunyuanVideo: HunyuanVideoTransformer3DModel (joint attention, text last, text mask)."""

import torch

from diffusers_sp import tiny_models as tm
from families import Pipe, gen, ragged_mask


def _forward():
    g = gen()
    return tm.tiny_hunyuan_video_transformer(), dict(
        hidden_states=torch.randn(2, 4, 1, 5, 7, generator=g), encoder_hidden_states=torch.randn(2, 7, 16, generator=g),
        encoder_attention_mask=ragged_mask([7, 4], 7), pooled_projections=torch.randn(2, 8, generator=g),
        timestep=torch.tensor([500, 250]), guidance=torch.tensor([6000.0, 6000.0]))


FORWARDS = {"ragged_prompts": _forward}

PIPELINES = {
    "HunyuanVideoPipeline": Pipe(tm.tiny_hunyuan_video_pipeline, lambda: dict(
        height=80, width=112, num_frames=1, max_sequence_length=8, guidance_scale=6.0,
        prompt_template={"template": "{}", "crop_start": 0})),
}
