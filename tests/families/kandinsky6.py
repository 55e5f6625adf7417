"""Kandinsky 6: Kandinsky6Transformer3DModel (video and audio denoised together: video self-attention split,
audio whole; video-to-audio attention local, audio-to-video attention over the split video)."""

import torch

from families import PROMPTS, Pipe, draw_zero_weights, gen, image, ragged_mask, randomize_norms


def _transformer(seed: int = 0):
    """Video heads: three of 8 (RoPE axes 2 + 2 + 4; uneven over 2 ranks); audio: two heads of 8; one text block
    per branch, two fused blocks; the released variant's flags (padded text, RoPE in the cross-modal attention,
    cross gates, fixed modulation); image conditioning (latent, condition, mask channels). Its zero-initialised
    modulations and output layers drawn."""
    from diffusers import Kandinsky6Transformer3DModel

    torch.manual_seed(seed)
    model = Kandinsky6Transformer3DModel(
        in_visual_dim=4, out_visual_dim=4, in_text_dim=16, in_text_dim2=8, time_dim=16, patch_size=(1, 2, 2),
        model_dim=24, ff_dim=32, num_text_blocks=1, num_visual_blocks=2, axes_dims=(2, 2, 4), visual_cond=True,
        in_audio_dim=4, out_audio_dim=4, model_dim_a=16, time_dim_a=16, ff_dim_a=32, axes_dims_a=(8,),
        text_token_padding=True, ca_rope=True, cross_gates=True, fix_modulation=True,
        visual_token_type_num_embeddings=2).eval()
    return draw_zero_weights(randomize_norms(model))


def _forward(audio: bool = True):
    """One latent frame of 10 x 14 (patch 2: 35 video tokens) and 7 audio latents; two prompts of 6 and 2 valid
    tokens."""
    g = gen()
    kwargs = dict(hidden_states=torch.randn(2, 1, 10, 14, 9, generator=g),
                  encoder_hidden_states=torch.randn(2, 6, 16, generator=g), pooled_projections=torch.randn(2, 8, generator=g),
                  timestep=torch.tensor([900.0, 300.0]), encoder_attention_mask=ragged_mask([6, 2], 6).bool())
    if audio:
        kwargs["audio_hidden_states"] = torch.randn(2, 7, 4, generator=g)
    return _transformer(), kwargs


FORWARDS = {"video_and_audio": _forward, "video_only": lambda: _forward(audio=False)}


def _pipeline():
    """A tiny ``Kandinsky6TI2VAPipeline``: Kandinsky 5's tiny text encoders, the tiny HunyuanVideo VAE, and a
    tiny MMAudio VAE (1200 Hz, 8 samples per latent: 7 audio latents per latent frame) and vocoder, which the
    pipeline requires for audio (not run: latents out)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Kandinsky6TI2VAPipeline, MMAudioVAE, MMAudioVocoder

    from diffusers_sp import tiny_models as tm
    from families.kandinsky5 import _text_parts

    torch.manual_seed(0)
    audio_vae = MMAudioVAE(mel_bins=8, latent_channels=4, hidden_channels=8, channel_multipliers=(1,),
                           layers_per_block=1, sample_rate=1200, n_fft=16, hop_length=4)
    vocoder = MMAudioVocoder(num_mels=8, upsample_initial_channel=8, upsample_rates=(2,), upsample_kernel_sizes=(4,),
                             resblock_kernel_sizes=(3,), resblock_dilation_sizes=((1,),))
    pipe = Kandinsky6TI2VAPipeline(transformer=_transformer(), vae=tm.tiny_hunyuan_video_pipeline().vae,
                                   scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), audio_vae=audio_vae,
                                   vocoder=vocoder, **_text_parts())
    pipe.prompt_template, pipe.prompt_template_encode_start_idx = "{}", 0  # the real template fits Qwen's tokenizer
    return pipe


PIPELINES = {
    # One frame of 160 x 224 pixels (the tiny VAE's 16x: 10 x 14 latents, 35 tokens) with its audio; the reference
    # image appended as one more latent frame (70 tokens); CFG as two calls; one prompt (the pipeline conditions
    # a batch on one image each).
    "Kandinsky6TI2VAPipeline": Pipe(_pipeline, lambda: dict(image=image(224, 160), prompt=PROMPTS[0], height=160,
                                                            width=224, num_frames=1, max_sequence_length=12,
                                                            guidance_scale=3.0, negative_prompt="blurry video"),
                                    tokens=70),
}
