"""PixArt-alpha / Sigma: PixArtTransformer2DModel (image-only self-attention, T5 text in cross-attention
with its key padding mask)."""

import torch

from diffusers_sp import tiny_models as tm
from families import Pipe, gen, kl_vae, ragged_mask


def _transformer(seed: int = 0, **overrides):
    """A ``PixArtTransformer2DModel``: 3 heads of 8 (uneven over 2 ranks), two blocks, patch 2, 4 latent
    channels, caption width 32 (the tiny T5's); PixArt-Sigma style (``sample_size`` 32, no resolution
    conditions) unless ``overrides`` say."""
    from diffusers import PixArtTransformer2DModel

    torch.manual_seed(seed)
    cfg = dict(num_attention_heads=3, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2,
               sample_size=32, patch_size=2, caption_channels=32, cross_attention_dim=24,
               norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6, use_additional_conditions=False)
    cfg.update(overrides)
    return PixArtTransformer2DModel(**cfg).eval()


def _inputs(g, **extra):
    """10 x 14 latents at patch 2: 5 x 7 tokens; two prompts of 7 and 4 text tokens."""
    return dict(hidden_states=torch.randn(2, 4, 10, 14, generator=g), encoder_hidden_states=torch.randn(2, 7, 32, generator=g),
                encoder_attention_mask=ragged_mask([7, 4], 7), timestep=torch.tensor([500, 250]), **extra)


def _forward_alpha():
    """PixArt-alpha: the resolution and aspect-ratio conditions of ``added_cond_kwargs``."""
    g = gen()
    return _transformer(use_additional_conditions=True), _inputs(
        g, added_cond_kwargs=dict(resolution=torch.tensor([[80.0, 112.0]] * 2), aspect_ratio=torch.tensor([[1.4]] * 2)))


FORWARDS = {"ragged_prompts": lambda: (_transformer(), _inputs(gen())), "alpha_conditions": _forward_alpha}


def _build(cls_name: str, **transformer):
    """``() -> pipeline``: the tiny T5 and word tokenizer, a 4 x VAE (the pipelines want pixel sides divisible
    by 8), a transformer of ``transformer``'s config."""
    def build():
        import diffusers
        from diffusers import DPMSolverMultistepScheduler

        return getattr(diffusers, cls_name)(transformer=_transformer(**transformer), text_encoder=tm.tiny_t5_encoder(),
                                            tokenizer=tm.tiny_tokenizer(), vae=kl_vae(3, 4), scheduler=DPMSolverMultistepScheduler())
    return build


def _call(**extra):
    """40 x 56 pixels: 10 x 14 latents, 5 x 7 tokens at patch 2 (no resolution binning, which resizes to about
    1024 x 1024); CFG folded into the batch, with negative prompts."""
    return dict(height=40, width=56, use_resolution_binning=False, max_sequence_length=8, guidance_scale=4.0,
                negative_prompt=["rain", "snow at night over the city"], clean_caption=False, **extra)


PIPELINES = {
    # PixArt-alpha's pipeline passes the resolution conditions only to a transformer of sample_size 128.
    "PixArtAlphaPipeline": Pipe(_build("PixArtAlphaPipeline", use_additional_conditions=True, sample_size=128), _call),
    "PixArtSigmaPipeline": Pipe(_build("PixArtSigmaPipeline"), _call),
    # PAG on block 1 (the pipeline's default, "blocks.1"): CFG and the perturbed pass in one batch of 3.
    "PixArtSigmaPAGPipeline": Pipe(_build("PixArtSigmaPAGPipeline"), lambda: _call(pag_scale=3.0)),
}
