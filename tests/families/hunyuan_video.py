"""HunyuanVideo: HunyuanVideoTransformer3DModel (joint attention, text last, text mask)."""

import torch

from diffusers_sp import tiny_models as tm
from families import FEW_TOKENS, PROMPTS, Forward, Pipe, gen, image, ragged_mask


def _inputs(g, frames: int = 1, height: int = 5, width: int = 7):
    return dict(hidden_states=torch.randn(2, 4, frames, height, width, generator=g),
                encoder_hidden_states=torch.randn(2, 7, 16, generator=g), encoder_attention_mask=ragged_mask([7, 4], 7),
                pooled_projections=torch.randn(2, 8, generator=g), timestep=torch.tensor([500, 250]),
                guidance=torch.tensor([6000.0, 6000.0]))


def _forward():
    return tm.tiny_hunyuan_video_transformer(), _inputs(gen())


def _forward_token_replace():
    """image_condition_type="token_replace": 5 frames of 1 x 7, so the first frame's 7 tokens end inside
    rank 0's shard (18 or 12 tokens at 2 or 3 ranks) and the other ranks hold none."""
    return (tm.tiny_hunyuan_video_transformer(image_condition_type="token_replace"),
            _inputs(gen(), frames=5, height=1, width=7))


def _forward_token_replace_one_frame():
    """image_condition_type="token_replace" with one frame: every token is a first-frame token, on every rank."""
    return tm.tiny_hunyuan_video_transformer(image_condition_type="token_replace"), _inputs(gen())


def _forward_few_tokens():
    """One frame of 1 x 2 latents: 2 tokens, fewer than 3 ranks, with ragged prompts (a rank of no tokens
    would reach Diffusers' apply_rotary_emb, whose reshape with -1 raises on an empty tensor)."""
    return tm.tiny_hunyuan_video_transformer(), _inputs(gen(), height=1, width=2)

FORWARDS = {"ragged_prompts": _forward, "few_tokens": Forward(_forward_few_tokens, tokens=FEW_TOKENS), "token_replace": _forward_token_replace,
            "token_replace_one_frame": _forward_token_replace_one_frame}

#: Image tokens the tiny Llava's vision tower gives (32 x 32 pixels in 8 x 8 patches, CLS dropped).
_IMAGE_TOKENS = 16
#: The layout of Diffusers' HunyuanVideo I2V prompt template (system part with the image, user part with
#: the prompt, assistant header), short: the pipeline crops the prompt out of the Llava states by the
#: positions of these tokens, the image's at 3 and the prompt's from 9 on (before the image's expansion).
_I2V_TEMPLATE = {
    "template": "<|start_header_id|>system<|end_header_id|> <image> describe<|eot_id|>"
                "<|start_header_id|>user<|end_header_id|> {}<|eot_id|><|start_header_id|>assistant<|end_header_id|>",
    "crop_start": 9, "image_emb_start": 3, "image_emb_end": 3 + _IMAGE_TOKENS, "image_emb_len": _IMAGE_TOKENS}


def _i2v_pipeline():
    """A tiny ``HunyuanVideoImageToVideoPipeline`` (``image_condition_type="token_replace"``): a Llava
    text encoder whose tokenizer has the template's special tokens, and the tiny pipeline's VAE and CLIP."""
    from diffusers import HunyuanVideoImageToVideoPipeline
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration)

    parts = tm.tiny_hunyuan_video_pipeline().components
    tokenizer = tm.tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [
        "<image>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    torch.manual_seed(0)
    llava = LlavaForConditionalGeneration(LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                                       image_size=32, patch_size=8, projection_dim=8),
        text_config=LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"), image_seq_length=_IMAGE_TOKENS,
        pad_token_id=tokenizer.pad_token_id)).eval()  # the pipeline reads config.pad_token_id
    return HunyuanVideoImageToVideoPipeline(
        text_encoder=llava, tokenizer=tokenizer, image_processor=CLIPImageProcessor(crop_size=32, size=32),
        transformer=tm.tiny_hunyuan_video_transformer(image_condition_type="token_replace"), vae=parts["vae"],
        scheduler=parts["scheduler"], text_encoder_2=parts["text_encoder_2"], tokenizer_2=parts["tokenizer_2"])


def _i2v_call():
    """One prompt (the pipeline encodes one image, for a batch of 1) with true CFG: a second transformer
    call per step with the negative prompt's text (its own padding). 17 frames are 5 latent frames of
    5 x 7, the first one the image's: 175 tokens, 35 of them first-frame tokens."""
    return dict(image=image(112, 80), prompt=PROMPTS[0], negative_prompt=PROMPTS[1], true_cfg_scale=2.0,
                height=80, width=112, num_frames=17, max_sequence_length=16, prompt_template=_I2V_TEMPLATE)


def _skyreels_pipeline():
    """A tiny ``HunyuanSkyreelsImageToVideoPipeline``: the tiny HunyuanVideo components, with a transformer
    taking the image latents joined along channels (in_channels 2 x 4)."""
    from diffusers import HunyuanSkyreelsImageToVideoPipeline

    parts = tm.tiny_hunyuan_video_pipeline().components
    parts["transformer"] = tm.tiny_hunyuan_video_transformer(in_channels=8, out_channels=4)
    return HunyuanSkyreelsImageToVideoPipeline(**parts)


PIPELINES = {
    "HunyuanVideoPipeline": Pipe(tm.tiny_hunyuan_video_pipeline, lambda: dict(
        height=80, width=112, num_frames=1, max_sequence_length=8, guidance_scale=6.0,
        prompt_template={"template": "{}", "crop_start": 0})),
    "HunyuanVideoImageToVideoPipeline": Pipe(_i2v_pipeline, _i2v_call, tokens=175),
    # One image per prompt (the pipeline pads each image's latents for its own sample); 17 frames are 5
    # latent frames of 5 x 7, 175 tokens; true CFG with negative prompts.
    "HunyuanSkyreelsImageToVideoPipeline": Pipe(_skyreels_pipeline, lambda: dict(
        image=[image(112, 80, seed=1), image(112, 80, seed=2)], negative_prompt=["", "a bird"], true_cfg_scale=2.0, height=80, width=112,
        num_frames=17, max_sequence_length=8, prompt_template={"template": "{}", "crop_start": 0}),
        tokens=175),
}
