"""AuraFlow: AuraFlowTransformer2DModel (joint attention, register tokens and UMT5 text first, no text mask)."""

import torch

from diffusers_sp import tiny_models as tm
from families import Pipe, gen


def _transformer(seed: int = 0):
    """An ``AuraFlowTransformer2DModel``: 3 heads of 16 (uneven over 2 ranks), one MMDiT and one single
    block, patch 2, 4 latent channels, text width 32 (the tiny UMT5's), positions up to 16 x 16 patches."""
    from diffusers import AuraFlowTransformer2DModel

    torch.manual_seed(seed)
    return AuraFlowTransformer2DModel(sample_size=32, patch_size=2, in_channels=4, num_mmdit_layers=1,
                                      num_single_dit_layers=1, attention_head_dim=16, num_attention_heads=3,
                                      joint_attention_dim=32, caption_projection_dim=48, out_channels=4,
                                      pos_embed_max_size=256).eval()


def _forward():
    """10 x 14 latents at patch 2: 5 x 7 tokens; two prompts of 7 text tokens."""
    g = gen()
    return _transformer(), dict(hidden_states=torch.randn(2, 4, 10, 14, generator=g),
                                encoder_hidden_states=torch.randn(2, 7, 32, generator=g), timestep=torch.tensor([0.5, 0.25]))


FORWARDS = {"": _forward}


def _pipeline():
    from diffusers import AuraFlowPipeline

    return AuraFlowPipeline(transformer=_transformer(), text_encoder=tm.tiny_umt5_encoder(), tokenizer=tm.tiny_tokenizer(),
                            vae=tm._tiny_kl_vae(4, 0), scheduler=tm._flow_scheduler())


PIPELINES = {
    # 10 x 14 pixels through the no-downsampling VAE: 5 x 7 tokens; CFG folded into the batch.
    "AuraFlowPipeline": Pipe(_pipeline, lambda: dict(height=10, width=14, max_sequence_length=8, guidance_scale=4.0,
                                                     negative_prompt=["rain", "snow at night over the city"])),
}
