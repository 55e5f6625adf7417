"""QwenImage: QwenImageTransformer2DModel (joint attention, text first, text mask)."""

import torch

from diffusers_sp import tiny_models as tm
from families import Pipe, gen, image, mask_image, ragged_mask


def _forward():
    g = gen()
    return tm.tiny_qwenimage_transformer(), dict(
        hidden_states=torch.randn(2, 35, 16, generator=g), encoder_hidden_states=torch.randn(2, 8, 16, generator=g),
        encoder_hidden_states_mask=ragged_mask([8, 3], 8), timestep=torch.tensor([0.5, 0.25]),
        img_shapes=[[(1, 5, 7)]] * 2)


FORWARDS = {"ragged_prompts": _forward}


def _randomize_zeros(model, seed: int = 0):
    """Fills the parameters that a ControlNet initialises to zero (Diffusers' ``zero_module``: its
    ``controlnet_blocks`` and ``controlnet_x_embedder``) with small random values: with zeros the residuals
    added to the image tokens would be zero and their split would go untested."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _qwen(cls, **extra):
    """A tiny QwenImage pipeline of class ``cls`` from the components of ``tm.tiny_qwenimage_pipeline`` and
    ``extra`` components, with its prompt template replaced by ``"{}"`` (the real templates' dropped
    prefix is counted in tokens of the real tokenizer)."""
    parts = tm.tiny_qwenimage_pipeline().components
    parts.update(extra)
    expected, optional = cls._get_signature_keys(cls)
    pipe = cls(**{k: v for k, v in parts.items() if k in set(expected) | set(optional)})
    pipe.prompt_template_encode = "{}"
    pipe.prompt_template_encode_start_idx = 0
    return pipe


def _controlnet(extra_condition_channels: int = 0):
    """A ``QwenImageControlNetModel`` with the tiny transformer's sizes (5 heads of 16), one block."""
    from diffusers import QwenImageControlNetModel

    torch.manual_seed(1)
    net = QwenImageControlNetModel(patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=16,
                                   num_attention_heads=5, joint_attention_dim=16, axes_dims_rope=(8, 4, 4),
                                   extra_condition_channels=extra_condition_channels).eval()
    return _randomize_zeros(net)


def _img2img():
    from diffusers import QwenImageImg2ImgPipeline

    return _qwen(QwenImageImg2ImgPipeline)


def _inpaint():
    from diffusers import QwenImageInpaintPipeline

    return _qwen(QwenImageInpaintPipeline)


def _controlnet_pipe():
    from diffusers import QwenImageControlNetPipeline

    return _qwen(QwenImageControlNetPipeline, controlnet=_controlnet())


def _controlnet_inpaint():
    from diffusers import QwenImageControlNetInpaintPipeline

    # The control image is the masked image's latents and the mask: one extra channel before packing 2 x 2.
    return _qwen(QwenImageControlNetInpaintPipeline, controlnet=_controlnet(extra_condition_channels=4))


# 40 x 56 pixels are 10 x 14 latents, packed 2 x 2 into 5 x 7 = 35 tokens; QwenImage runs CFG as two
# calls, and a negative prompt turns true CFG on.
_CALL = dict(height=40, width=56, negative_prompt=["rain", "snow at night over the city"], true_cfg_scale=4.0)

PIPELINES = {
    "QwenImagePipeline": Pipe(tm.tiny_qwenimage_pipeline, lambda: dict(_CALL)),
    "QwenImageImg2ImgPipeline": Pipe(_img2img, lambda: dict(_CALL, image=image(56, 40), strength=0.9)),
    "QwenImageInpaintPipeline": Pipe(_inpaint, lambda: dict(
        _CALL, image=image(56, 40), mask_image=mask_image(56, 40), strength=0.9)),
    "QwenImageControlNetPipeline": Pipe(_controlnet_pipe, lambda: dict(_CALL, control_image=image(56, 40, seed=1))),
    "QwenImageControlNetInpaintPipeline": Pipe(_controlnet_inpaint, lambda: dict(
        _CALL, control_image=image(56, 40, seed=1), control_mask=mask_image(56, 40))),
}
