"""HunyuanImage 2.1: HunyuanImageTransformer2DModel (joint attention, text last, text mask; dispatch
mode), the text-to-image model and the refiner's (3-D patches of one-frame latents)."""

import torch

import families
from families import Pipe, gen, ragged_mask


def _transformer(seed: int = 0, refiner: bool = False):
    """3 heads of 8 (uneven over 2 ranks), one block of each kind and one token refiner block. The
    text-to-image model reads a second (glyph, ByT5) text; the refiner's takes 3-D patches of its
    latents joined to the image condition's (8 = 2 x 4 channels) and a distilled guidance."""
    from diffusers import HunyuanImageTransformer2DModel

    torch.manual_seed(seed)
    cfg = dict(in_channels=4, out_channels=4, num_attention_heads=3, attention_head_dim=8, num_layers=1,
               num_single_layers=1, num_refiner_layers=1, text_embed_dim=16)
    if refiner:
        cfg.update(in_channels=8, patch_size=(1, 1, 1), rope_axes_dim=(2, 2, 4), guidance_embeds=True)
    else:
        cfg.update(patch_size=(1, 1), rope_axes_dim=(4, 4), text_embed_2_dim=16)
    return HunyuanImageTransformer2DModel(**cfg).eval()


def _forward():
    """5 x 7 latents, patch 1: 35 image tokens; prompts of 8 and 3 valid tokens, glyph texts of 4 and 0."""
    g = gen()
    return _transformer(), dict(
        hidden_states=torch.randn(2, 4, 5, 7, generator=g), timestep=torch.tensor([500.0, 250.0]),
        encoder_hidden_states=torch.randn(2, 8, 16, generator=g), encoder_attention_mask=ragged_mask([8, 3], 8),
        encoder_hidden_states_2=torch.randn(2, 6, 16, generator=g), encoder_attention_mask_2=ragged_mask([4, 0], 6))


def _forward_refiner():
    """One-frame latents ``[B, 8, 1, 5, 7]``, 3-D patches of 1: 35 tokens; ragged prompts."""
    g = gen()
    return _transformer(refiner=True), dict(
        hidden_states=torch.randn(2, 8, 1, 5, 7, generator=g), timestep=torch.tensor([500.0, 250.0]),
        encoder_hidden_states=torch.randn(2, 8, 16, generator=g), encoder_attention_mask=ragged_mask([8, 3], 8),
        guidance=torch.tensor([3500.0, 3500.0]))


FORWARDS = {"ragged_prompts": _forward, "refiner_ragged_prompts": _forward_refiner}


def _qwen_encoder(seed: int):
    """A 2-layer Qwen2.5-VL (the MLLM text encoder) of hidden size 16."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    cfg = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=64,
                         rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
                         rope_theta=1000000.0),
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16),
        hidden_size=16, vocab_size=64, vision_start_token_id=60, vision_end_token_id=61, vision_token_id=62,
        image_token_id=63, video_token_id=59)
    return Qwen2_5_VLForConditionalGeneration(cfg).eval()


def _short_prompts(pipe):
    """The chat template becomes ``"{}"`` (its dropped tokens assume the real tokenizer) and the
    prompts are padded to 12 MLLM (and 16 glyph) tokens instead of 1000 (and 128)."""
    pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx = "{}", 0
    pipe.tokenizer_max_length = 12
    if hasattr(pipe, "tokenizer_2_max_length"):
        pipe.tokenizer_2_max_length = 16
    return pipe


def _pipeline(seed: int = 0):
    """HunyuanImagePipeline with a guider (two calls per step) and the glyph encoder (ByT5 + T5);
    the VAE (8x, not run: latents out) only fills the component."""
    from diffusers import AdaptiveProjectedMixGuidance, AutoencoderKLHunyuanImage, HunyuanImagePipeline
    from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

    from diffusers_sp import tiny_models as tm

    torch.manual_seed(seed)
    vae = AutoencoderKLHunyuanImage(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32,) * 4,
                                    layers_per_block=1, spatial_compression_ratio=8, sample_size=64,
                                    scaling_factor=0.476986).eval()
    torch.manual_seed(seed)
    t5 = T5EncoderModel(T5Config(vocab_size=384, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                                 relative_attention_num_buckets=8, relative_attention_max_distance=16)).eval()
    pipe = HunyuanImagePipeline(scheduler=tm._flow_scheduler(shift=5.0), vae=vae, text_encoder=_qwen_encoder(seed),
                                tokenizer=tm.tiny_tokenizer(), text_encoder_2=t5, tokenizer_2=ByT5Tokenizer(),
                                transformer=_transformer(seed), guider=AdaptiveProjectedMixGuidance(guidance_scale=3.5))
    return _short_prompts(pipe)


def _refiner_pipeline(seed: int = 0):
    """HunyuanImageRefinerPipeline (distilled guidance, one call per step) with a tiny 3-D refiner VAE
    (8x spatial, 2 latent channels: the reordered image latents have 4, as the latents)."""
    from diffusers import AutoencoderKLHunyuanImageRefiner, HunyuanImageRefinerPipeline

    from diffusers_sp import tiny_models as tm

    torch.manual_seed(seed)
    vae = AutoencoderKLHunyuanImageRefiner(in_channels=3, out_channels=3, latent_channels=2,
                                           block_out_channels=(32,) * 4, layers_per_block=1,
                                           spatial_compression_ratio=8, temporal_compression_ratio=4).eval()
    pipe = HunyuanImageRefinerPipeline(scheduler=tm._flow_scheduler(shift=4.0), vae=vae,
                                       text_encoder=_qwen_encoder(seed), tokenizer=tm.tiny_tokenizer(),
                                       transformer=_transformer(seed, refiner=True))
    return _short_prompts(pipe)


# 40 x 56 pixels, 8x VAEs: 5 x 7 latents, 35 tokens (the pipelines warn that the sizes are not
# multiples of 16: with patches of 1, sizes that are would give an even number of tokens).
PIPELINES = {
    # One prompt with a quoted glyph text, one without: ragged MLLM and glyph masks.
    "HunyuanImagePipeline": Pipe(_pipeline, lambda: dict(
        height=40, width=56, prompt=['a cat runs on the grass under a sign "hi"', "a dog"])),
    "HunyuanImageRefinerPipeline": Pipe(_refiner_pipeline, lambda: dict(
        height=40, width=56, image=families.image(56, 40, seed=1), distilled_guidance_scale=3.25)),
}
