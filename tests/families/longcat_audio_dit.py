"""LongCat-Audio-DiT: LongCatAudioDiTTransformer (1-D audio latents with a key padding mask; the text refined by
ConvNeXt-V2 blocks; a long skip over the blocks)."""

import torch

from diffusers_sp import tiny_models as tm
from families import Pipe, draw_zero_weights, gen, ragged_mask, randomize_norms


def _transformer(seed: int = 0):
    """Three heads of 8 (uneven over 2 ranks), two blocks, 4 latent channels, text of width 32 (the tiny UMT5);
    the released flags (global AdaLN with the text mean, long skip, text ConvNeXt, latent condition). Its
    zero-initialised modulation and output layers drawn."""
    from diffusers import LongCatAudioDiTTransformer

    torch.manual_seed(seed)
    model = LongCatAudioDiTTransformer(dit_dim=24, dit_depth=2, dit_heads=3, dit_text_dim=32, latent_dim=4,
                                       ff_mult=2.0).eval()
    return draw_zero_weights(randomize_norms(model))


def _forward():
    """35 audio latents, the second sample's last 5 padding (masked); texts of 6 and 2 valid tokens."""
    g = gen()
    return _transformer(), dict(hidden_states=torch.randn(2, 35, 4, generator=g),
                                encoder_hidden_states=torch.randn(2, 6, 32, generator=g),
                                encoder_attention_mask=ragged_mask([6, 2], 6).bool(), timestep=torch.tensor([0.5, 0.25]),
                                attention_mask=ragged_mask([35, 30], 35).bool(),
                                latent_cond=torch.randn(2, 35, 4, generator=g))


FORWARDS = {"padded_audio": _forward}


def _pipeline():
    """A tiny ``LongCatAudioDiTPipeline``: the tiny UMT5 over the tiny word tokenizer, a tiny LongCat audio VAE
    (700 Hz, 20 samples per latent: 35 latents a second; not run: latents out)."""
    from diffusers import LongCatAudioDiTPipeline, LongCatAudioDiTVae

    torch.manual_seed(0)
    vae = LongCatAudioDiTVae(channels=4, c_mults=[1, 2], strides=[20], latent_dim=4, encoder_latent_dim=8,
                             downsampling_ratio=20, sample_rate=700).eval()
    return LongCatAudioDiTPipeline(vae=vae, text_encoder=tm.tiny_umt5_encoder(), tokenizer=tm.tiny_tokenizer(),
                                   transformer=_transformer())


PIPELINES = {
    # One second: 35 latents; two prompts of different lengths, CFG as two calls with negative prompts.
    "LongCatAudioDiTPipeline": Pipe(_pipeline, lambda: dict(audio_duration_s=1.0, guidance_scale=4.0,
                                                            negative_prompt=["noise", "static hiss and hum"])),
}
