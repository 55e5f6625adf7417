"""QwenImage: QwenImageTransformer2DModel (joint attention, text first, text mask)."""

import torch

from diffusers_sp import tiny_models as tm
from families import FEW_TOKENS, Forward, Modular, Pipe, gen, image, mask_image, ragged_mask


def _forward():
    g = gen()
    return tm.tiny_qwenimage_transformer(), dict(
        hidden_states=torch.randn(2, 35, 16, generator=g), encoder_hidden_states=torch.randn(2, 8, 16, generator=g),
        encoder_hidden_states_mask=ragged_mask([8, 3], 8), timestep=torch.tensor([0.5, 0.25]),
        img_shapes=[[(1, 5, 7)]] * 2)


def _forward_few_tokens():
    """1 x 2 latents: 2 tokens, fewer than 3 ranks, with ragged prompts."""
    g = gen()
    return tm.tiny_qwenimage_transformer(), dict(
        hidden_states=torch.randn(2, 2, 16, generator=g), encoder_hidden_states=torch.randn(2, 8, 16, generator=g),
        encoder_hidden_states_mask=ragged_mask([8, 3], 8), timestep=torch.tensor([0.5, 0.25]),
        img_shapes=[[(1, 1, 2)]] * 2)

FORWARDS = {"ragged_prompts": _forward, "few_tokens": Forward(_forward_few_tokens, tokens=FEW_TOKENS)}


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


def _vae():
    """The ``AutoencoderKLQwenImage`` of ``tm.tiny_qwenimage_pipeline`` (4 x spatial) at base width 8 rather
    than 24: these pipelines encode their input images, and the narrower one encodes ~4 x faster on CPU."""
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(0)
    return AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1,
                                  temperal_downsample=[False, True], latents_mean=[0.0] * 4,
                                  latents_std=[1.0] * 4).eval()


def _qwen(cls, **extra):
    """A tiny QwenImage pipeline of class ``cls`` from the components of ``tm.tiny_qwenimage_pipeline`` and
    ``extra`` components, with its prompt template replaced by ``"{}"`` (the real templates' dropped
    prefix is counted in tokens of the real tokenizer)."""
    parts = tm.tiny_qwenimage_pipeline().components
    parts.update({"vae": _vae(), **extra})
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


