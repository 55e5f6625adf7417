"""Stable Audio Open: StableAudioDiTModel (1-D audio latents after one global token; RoPE from the pipeline;
T5 text in cross-attention; grouped K/V heads)."""

import torch

from diffusers_sp import tiny_models as tm
from families import Pipe, gen


def _transformer(seed: int = 0):
    """A ``StableAudioDiTModel``: 4 query heads of 8 over 2 K/V heads, two blocks, 4 latent channels, 35
    latent positions (the pipeline's latent length is ``sample_size``), text width 32 (the tiny T5's), global
    width 64 (the pipeline joins the start and end conditions)."""
    from diffusers import StableAudioDiTModel

    torch.manual_seed(seed)
    return StableAudioDiTModel(sample_size=35, in_channels=4, num_layers=2, attention_head_dim=8,
                               num_attention_heads=4, num_key_value_attention_heads=2, out_channels=4,
                               cross_attention_dim=32, time_proj_dim=16, global_states_input_dim=64,
                               cross_attention_input_dim=32).eval()


def _forward():
    """35 audio latents after the global token; RoPE over the 36 positions, on half of each head (as the
    pipeline makes it); two prompts of 7 text tokens."""
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    g = gen()
    rope = get_1d_rotary_pos_embed(4, 36, use_real=True, repeat_interleave_real=False)
    return _transformer(), dict(hidden_states=torch.randn(2, 4, 35, generator=g), timestep=torch.tensor([0.5, 0.25]),
                                encoder_hidden_states=torch.randn(2, 7, 32, generator=g),
                                global_hidden_states=torch.randn(2, 1, 64, generator=g), rotary_embedding=rope)


FORWARDS = {"": _forward}


def _pipeline():
    """A tiny ``StableAudioPipeline``: the tiny T5, a two-block ``AutoencoderOobleck`` (hop 2, 4 latent
    channels, 14 samples a second: the 35 latents are 5 s), timing conditions over 0-5 s."""
    from diffusers import AutoencoderOobleck, EDMDPMSolverMultistepScheduler, StableAudioPipeline
    from diffusers.pipelines.stable_audio import StableAudioProjectionModel

    torch.manual_seed(0)
    vae = AutoencoderOobleck(encoder_hidden_size=4, downsampling_ratios=[1, 2], channel_multiples=[1, 2],
                             decoder_channels=4, decoder_input_channels=4, audio_channels=2, sampling_rate=14).eval()
    projection = StableAudioProjectionModel(text_encoder_dim=32, conditioning_dim=32, min_value=0, max_value=5).eval()
    return StableAudioPipeline(transformer=_transformer(), vae=vae, text_encoder=tm.tiny_t5_encoder(),
                               projection_model=projection, tokenizer=tm.tiny_tokenizer(),
                               scheduler=EDMDPMSolverMultistepScheduler())


PIPELINES = {
    # 35 latent positions; CFG folded into the batch, with negative prompts.
    "StableAudioPipeline": Pipe(_pipeline, lambda: dict(audio_end_in_s=5.0, guidance_scale=4.0,
                                                        negative_prompt=["rain", "snow at night over the city"])),
}
