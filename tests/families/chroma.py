"""Chroma: ChromaTransformer2DModel (Flux-like joint attention, text first; a 0/1 text mask that the model
turns into an additive [B, 1, L, L] mask over the full sequence)."""

import torch

import families
from diffusers_sp import tiny_models as tm
from families import Pipe, gen


def _transformer(seed: int = 0):
    """A ``ChromaTransformer2DModel``: 3 heads of 16 (uneven over 2 ranks), one dual- and one
    single-stream block, in_channels 4, a one-layer modulation approximator."""
    from diffusers import ChromaTransformer2DModel

    torch.manual_seed(seed)
    return ChromaTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
                                    num_attention_heads=3, joint_attention_dim=32, axes_dims_rope=(4, 4, 8),
                                    approximator_num_channels=8, approximator_hidden_dim=16,
                                    approximator_layers=1).eval()


def _inputs(g, controlnet: bool = False):
    """Two prompts of 7 and 3 text tokens, masked as ChromaPipeline masks them (0/1 floats; the first
    padding token kept), followed by ones over the 35 image tokens."""
    text = torch.tensor([[1.0] * 7, [1.0] * 4 + [0.0] * 3])
    kwargs = dict(hidden_states=torch.randn(2, 35, 4, generator=g), encoder_hidden_states=torch.randn(2, 7, 32, generator=g),
                  timestep=torch.tensor([0.5, 0.25]), img_ids=_ids(), txt_ids=torch.zeros(7, 3),
                  attention_mask=torch.cat([text, torch.ones(2, 35)], dim=1))
    if controlnet:  # one residual per block of each kind, added to the image tokens
        kwargs.update(controlnet_block_samples=[torch.randn(2, 35, 48, generator=g)],
                      controlnet_single_block_samples=[torch.randn(2, 35, 48, generator=g)])
    return kwargs


def _ids():
    ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(5.0), torch.arange(7.0), indexing="ij"), -1)
    return ids.reshape(-1, 3)


FORWARDS = {
    "ragged_prompts": lambda: (_transformer(), _inputs(gen())),
    "controlnet_residuals": lambda: (_transformer(), _inputs(gen(), controlnet=True)),
}


# ------------------------------------------------------------------ tiny pipelines
# As for Flux: the tiny VAE does not downsample and 2 x 2 latents are packed into one token, so
# 10 x 14 pixels give 5 x 7 = 35 image tokens. CFG is on (guidance_scale > 1): two calls per step.

H, W = 10, 14


def _build(name: str):
    def build():
        import diffusers

        transformer = _transformer()
        # Diffusers 0.42's ChromaInpaintPipeline reads `transformer.config.guidance_embeds`, which
        # ChromaTransformer2DModel does not register (an AttributeError in one process too); the guidance
        # it would make is never passed to the transformer.
        transformer.register_to_config(guidance_embeds=False)
        return getattr(diffusers, name)(transformer=transformer, text_encoder=tm.tiny_t5_encoder(),
                                        tokenizer=tm.tiny_tokenizer(), vae=tm._tiny_kl_vae(1, 0),
                                        scheduler=tm._flow_scheduler())
    return build


def _text2img(**extra):
    return dict(height=H, width=W, max_sequence_length=8, guidance_scale=4.0,
                negative_prompt=["rain", "snow at night over the city"], **extra)


def _img2img(**extra):
    """4 scheduler steps at strength 0.5: 2 denoising steps from the noised input image."""
    return _text2img(image=families.image(W, H), num_inference_steps=4, strength=0.5, **extra)


PIPELINES = {
    "ChromaPipeline": Pipe(_build("ChromaPipeline"), _text2img),
    "ChromaImg2ImgPipeline": Pipe(_build("ChromaImg2ImgPipeline"), _img2img),
    "ChromaInpaintPipeline": Pipe(_build("ChromaInpaintPipeline"),
                                  lambda: _img2img(mask_image=families.mask_image(W, H))),
}
