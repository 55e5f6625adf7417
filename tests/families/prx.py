"""PRX: PRXTransformer2DModel (image queries over [text; image] keys, the text's key padding mask)."""

import torch

from diffusers_sp import tiny_models as tm
from families import Pipe, gen, ragged_mask


def _transformer(in_channels: int = 4, seed: int = 0):
    """A ``PRXTransformer2DModel``: 3 heads of 16 (uneven over 2 ranks), two blocks, patch 2, text width 32
    (the tiny T5's), ``in_channels`` latent (or pixel) channels."""
    from diffusers import PRXTransformer2DModel

    torch.manual_seed(seed)
    return PRXTransformer2DModel(in_channels=in_channels, patch_size=2, context_in_dim=32, hidden_size=48, mlp_ratio=2.0,
                                 num_heads=3, depth=2, axes_dim=[8, 8]).eval()


def _forward():
    """10 x 14 latents at patch 2: 5 x 7 tokens; two prompts of 7 and 4 text tokens (masked)."""
    g = gen()
    return _transformer(), dict(hidden_states=torch.randn(2, 4, 10, 14, generator=g),
                                encoder_hidden_states=torch.randn(2, 7, 32, generator=g), timestep=torch.tensor([0.5, 0.25]),
                                attention_mask=ragged_mask([7, 4], 7).bool())


FORWARDS = {"ragged_prompts": _forward}


def _build(cls_name: str, in_channels: int = 4, vae: bool = True):
    def build():
        import diffusers

        parts = dict(vae=tm._tiny_kl_vae(4, 0)) if vae else {}
        return getattr(diffusers, cls_name)(transformer=_transformer(in_channels), text_encoder=tm.tiny_t5_encoder(),
                                            tokenizer=tm.tiny_tokenizer(), scheduler=tm._flow_scheduler(), **parts)
    return build


#: One prompt (the pipelines fold CFG into a batch of two for a single sample), without resolution binning
#: (which maps the size to about 512 x 512 pixels).
_ONE = dict(prompt="a cat runs on the grass under the blue sky", negative_prompt="rain", guidance_scale=4.0,
            use_resolution_binning=False)

PIPELINES = {
    # 10 x 14 pixels through the no-downsampling VAE: 5 x 7 tokens at patch 2.
    "PRXPipeline": Pipe(_build("PRXPipeline"), lambda: dict(height=10, width=14, **_ONE)),
    # Pixel space: 10 x 14 RGB pixels at patch 2.
    "PRXPixelPipeline": Pipe(_build("PRXPixelPipeline", in_channels=3, vae=False), lambda: dict(height=10, width=14, **_ONE)),
}
