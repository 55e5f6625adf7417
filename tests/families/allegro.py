"""Allegro: AllegroTransformer3DModel (video-only self-attention with 3-D RoPE from the pipeline, T5 text in
cross-attention with its key padding mask)."""

import torch

from diffusers_sp import tiny_models as tm
from families import Forward, Pipe, gen, ragged_mask


def _transformer(seed: int = 0):
    """An ``AllegroTransformer3DModel``: 3 heads of 24 (uneven over 2 ranks; RoPE thirds of 8), two blocks,
    patch (1, 2, 2), 4 latent channels, caption width 32 (the tiny T5's)."""
    from diffusers import AllegroTransformer3DModel

    torch.manual_seed(seed)
    return AllegroTransformer3DModel(num_attention_heads=3, attention_head_dim=24, num_layers=2, cross_attention_dim=72,
                                     caption_channels=32, sample_height=10, sample_width=14, sample_frames=2).eval()


def _rope(frames: int, height: int, width: int):
    """The pipeline's RoPE for a latent grid of ``frames`` x ``height`` x ``width`` patches."""
    from diffusers import AllegroPipeline

    class _Sizes:  # what the method reads of its pipeline: the transformer's config, a VAE of scale 1
        transformer = _transformer()
        vae_scale_factor_spatial = 1

    return AllegroPipeline._prepare_rotary_positional_embeddings(_Sizes(), 1, height * 2, width * 2, frames, "cpu")


def _forward():
    """2 latent frames of 10 x 14 at patch (1, 2, 2): 2 x 5 x 7 = 70 tokens (not 35: 2 frames, so that
    positions along time differ); two prompts of 7 and 4 text tokens."""
    g = gen()
    return _transformer(), dict(hidden_states=torch.randn(2, 4, 2, 10, 14, generator=g),
                                encoder_hidden_states=torch.randn(2, 7, 32, generator=g),
                                encoder_attention_mask=ragged_mask([7, 4], 7), timestep=torch.tensor([500, 250]),
                                image_rotary_emb=_rope(2, 5, 7))


FORWARDS = {"ragged_prompts": Forward(_forward, tokens=70)}


def _pipeline():
    """A tiny ``AllegroPipeline``: the tiny T5, an ``AutoencoderKLAllegro`` of four blocks (8 x spatial,
    4 x temporal down) and 4 latent channels."""
    from diffusers import AllegroPipeline, AutoencoderKLAllegro, EulerDiscreteScheduler

    torch.manual_seed(0)
    vae = AutoencoderKLAllegro(block_out_channels=(8, 8, 8, 8), latent_channels=4, layers_per_block=1,
                               norm_num_groups=2).eval()
    return AllegroPipeline(transformer=_transformer(), text_encoder=tm.tiny_t5_encoder(), tokenizer=tm.tiny_tokenizer(),
                           vae=vae, scheduler=EulerDiscreteScheduler())


PIPELINES = {
    # 5 frames of 80 x 112 pixels: 2 latent frames of 10 x 14, 70 tokens; CFG folded into the batch.
    "AllegroPipeline": Pipe(_pipeline, lambda: dict(height=80, width=112, num_frames=5, max_sequence_length=8,
                                                    guidance_scale=4.0, clean_caption=False,
                                                    negative_prompt=["rain", "snow at night over the city"]), tokens=70),
}
