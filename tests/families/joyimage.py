"""JoyImage Edit and Edit Plus: double-stream blocks over [image; text] (text last); Edit Plus with per-sample
patches padded to the batch's longest, per-sample RoPE and a mask over the padding and the text."""

import torch

from diffusers_sp import tiny_models as tm
from families import Forward, Pipe, draw_zero_weights, gen, qwen3_vl_config, ragged_mask, randomize_norms

_TEXT_DIM = 16


def _transformer(plus: bool = False, rope_type: str = "rope", seed: int = 0):
    """Three heads of 8 (uneven over 2 ranks; RoPE axes 2 + 2 + 4), two double-stream blocks, 4 latent channels,
    patch 1 x 2 x 2; its zero-initialised modulations drawn."""
    from diffusers import JoyImageEditPlusTransformer3DModel, JoyImageEditTransformer3DModel

    torch.manual_seed(seed)
    cls = JoyImageEditPlusTransformer3DModel if plus else JoyImageEditTransformer3DModel
    model = cls(patch_size=[1, 2, 2], in_channels=4, hidden_size=24, num_attention_heads=3, text_dim=_TEXT_DIM,
                mlp_width_ratio=2.0, num_layers=2, rope_dim_list=[2, 2, 4], rope_type=rope_type).eval()
    return draw_zero_weights(randomize_norms(model))


def _edit(items: int, rope_type: str = "rope"):
    """``items`` latents of 10 x 14 (patch 2: 35 tokens each; a reference image and the target as two items),
    6 text tokens."""
    def build():
        g = gen()
        shape = (2, items, 4, 1, 10, 14) if items > 1 else (2, 4, 1, 10, 14)
        return _transformer(rope_type=rope_type), dict(
            hidden_states=torch.randn(*shape, generator=g), timestep=torch.tensor([900.0, 300.0]),
            encoder_hidden_states=torch.randn(2, 6, _TEXT_DIM, generator=g))
    return build


def _edit_plus():
    """Patches of two samples: the target (5 x 7) and a 2 x 3 reference (41 patches), and the target alone padded
    to 41; prompts of 6 and 2 valid tokens."""
    g = gen()
    return _transformer(plus=True), dict(
        hidden_states=torch.randn(2, 41, 4, 1, 2, 2, generator=g), timestep=torch.tensor([900.0, 300.0]),
        encoder_hidden_states=torch.randn(2, 6, _TEXT_DIM, generator=g),
        encoder_hidden_states_mask=ragged_mask([6, 2], 6), shape_list=[[(1, 5, 7), (1, 2, 3)], [(1, 5, 7)]])


FORWARDS = {
    "edit_text_to_image": _edit(1),
    "edit_reference_mrope": Forward(_edit(2, rope_type="mrope"), tokens=70),
    "edit_plus_padded_references": Forward(_edit_plus, tokens=41),
}


def _text_encoder():
    """A two-layer ``Qwen3VLForConditionalGeneration`` of width 16 (a one-block vision tower, not called: the
    prompts carry no image)."""
    from transformers import Qwen3VLForConditionalGeneration

    torch.manual_seed(0)
    return Qwen3VLForConditionalGeneration(qwen3_vl_config(_TEXT_DIM)).eval()


def _pipeline(plus: bool = False):
    """A tiny ``JoyImageEditPipeline`` (or Edit Plus) for text-to-image (no reference image):
    :func:`_text_encoder` over the tiny word tokenizer, the tiny Wan VAE (not run: latents out); the chat template
    replaced by the bare prompt (the real one's token counts assume the real tokenizer). Edit Plus passes even
    image-free prompts through its Qwen3-VL processor, which without images only tokenizes the text; the
    tokenizer stands in for it (transformers' Qwen3-VL processor needs torchvision for its video part)."""
    from diffusers import JoyImageEditPipeline, JoyImageEditPlusPipeline

    cls = JoyImageEditPlusPipeline if plus else JoyImageEditPipeline
    tokenizer = tm.tiny_tokenizer()
    pipe = cls(scheduler=tm._flow_scheduler(), vae=tm.tiny_wan_vae(), text_encoder=_text_encoder(), tokenizer=tokenizer,
               transformer=_transformer(plus=plus), processor=tokenizer)
    pipe.prompt_template_encode = {key: "{}" for key in pipe.prompt_template_encode}
    pipe.prompt_template_encode_start_idx = {key: 0 for key in pipe.prompt_template_encode_start_idx}
    if not plus:
        # The Edit pipeline rounds every size to one of its buckets of about a megapixel (3744 tokens here); the
        # test keeps the size it asks for.
        pipe.vae_image_processor.get_default_height_width = lambda image, height, width: (height, width)
    return pipe


PIPELINES = {
    # 80 x 112 pixels: 10 x 14 latents, 35 tokens; prompts of different lengths, CFG with the empty negative prompt.
    "JoyImageEditPipeline": Pipe(_pipeline, lambda: dict(height=80, width=112, guidance_scale=4.0)),
    "JoyImageEditPlusPipeline": Pipe(lambda: _pipeline(plus=True), lambda: dict(height=80, width=112, guidance_scale=4.0)),
}
