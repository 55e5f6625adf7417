"""Stable Audio 3: StableAudio3DiTModel (1-D audio tokens after memory tokens, RoPE built in the forward,
differential attention; text and duration context in cross-attention; an inpainting condition)."""

import torch

from families import Forward, Pipe, gen, ragged_mask


def _transformer(seed: int = 0, **overrides):
    """A ``StableAudio3DiTModel``: 3 heads of 16 (uneven over 2 ranks), two blocks, 4 latent channels, 3 memory
    tokens, context width 32."""
    from diffusers import StableAudio3DiTModel

    torch.manual_seed(seed)
    cfg = dict(io_channels=4, embed_dim=48, depth=2, num_heads=3, cond_token_dim=32, global_cond_dim=32,
               local_add_cond_dim=5, timestep_features_dim=16, ff_mult=2.0, num_memory_tokens=3)
    cfg.update(overrides)
    return StableAudio3DiTModel(**cfg).eval()


def _inputs(g, length: int = 35, **extra):
    return dict(hidden_states=torch.randn(2, 4, length, generator=g), timestep=torch.tensor([0.5, 0.25]),
                encoder_hidden_states=torch.randn(2, 7, 32, generator=g), global_hidden_states=torch.randn(2, 32, generator=g),
                encoder_attention_mask=ragged_mask([7, 4], 7).bool(), **extra)


def _forward_inpaint():
    """35 audio latents with the inpainting condition (5 channels per position)."""
    g = gen()
    return _transformer(), _inputs(g, local_add_cond=torch.randn(2, 5, 35, generator=g))


def _forward_patched():
    """70 latents at patch 2: 35 tokens."""
    return _transformer(patch_size=2), _inputs(gen(), length=70)


FORWARDS = {"ragged_prompts": lambda: (_transformer(), _inputs(gen())), "inpaint": _forward_inpaint,
            "patched": Forward(_forward_patched, tokens=35)}


def _build(cls_name: str):
    """``() -> pipeline``: the tiny T5 (its first output is the context), a one-block ``AutoencoderSAME`` (patch 2,
    stride 2: 4 samples a latent, 28 samples a second, so 5 s are 35 latents), a duration embedder of width 32."""
    def build():
        import diffusers
        from diffusers import AutoencoderSAME
        from diffusers.pipelines.stable_audio_3.modeling_stable_audio_3 import StableAudio3DurationEmbedder

        from diffusers_sp import tiny_models as tm

        torch.manual_seed(0)
        vae = AutoencoderSAME(audio_channels=2, patch_size=2, encoder_channels=8, encoder_c_mults=(1,),
                              encoder_strides=(2,), encoder_transformer_depths=(1,), latent_dim=4, dim_heads=8,
                              sampling_rate=28).eval()
        durations = StableAudio3DurationEmbedder(output_dim=32, fourier_dim=16, max_val=10.0).eval()
        return getattr(diffusers, cls_name)(transformer=_transformer(), vae=vae, text_encoder=tm.tiny_t5_encoder(),
                                            tokenizer=tm.tiny_tokenizer(), duration_embedder=durations,
                                            scheduler=tm._flow_scheduler())
    return build


def _audio(seconds: float = 5.0, seed: int = 0):
    """A ``[1, 2, 28 * seconds]`` stereo waveform at the tiny VAE's 28 samples a second."""
    return torch.rand(1, 2, int(28 * seconds), generator=gen(seed)) * 2 - 1


_CALL = dict(duration=5.0, guidance_scale=4.0, negative_prompt=["rain", "snow at night over the city"])

PIPELINES = {
    "StableAudio3Pipeline": Pipe(_build("StableAudio3Pipeline"), lambda: dict(_CALL)),
    # One prompt for the one reference waveform.
    "StableAudio3AudioToAudioPipeline": Pipe(_build("StableAudio3AudioToAudioPipeline"), lambda: dict(
        prompt="a dog", duration=5.0, audio=_audio(), init_noise_level=0.7)),
    # Seconds 1-3 repainted: the inpainting condition (mask and masked latents) split with the audio tokens.
    "StableAudio3InpaintPipeline": Pipe(_build("StableAudio3InpaintPipeline"), lambda: dict(
        prompt="a dog", duration=5.0, audio=_audio(), mask_start_seconds=1.0, mask_end_seconds=3.0)),
}
