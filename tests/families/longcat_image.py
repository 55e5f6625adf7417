"""LongCat-Image: LongCatImageTransformer2DModel (Flux's joint attention, text first, no text mask, Qwen2.5-VL
text); the edit pipeline appends the reference image's tokens to the latent tokens."""

import torch

from diffusers_sp import tiny_models as tm
from families import Pipe, flux_ids, gen, image, kl_vae


def _transformer(seed: int = 0):
    """A ``LongCatImageTransformer2DModel``: 3 heads of 16 (uneven over 2 ranks), one dual- and one
    single-stream block, in_channels 64 (the pipelines' fixed 16 latent channels packed 2 x 2), text width 16 (the tiny Qwen2.5-VL's)."""
    from diffusers import LongCatImageTransformer2DModel

    torch.manual_seed(seed)
    return LongCatImageTransformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
                                          attention_head_dim=16, num_attention_heads=3, joint_attention_dim=16,
                                          pooled_projection_dim=16, axes_dims_rope=[4, 4, 8]).eval()


def _forward():
    g = gen()
    return _transformer(), dict(hidden_states=torch.randn(2, 35, 64, generator=g),
                                encoder_hidden_states=torch.randn(2, 7, 16, generator=g),
                                timestep=torch.tensor([0.5, 0.25]), img_ids=flux_ids(), txt_ids=torch.zeros(7, 3))


FORWARDS = {"": _forward}


def _build(cls_name: str, vae_blocks: int = 1):
    """``() -> pipeline``: the tiny Qwen2.5-VL text encoder and word tokenizer (with Qwen2.5-VL's vision
    tokens) of the QwenImage configs, their tiny Qwen2-VL processor, and a 512-token text budget cut to 8."""
    def build():
        import diffusers

        from families.qwenimage import _vl_processor, _vl_tokenizer

        encoder = tm.tiny_qwenimage_pipeline().text_encoder
        pipe = getattr(diffusers, cls_name)(transformer=_transformer(), text_encoder=encoder, tokenizer=_vl_tokenizer(),
                                            text_processor=_vl_processor(),
                                            vae=kl_vae(vae_blocks, 16, shift_factor=0.0609, scaling_factor=1.5035),
                                            scheduler=tm._flow_scheduler())
        pipe.tokenizer_max_length = 8
        return pipe
    return build


_CFG = dict(guidance_scale=4.0, negative_prompt=["rain", "snow at night over the city"])

PIPELINES = {
    # CFG as two calls; 10 x 14 pixels (no downsampling, 2 x 2 packing) give 5 x 7 tokens. Without the
    # prompt rewrite (text generation by the encoder before the pipeline runs, no transformer involved).
    "LongCatImagePipeline": Pipe(_build("LongCatImagePipeline"), lambda: dict(
        height=10, width=14, enable_prompt_rewrite=False, **_CFG)),
    # The edit pipeline resizes its input to about 1024 x 1024 pixels: a 6-block VAE (32 x down) and 2 x 2
    # packing make that 16 x 16 latent tokens, and the reference image as many again: 512 tokens (uneven
    # over 3 ranks only). One prompt: the pipeline encodes prompt[0] with the image.
    "LongCatImageEditPipeline": Pipe(_build("LongCatImageEditPipeline", vae_blocks=6), lambda: dict(
        prompt="a cat runs on the grass", negative_prompt="rain", guidance_scale=4.0, image=image(64, 64)), tokens=512),
}
