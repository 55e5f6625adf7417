"""HunyuanVideo: HunyuanVideoTransformer3DModel (joint attention, text last, text mask)."""

import torch

from diffusers_sp import tiny_models as tm
from families import Pipe, gen, ragged_mask


def _inputs(g, frames: int = 1, height: int = 5, width: int = 7):
    return dict(hidden_states=torch.randn(2, 4, frames, height, width, generator=g),
                encoder_hidden_states=torch.randn(2, 7, 16, generator=g), encoder_attention_mask=ragged_mask([7, 4], 7),
                pooled_projections=torch.randn(2, 8, generator=g), timestep=torch.tensor([500, 250]),
                guidance=torch.tensor([6000.0, 6000.0]))


def _forward():
    return tm.tiny_hunyuan_video_transformer(), _inputs(gen())


def _forward_token_replace():
    """image_condition_type="token_replace": 5 frames of 1 x 7, so the first frame's 7 tokens end inside
    rank 0's shard (18 or 12 tokens at 2 or 3 ranks) and the other ranks hold none."""
    return (tm.tiny_hunyuan_video_transformer(image_condition_type="token_replace"),
            _inputs(gen(), frames=5, height=1, width=7))


def _forward_token_replace_one_frame():
    """image_condition_type="token_replace" with one frame: every token is a first-frame token, on every rank."""
    return tm.tiny_hunyuan_video_transformer(image_condition_type="token_replace"), _inputs(gen())


FORWARDS = {"ragged_prompts": _forward, "token_replace": _forward_token_replace,
            "token_replace_one_frame": _forward_token_replace_one_frame}

PIPELINES = {
    "HunyuanVideoPipeline": Pipe(tm.tiny_hunyuan_video_pipeline, lambda: dict(
        height=80, width=112, num_frames=1, max_sequence_length=8, guidance_scale=6.0,
        prompt_template={"template": "{}", "crop_start": 0})),
}
