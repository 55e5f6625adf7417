"""Stable Diffusion 3 / 3.5: SD3Transformer2DModel (joint attention, text last)."""

import torch

from diffusers_sp import tiny_models as tm
from families import FEW_TOKENS, Forward, Modular, Pipe, gen, image, mask_image


def _forward():
    g = gen()
    return tm.tiny_sd3_transformer(), dict(
        hidden_states=torch.randn(2, 4, 5, 7, generator=g), encoder_hidden_states=torch.randn(2, 7, 32, generator=g),
        pooled_projections=torch.randn(2, 64, generator=g), timestep=torch.tensor([500, 250]))


def _forward_few_tokens():
    """1 x 2 latents: 2 tokens, fewer than 3 ranks (split at the patch embedding, inside the forward)."""
    g = gen()
    return tm.tiny_sd3_transformer(), dict(
        hidden_states=torch.randn(2, 4, 1, 2, generator=g), encoder_hidden_states=torch.randn(2, 7, 32, generator=g),
        pooled_projections=torch.randn(2, 64, generator=g), timestep=torch.tensor([500, 250]))

FORWARDS = {"": _forward, "few_tokens": Forward(_forward_few_tokens, tokens=FEW_TOKENS)}


def _vae(channels: int = 4, blocks: int = 1, seed: int = 0):
    """An ``AutoencoderKL`` with ``channels`` latent channels and ``blocks`` blocks of 4 channels: 1 block
    does not downsample (5 x 7 pixels are 5 x 7 latents); 4 blocks downsample 8 x (40 x 56 pixels are 5 x 7
    latents), for the ControlNet pipeline, which wants height and width divisible by 8."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,) * blocks,
                         down_block_types=("DownEncoderBlock2D",) * blocks, up_block_types=("UpDecoderBlock2D",) * blocks,
                         layers_per_block=1, latent_channels=channels, norm_num_groups=1, use_quant_conv=False,
                         use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035).eval()


def _randomize_zeros(model, seed: int = 0):
    """Fills the parameters that a ControlNet initialises to zero (its ``controlnet_blocks`` and the input
    embedding of the control image, Diffusers' ``zero_module``) with small random values: with zeros the
    residuals added to the image tokens would be zero and their split would go untested."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _sd3(cls, channels: int = 4, **extra):
    """A tiny SD3 pipeline of class ``cls`` from the components of ``tm.tiny_sd3_pipeline``, with a VAE and
    transformer of ``channels`` latent channels, and ``extra`` components (they replace those)."""
    parts = tm.tiny_sd3_pipeline().components
    if channels != 4:
        parts.update(vae=_vae(channels), transformer=tm.tiny_sd3_transformer(in_channels=channels, out_channels=channels))
    parts.update(extra)
    expected, optional = cls._get_signature_keys(cls)
    parts = {k: v for k, v in parts.items() if k in set(expected) | set(optional)}
    return cls(**parts)


def _controlnet(extra_conditioning_channels: int = 0):
    """An ``SD3ControlNetModel`` with the tiny transformer's width (3 heads of 8) and 4 channels, one block."""
    from diffusers import SD3ControlNetModel

    torch.manual_seed(1)
    net = SD3ControlNetModel(sample_size=32, patch_size=1, in_channels=4, num_layers=1, attention_head_dim=8,
                             num_attention_heads=3, joint_attention_dim=32, caption_projection_dim=24,
                             pooled_projection_dim=64, out_channels=4,
                             extra_conditioning_channels=extra_conditioning_channels).eval()
    return _randomize_zeros(net)


def _img2img():
    from diffusers import StableDiffusion3Img2ImgPipeline

    return _sd3(StableDiffusion3Img2ImgPipeline)


def _inpaint():
    from diffusers import StableDiffusion3InpaintPipeline

    # The inpainting pipeline takes a transformer of 16 input channels (SD3's latents) or 33.
    return _sd3(StableDiffusion3InpaintPipeline, channels=16)


def _controlnet_pipe():
    from diffusers import StableDiffusion3ControlNetPipeline

    return _sd3(StableDiffusion3ControlNetPipeline, controlnet=_controlnet(), vae=_vae(blocks=4))


def _controlnet_inpainting():
    from diffusers import StableDiffusion3ControlNetInpaintingPipeline

    # The control image is the masked image's latents and the mask: one extra channel.
    return _sd3(StableDiffusion3ControlNetInpaintingPipeline, controlnet=_controlnet(extra_conditioning_channels=1))


def _pag(cls):
    """A PAG pipeline of class ``cls`` on a 3-block transformer with PAG at block 1: not the last block, whose
    text output SD3 drops (``context_pre_only``), so that the text rows of the perturbed attention matter;
    not block 0, whose SD3.5 image-only ``attn2`` the PAG processors cannot run (they need the text)."""
    return _sd3(cls, transformer=tm.tiny_sd3_transformer(num_layers=3), pag_applied_layers=["blocks.1"])


def _pag_pipe():
    from diffusers import StableDiffusion3PAGPipeline

    return _pag(StableDiffusion3PAGPipeline)


def _pag_img2img():
    from diffusers import StableDiffusion3PAGImg2ImgPipeline

    return _pag(StableDiffusion3PAGImg2ImgPipeline)


_CALL = dict(height=5, width=7, max_sequence_length=8, guidance_scale=5.0)

PIPELINES = {
    "StableDiffusion3Pipeline": Pipe(tm.tiny_sd3_pipeline, lambda: dict(_CALL)),
    "StableDiffusion3Img2ImgPipeline": Pipe(_img2img, lambda: dict(_CALL, image=image(7, 5), strength=0.9)),
    "StableDiffusion3InpaintPipeline": Pipe(_inpaint, lambda: dict(
        _CALL, image=image(7, 5), mask_image=mask_image(7, 5), strength=0.9)),
    "StableDiffusion3ControlNetPipeline": Pipe(_controlnet_pipe, lambda: dict(
        _CALL, height=40, width=56, control_image=image(56, 40, seed=1))),
    "StableDiffusion3ControlNetInpaintingPipeline": Pipe(_controlnet_inpainting, lambda: dict(
        _CALL, control_image=image(7, 5, seed=1), control_mask=mask_image(7, 5))),
    # PAG with CFG: a batch of [uncond, cond, perturbed] (PAGCFGJointAttnProcessor2_0) ...
    "StableDiffusion3PAGPipeline": Pipe(_pag_pipe, lambda: dict(_CALL, pag_scale=3.0)),
    # ... and without (guidance_scale 1): [cond, perturbed] (PAGJointAttnProcessor2_0).
    "StableDiffusion3PAGImg2ImgPipeline": Pipe(_pag_img2img, lambda: dict(
        _CALL, guidance_scale=1.0, pag_scale=3.0, image=image(7, 5), strength=0.9)),
}


# Modular pipelines (diffusers.modular_pipelines) run with the components and call of a classic case.
MODULAR = {
    "StableDiffusion3ModularPipeline": Modular("StableDiffusion3Pipeline"),
}
