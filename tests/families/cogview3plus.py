"""CogView3-Plus: CogView3PlusTransformer2DModel (joint attention, text first, no text mask)."""

import torch

from diffusers_sp import tiny_models as tm
from families import Pipe, gen, kl_vae


def _transformer(seed: int = 0):
    """A ``CogView3PlusTransformer2DModel``: 3 heads of 8 (uneven over 2 ranks), two blocks, patch 2, 4 latent
    channels, text width 32 (the tiny T5's), positions up to 16 x 16 patches."""
    from diffusers import CogView3PlusTransformer2DModel

    torch.manual_seed(seed)
    return CogView3PlusTransformer2DModel(patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
                                          num_attention_heads=3, out_channels=4, text_embed_dim=32, time_embed_dim=16,
                                          condition_dim=8, pos_embed_max_size=16, sample_size=16).eval()


def _forward():
    """10 x 14 latents at patch 2: 5 x 7 tokens; two prompts of 7 text tokens; the size conditions."""
    g = gen()
    size = torch.tensor([[80.0, 112.0]] * 2)
    return _transformer(), dict(hidden_states=torch.randn(2, 4, 10, 14, generator=g),
                                encoder_hidden_states=torch.randn(2, 7, 32, generator=g), timestep=torch.tensor([500, 250]),
                                original_size=size, target_size=size, crop_coords=torch.zeros(2, 2))


FORWARDS = {"": _forward}


def _pipeline():
    from diffusers import CogVideoXDDIMScheduler, CogView3PlusPipeline

    return CogView3PlusPipeline(transformer=_transformer(), text_encoder=tm.tiny_t5_encoder(), tokenizer=tm.tiny_tokenizer(),
                                vae=kl_vae(4, 4), scheduler=CogVideoXDDIMScheduler())


PIPELINES = {
    # 80 x 112 pixels through an 8 x VAE: 10 x 14 latents, 5 x 7 tokens; CFG folded into the batch.
    "CogView3PlusPipeline": Pipe(_pipeline, lambda: dict(height=80, width=112, max_sequence_length=8, guidance_scale=4.0,
                                                         negative_prompt=["rain", "snow at night over the city"])),
}
