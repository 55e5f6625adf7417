"""HunyuanVideo 1.5: HunyuanVideo15Transformer3DModel (joint attention, text last, its outer-product text mask)."""

import torch

import families
from families import Modular, Pipe, gen, ragged_mask

# Latents of 4 channels; the pipelines join image latents (4) and a mask (1) along the channels.
_LATENT = 4


def _transformer(seed: int = 0):
    """3 heads of 16, two dual-stream blocks, one refiner layer; text widths of the tiny encoders below
    (Qwen2.5-VL 16, T5 32, SigLIP 12)."""
    from diffusers import HunyuanVideo15Transformer3DModel

    torch.manual_seed(seed)
    model = HunyuanVideo15Transformer3DModel(
        in_channels=2 * _LATENT + 1, out_channels=_LATENT, num_attention_heads=3, attention_head_dim=16, num_layers=2,
        num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1, text_embed_dim=16, text_embed_2_dim=32,
        image_embed_dim=12, rope_axes_dim=(4, 6, 6), target_size=24).eval()
    with torch.no_grad():  # norm weights start at ones (QK-norms then equal); trained ones do not
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.normal_(1.0, 0.5)
    return model


def _inputs(image_embeds: bool):
    """35 video tokens (1 x 5 x 7), two samples: Qwen tokens 7 and 3 of 7 valid, ByT5 tokens 0 and 4 of 5,
    image tokens zero (text-to-video: the model masks them all) or random (image-to-video)."""
    g = gen()
    return dict(hidden_states=torch.randn(2, 2 * _LATENT + 1, 1, 5, 7, generator=g), timestep=torch.tensor([500.0, 250.0]),
                encoder_hidden_states=torch.randn(2, 7, 16, generator=g), encoder_attention_mask=ragged_mask([7, 3], 7),
                encoder_hidden_states_2=torch.randn(2, 5, 32, generator=g), encoder_attention_mask_2=ragged_mask([0, 4], 5),
                image_embeds=torch.randn(2, 3, 12, generator=g) if image_embeds else torch.zeros(2, 3, 12))


FORWARDS = {"t2v_ragged_prompts": lambda: (_transformer(), _inputs(False)),
            "i2v_ragged_prompts": lambda: (_transformer(), _inputs(True))}


# ------------------------------------------------------------------ tiny pipelines
# The tiny VAE compresses 4x in space and 2x in time: 20 x 28 pixels, one frame, give 5 x 7 = 35 tokens.
H, W = 20, 28
#: Prompts with a quoted glyph text in the second (encoded by ByT5; the first has none: a zero mask).
PROMPTS = [families.PROMPTS[0], 'a sign "open"']


def _components(seed: int = 0) -> dict:
    from diffusers import AutoencoderKLHunyuanVideo15, FlowMatchEulerDiscreteScheduler
    from diffusers.guiders import ClassifierFreeGuidance
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    from diffusers_sp import tiny_models as tm

    torch.manual_seed(seed)
    qwen = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
        rope_theta=1000000.0, bos_token_id=0, eos_token_id=1)).eval()
    tokenizer = tm.tiny_tokenizer()
    # The pipeline formats each prompt as a chat (system message, user prompt); this template keeps the
    # prompt only, so that nothing needs cropping (the pipeline's crop offset fits the real tokenizer).
    tokenizer.chat_template = "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}"
    torch.manual_seed(seed)
    vae = AutoencoderKLHunyuanVideo15(latent_channels=_LATENT, block_out_channels=(8, 8), layers_per_block=1,
                                      spatial_compression_ratio=4, temporal_compression_ratio=2,
                                      downsample_match_channel=False, upsample_match_channel=False).eval()
    torch.manual_seed(seed)
    byt5 = T5EncoderModel(T5Config(vocab_size=384, d_model=32, d_kv=8, d_ff=32, num_layers=2, num_heads=4,  # ByT5's
                                   relative_attention_num_buckets=8, relative_attention_max_distance=16)).eval()  # bytes
    return dict(transformer=_transformer(seed), vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
                text_encoder=qwen, tokenizer=tokenizer, text_encoder_2=byt5, tokenizer_2=ByT5Tokenizer(),
                guider=ClassifierFreeGuidance(guidance_scale=4.0))


def _short_text(pipe):
    """Text lengths of the tiny encoders: 12 Qwen tokens (no chat-template prefix to crop), 6 ByT5 tokens."""
    pipe.tokenizer_max_length, pipe.prompt_template_encode_start_idx, pipe.tokenizer_2_max_length = 12, 0, 6
    return pipe


def _t2v():
    from diffusers import HunyuanVideo15Pipeline

    pipe = _short_text(HunyuanVideo15Pipeline(**_components()))
    pipe.vision_num_semantic_tokens = 3  # the zero image tokens of text-to-video
    return pipe


def _i2v():
    """A tiny SigLIP (16 x 16 pixels in 8 x 8 patches: 4 image tokens of width 12)."""
    from diffusers import HunyuanVideo15ImageToVideoPipeline
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(1)
    siglip = SiglipVisionModel(SiglipVisionConfig(hidden_size=12, intermediate_size=16, num_hidden_layers=1,
                                                  num_attention_heads=2, image_size=16, patch_size=8)).eval()
    return _short_text(HunyuanVideo15ImageToVideoPipeline(
        **_components(), image_encoder=siglip, feature_extractor=SiglipImageProcessor(size={"height": 16, "width": 16})))


PIPELINES = {
    "HunyuanVideo15Pipeline": Pipe(_t2v, lambda: dict(prompt=PROMPTS, height=H, width=W, num_frames=1)),
    # The output size is the transformer's target-size bucket closest to the image's aspect ratio: for
    # target_size 24 (36 patches of 4 pixels) and a 28 x 20 image, 20 x 28 pixels.
    "HunyuanVideo15ImageToVideoPipeline": Pipe(_i2v, lambda: dict(prompt=PROMPTS, image=families.image(W, H),
                                                                   num_frames=1)),
}


# Modular pipelines (diffusers.modular_pipelines) run with the components and call of a classic case.
MODULAR = {
    "HunyuanVideo15ModularPipeline": Modular("HunyuanVideo15Pipeline"),
}
