"""Latte: LatteTransformer3DModel (spatial attention over each frame's tokens, split; temporal attention over
each position's frames, local; T5 text in cross-attention)."""

import torch

from diffusers_sp import tiny_models as tm
from families import Pipe, gen, kl_vae


def _transformer(seed: int = 0):
    """A ``LatteTransformer3DModel``: 3 heads of 8 (uneven over 2 ranks), two spatial and two temporal blocks,
    patch 2, 4 latent channels (8 out: learned sigma), caption width 32 (the tiny T5's), 3 frames."""
    from diffusers import LatteTransformer3DModel

    torch.manual_seed(seed)
    return LatteTransformer3DModel(num_attention_heads=3, attention_head_dim=8, in_channels=4, out_channels=8,
                                   num_layers=2, cross_attention_dim=24, sample_size=16, patch_size=2,
                                   norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6,
                                   caption_channels=32, video_length=3).eval()


def _forward():
    """3 frames of 10 x 14 latents at patch 2: 5 x 7 = 35 spatial tokens a frame (the split sequence); two prompts
    of 7 text tokens (no text mask: the model repeats the text per frame but not a mask)."""
    g = gen()
    return _transformer(), dict(hidden_states=torch.randn(2, 4, 3, 10, 14, generator=g),
                                encoder_hidden_states=torch.randn(2, 7, 32, generator=g), timestep=torch.tensor([500, 250]))


FORWARDS = {"": _forward}


def _pipeline():
    """A tiny ``LattePipeline``: the tiny T5, an 8 x VAE (per frame) of 4 channels."""
    from diffusers import DDIMScheduler, LattePipeline

    return LattePipeline(transformer=_transformer(), text_encoder=tm.tiny_t5_encoder(), tokenizer=tm.tiny_tokenizer(),
                         vae=kl_vae(4, 4), scheduler=DDIMScheduler())


PIPELINES = {
    # 3 frames of 80 x 112 pixels: 10 x 14 latents, 35 spatial tokens; CFG folded into the batch.
    "LattePipeline": Pipe(_pipeline, lambda: dict(height=80, width=112, video_length=3, guidance_scale=4.0,
                                                  clean_caption=False, mask_feature=False,
                                                  negative_prompt=["rain", "snow at night over the city"])),
}