def _vl_tokenizer():
    """A word-level tokenizer with Qwen2.5-VL's vision tokens at the ids of ``tm.tiny_qwenimage_pipeline``'s
    text encoder (``<|video_pad|>`` 59, ``<|vision_start|>`` 60, ``<|vision_end|>`` 61, ``<|vision_pad|>`` 62,
    ``<|image_pad|>`` 63): the processor expands ``<|image_pad|>`` to one token per merged image patch, and
    the encoder puts the image features where that id is."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>"]
    vocab = dict(sorted(tm.tiny_tokenizer().get_vocab().items(), key=lambda item: item[1]))  # the same ids
    vocab.update({f"<unused{i}>": i for i in range(len(vocab), 59)})
    vocab.update({t: 59 + i for i, t in enumerate(specials)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    out.add_special_tokens({"additional_special_tokens": specials})  # kept whole by the pre-tokenizer
    return out


def _vl_processor():
    """A ``Qwen2VLProcessor`` (Qwen2.5-VL's patch 14, 2 x 2 merge; PIL image backend) over :func:`_vl_tokenizer`,
    with a small ``min_pixels`` so that a tiny condition image stays a few patches."""
    from transformers import Qwen2VLImageProcessorPil, Qwen2VLProcessor

    class TinyQwen2VLProcessor(Qwen2VLProcessor):
        """Without a video processor: Transformers checks the class of every sub-processor, and the base
        class of video processors needs torchvision, which is not installed; the pipelines pass images only."""

        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return type(None)
            return super().check_argument_for_proper_class(argument_name, argument)

    return TinyQwen2VLProcessor(image_processor=Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=56 * 56),
                                tokenizer=_vl_tokenizer())


def _small_images(module_name: str, area: int = 2048, multiple: int = 32):
    """Makes a QwenImage Edit or Layered pipeline module size its images for ``area`` pixels (e.g. 64 x 32 for
    a 2:1 image at 2048) instead of 1024 x 1024 (Layered: 640 x 640): a tiny model would otherwise encode
    thousands of reference tokens. Replaces the module's ``calculate_dimensions`` (called with those areas in
    ``__call__``) by the same formula as Diffusers' (width sqrt(area x ratio), height width / ratio), rounded
    to ``multiple`` pixels (Diffusers: 32; 8 is what the tiny VAE's 4 x and the 2 x 2 packing need), and sets
    Edit Plus's ``VAE_IMAGE_SIZE`` / ``CONDITION_IMAGE_SIZE`` to ``area``."""
    import importlib
    import math

    mod = importlib.import_module(f"diffusers.pipelines.qwenimage.{module_name}")
    if hasattr(mod, "VAE_IMAGE_SIZE"):
        mod.VAE_IMAGE_SIZE = mod.CONDITION_IMAGE_SIZE = area
    three = len(getattr(mod.calculate_dimensions, "__wrapped__", mod.calculate_dimensions)(1024, 1.0)) == 3

    def calculate_dimensions(target_area, ratio):
        width = math.sqrt(min(target_area, area) * ratio)
        width, height = round(width / multiple) * multiple, round(width / ratio / multiple) * multiple
        return (width, height, None) if three else (width, height)  # Edit returns a third, unused value

    calculate_dimensions.__wrapped__ = getattr(mod.calculate_dimensions, "__wrapped__", mod.calculate_dimensions)
    mod.calculate_dimensions = calculate_dimensions


def _edit_pipe(cls, module_name: str, template: str, **transformer):
    """A tiny pipeline of class ``cls`` (in ``diffusers.pipelines.qwenimage.<module_name>``) that encodes its
    prompts with the image: the tiny Qwen2-VL processor and tokenizer, prompt ``template``, small images,
    and a transformer made with ``transformer`` overrides when given."""
    _small_images(module_name)
    kwargs = {"processor": _vl_processor(), "tokenizer": _vl_tokenizer()}
    if transformer:
        kwargs["transformer"] = tm.tiny_qwenimage_transformer(**transformer)
    pipe = _qwen(cls, **kwargs)
    pipe.prompt_template_encode = template
    return pipe


def _edit():
    from diffusers import QwenImageEditPipeline

    # Its template holds the image's place in the prompt (the real one adds a system prompt, dropped after).
    return _edit_pipe(QwenImageEditPipeline, "pipeline_qwenimage_edit", "<|vision_start|><|image_pad|><|vision_end|>{}")


def _edit_plus():
    from diffusers import QwenImageEditPlusPipeline

    # Edit Plus writes "Picture i: <|vision_start|><|image_pad|><|vision_end|>" per image itself; the
    # transformer of Qwen-Image-Edit-2511 (zero_cond_t: the reference tokens get timestep 0 through the
    # per-token modulate_index, which is split with the tokens).
    return _edit_pipe(QwenImageEditPlusPipeline, "pipeline_qwenimage_edit_plus", "{}", zero_cond_t=True)


def _edit_inpaint():
    from diffusers import QwenImageEditInpaintPipeline

    return _edit_pipe(QwenImageEditInpaintPipeline, "pipeline_qwenimage_edit_inpaint",
                      "<|vision_start|><|image_pad|><|vision_end|>{}")


def _layered():
    from diffusers import AutoencoderKLQwenImage, QwenImageLayeredPipeline

    # Qwen-Image-Layered: RGBA images (a VAE of 4 input channels), layer-aware 3-D RoPE and the extra
    # timestep condition. 8 latent channels: with 4, as many as RGBA, the pipeline takes the image for latents.
    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=8, dim_mult=[1, 2, 4], num_res_blocks=1, input_channels=4,
                                 temperal_downsample=[False, True], latents_mean=[0.0] * 8, latents_std=[1.0] * 8).eval()
    _small_images("pipeline_qwenimage_layered", area=448, multiple=8)  # 56 x 8 for a 7:1 image
    transformer = tm.tiny_qwenimage_transformer(in_channels=32, out_channels=8, use_layer3d_rope=True,
                                                use_additional_t_cond=True)
    return _qwen(QwenImageLayeredPipeline, vae=vae, processor=_vl_processor(), transformer=transformer)


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
    # The 64 x 32 reference image is 8 x 16 latents, 4 x 8 = 32 tokens after the 35 of the image: 67. One
    # image per prompt: Transformers' Qwen2VLProcessor wants as many images as <|image_pad|> in the texts.
    "QwenImageEditPipeline": Pipe(_edit, lambda: dict(_CALL, image=[image(64, 32), image(64, 32, seed=1)]), tokens=67),
    # Edit Inpaint makes its output the size of the reference image, so its sequence is twice one image's
    # tokens, always even: 64 x 32 pixels are 32 + 32 = 64 tokens, uneven over 3 ranks only.
    "QwenImageEditInpaintPipeline": Pipe(_edit_inpaint, lambda: dict(
        negative_prompt=["rain", "snow at night over the city"], true_cfg_scale=4.0, strength=0.9,
        image=[image(64, 32), image(64, 32, seed=1)], mask_image=mask_image(64, 32)), tokens=64),
    # Layered makes ``layers`` + 1 images the size of the input one and appends the input: a 56 x 8 image is
    # 1 x 7 tokens, (3 + 2) x 7 = 35 with 3 layers. Decoded, and one prompt: in Diffusers 0.42 its
    # output_type="latent" returns nothing (``images`` is bound only when decoding) and a batch of 2 is
    # regrouped into arrays of different shapes.
    "QwenImageLayeredPipeline": Pipe(_layered, lambda: dict(
        prompt="a cat runs on the grass under the blue sky", negative_prompt="rain", true_cfg_scale=4.0, layers=3,
        image=image(56, 8).convert("RGBA"), output_type="np"), tokens=35),
    # One prompt (Edit Plus takes a batch of 1) and two reference images, 64 x 32 (32 tokens) and 32 x 32
    # (16 tokens): 35 + 48 = 83 tokens.
    "QwenImageEditPlusPipeline": Pipe(_edit_plus, lambda: dict(
        _CALL, prompt="a cat runs on the grass", negative_prompt="rain",
        image=[image(64, 32), image(32, 32, seed=1)]), tokens=83),
}


# Modular pipelines (diffusers.modular_pipelines) run with the components and call of a classic case.
MODULAR = {
    "QwenImageModularPipeline": Modular("QwenImagePipeline"),
}
