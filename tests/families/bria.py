"""Bria 3.2: BriaTransformer2DModel (Flux's joint attention, text first, no text mask; ControlNet inputs)."""

import torch

from diffusers_sp import tiny_models as tm
from families import Pipe, flux_ids, gen


def _transformer(seed: int = 0):
    """A ``BriaTransformer2DModel``: 3 heads of 16 (uneven over 2 ranks), one dual- and one single-stream
    block, in_channels 4 (one latent channel packed 2 x 2)."""
    from diffusers import BriaTransformer2DModel

    torch.manual_seed(seed)
    return BriaTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                  attention_head_dim=16, num_attention_heads=3, joint_attention_dim=32,
                                  axes_dims_rope=[4, 4, 8]).eval()


def _inputs(g, controlnet: bool = False):
    kwargs = dict(hidden_states=torch.randn(2, 35, 4, generator=g), encoder_hidden_states=torch.randn(2, 7, 32, generator=g),
                  timestep=torch.tensor([500.0, 250.0]), img_ids=flux_ids(), txt_ids=torch.zeros(7, 3))
    if controlnet:  # one residual per dual-stream block, added to the image tokens
        # (Diffusers 0.42's single-stream residuals fail in one process too: the forward slices the text
        # off image-only states.)
        kwargs.update(controlnet_block_samples=[torch.randn(2, 35, 48, generator=g)])
    return kwargs


FORWARDS = {"": lambda: (_transformer(), _inputs(gen())),
            "controlnet_residuals": lambda: (_transformer(), _inputs(gen(), controlnet=True))}


def _pipeline():
    """A tiny ``BriaPipeline`` (T5, the no-downsampling one-channel VAE): 10 x 14 pixels give 5 x 7 tokens."""
    from diffusers import BriaPipeline

    return BriaPipeline(transformer=_transformer(), text_encoder=tm.tiny_t5_encoder(), tokenizer=tm.tiny_tokenizer(),
                        vae=tm._tiny_kl_vae(1, 0), scheduler=tm._flow_scheduler())


PIPELINES = {
    # CFG folded into a batch of two (guidance_scale > 1), with negative prompts.
    "BriaPipeline": Pipe(_pipeline, lambda: dict(height=10, width=14, max_sequence_length=8, guidance_scale=4.0,
                                                 negative_prompt=["rain", "snow at night over the city"])),
}
