"""Motif-Video: MotifVideoTransformer3DModel (dual- and single-stream blocks over [video; text] with a text key
padding mask; decoder blocks over two streams of the video tokens; the image embeddings of image-to-video in
front of the text; text cross-attention in the blocks)."""

import torch

from diffusers_sp import tiny_models as tm
from families import PROMPTS, Pipe, draw_zero_weights, gen, image, ragged_mask, randomize_norms

_TEXT_DIM, _IMAGE_DIM = 16, 16


def _transformer(seed: int = 0, image_embed_dim: int | None = None, latent_channels: int = 4):
    """Three heads of 8 (uneven over 2 ranks), one dual-stream block, three single-stream blocks of which the
    last two are the decoder, text cross-attention in every block that has it; patch 1 x 2 x 2 over
    ``latent_channels`` (the pipelines join the latents, the condition latents and a mask: twice that plus
    one input channels)."""
    from diffusers import MotifVideoTransformer3DModel

    torch.manual_seed(seed)
    model = MotifVideoTransformer3DModel(
        in_channels=2 * latent_channels + 1, out_channels=latent_channels, num_attention_heads=3, attention_head_dim=8,
        num_layers=1, num_single_layers=3, num_decoder_layers=2, text_embed_dim=_TEXT_DIM,
        image_embed_dim=image_embed_dim, rope_axes_dim=(2, 2, 4), enable_text_cross_attention_dual=True,
        enable_text_cross_attention_single=True).eval()
    return draw_zero_weights(randomize_norms(model))


def _forward(image: bool = False):
    """One frame of 10 x 14 latents (4 channels, and the 4 + 1 of the condition), patch 2: 35 video tokens; two
    prompts of 6 and 2 valid tokens (and, for image-to-video, 3 image-embedding tokens in front of them)."""
    g = gen()
    kwargs = dict(hidden_states=torch.randn(2, 9, 1, 10, 14, generator=g),
                  timestep=torch.tensor([500.0, 250.0]), encoder_hidden_states=torch.randn(2, 6, _TEXT_DIM, generator=g),
                  encoder_attention_mask=ragged_mask([6, 2], 6))
    if image:
        kwargs["image_embeds"] = torch.randn(2, 3, _IMAGE_DIM, generator=g)
    return _transformer(image_embed_dim=_IMAGE_DIM if image else None), kwargs


FORWARDS = {"ragged_prompts": _forward, "image_embeds": lambda: _forward(image=True)}


def _text_encoder():
    """A ``T5Gemma2Encoder`` of two text layers of width 16 and a one-layer SigLIP tower (16 x 16 images in 8 x 8
    patches: 4 image tokens of width 16), which the image-to-video pipeline encodes its first frame with."""
    from transformers import T5Gemma2Encoder, T5Gemma2EncoderConfig

    torch.manual_seed(0)
    return T5Gemma2Encoder(T5Gemma2EncoderConfig(
        text_config=dict(vocab_size=64, hidden_size=_TEXT_DIM, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, dropout_rate=0.0),
        vision_config=dict(hidden_size=_IMAGE_DIM, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                           image_size=16, patch_size=8),
        mm_tokens_per_image=4, boi_token_index=60, eoi_token_index=61, image_token_index=62)).eval()


def _pipeline(image: bool = False):
    """A tiny ``MotifVideoPipeline`` (or its image-to-video pipeline): :func:`_text_encoder` over the tiny word
    tokenizer, the tiny Wan VAE, classifier-free guidance as the guider (two calls per step)."""
    from diffusers import ClassifierFreeGuidance, MotifVideoImage2VideoPipeline, MotifVideoPipeline
    from transformers import SiglipImageProcessor

    cls = MotifVideoImage2VideoPipeline if image else MotifVideoPipeline
    return cls(scheduler=tm._flow_scheduler(), vae=tm.tiny_wan_vae(), text_encoder=_text_encoder(),
               tokenizer=tm.tiny_tokenizer(), transformer=_transformer(image_embed_dim=_IMAGE_DIM if image else None, latent_channels=16),
               guider=ClassifierFreeGuidance(guidance_scale=4.0),
               feature_extractor=SiglipImageProcessor(size={"height": 16, "width": 16}))


PIPELINES = {
    # One frame of 80 x 112 pixels: 10 x 14 latents, 35 tokens; prompts padded to 8 tokens with their mask.
    "MotifVideoPipeline": Pipe(_pipeline, lambda: dict(height=80, width=112, num_frames=1, max_sequence_length=8)),
    # 17 frames: 5 latent frames of 35 tokens (175), the first conditioned on the image (VAE latents and its
    # SigLIP tokens in front of the text); one prompt (the pipeline conditions a batch on one image each).
    "MotifVideoImage2VideoPipeline": Pipe(lambda: _pipeline(image=True),
                                          lambda: dict(image=image(112, 80), prompt=PROMPTS[0], height=80, width=112,
                                                       num_frames=17, max_sequence_length=8), tokens=175),
}
