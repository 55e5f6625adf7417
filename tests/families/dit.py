"""DiT: DiTTransformer2DModel (class-conditional, image-only self-attention, no text)."""

import torch

from diffusers_sp import tiny_models as tm
from families import Forward, Pipe, gen


def _transformer(seed: int = 0):
    """A ``DiTTransformer2DModel``: 3 heads of 8 (uneven over 2 ranks), two blocks, patch 2, 4 latent channels
    (8 out: learned sigma), 10 x 10 latents by default (the pipeline's latent size)."""
    from diffusers import DiTTransformer2DModel

    torch.manual_seed(seed)
    return DiTTransformer2DModel(num_attention_heads=3, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2,
                                 sample_size=10, patch_size=2, norm_num_groups=1).eval()


def _forward():
    """10 x 10 latents at patch 2 (the model unpatchifies a square): 25 tokens; two class labels."""
    g = gen()
    return _transformer(), dict(hidden_states=torch.randn(2, 4, 10, 10, generator=g), timestep=torch.tensor([500, 250]),
                                class_labels=torch.tensor([1, 7]))


FORWARDS = {"": Forward(_forward, tokens=25)}


def _pipeline():
    from diffusers import DDIMScheduler, DiTPipeline

    return DiTPipeline(transformer=_transformer(), vae=tm._tiny_kl_vae(4, 0), scheduler=DDIMScheduler())


PIPELINES = {
    # The pipeline's square latents: 10 x 10 at patch 2, 25 tokens. Guidance folded into a batch of two (the
    # null class 1000).
    "DiTPipeline": Pipe(_pipeline, lambda: dict(class_labels=[1, 7], guidance_scale=4.0, output_type="np"), tokens=25),
}
