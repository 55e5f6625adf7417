"""ACE-Step: AceStepTransformer1DModel (1-D audio latents; alternating sliding-window and full self-attention with
grouped-query K/V; cross-attention to the encoded condition)."""

import torch

from families import Pipe, draw_zero_weights, gen, randomize_norms


def _transformer(seed: int = 0, sliding_window: int = 5):
    """Four query heads of 8 over two K/V heads (grouped; even, so Ulysses splits both alike at 2 ranks), two
    layers (sliding-window, then full: a window of ``sliding_window`` tokens, narrower than a rank's shard),
    patch 2 over 4 + 8 channels (latents; context: source latents and chunk mask)."""
    from diffusers import AceStepTransformer1DModel

    torch.manual_seed(seed)
    model = AceStepTransformer1DModel(hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=8, in_channels=12, audio_acoustic_hidden_dim=4,
                                      patch_size=2, sliding_window=sliding_window).eval()
    return draw_zero_weights(randomize_norms(model))


def _forward():
    """69 latent frames (odd: the model pads them to 70, 35 tokens after the patch of 2), 4 channels plus 8 of
    context; a condition of 6 tokens."""
    g = gen()
    return _transformer(), dict(hidden_states=torch.randn(2, 69, 4, generator=g), timestep=torch.tensor([0.5, 0.25]),
                                timestep_r=torch.tensor([0.5, 0.25]), encoder_hidden_states=torch.randn(2, 6, 32, generator=g),
                                context_latents=torch.randn(2, 69, 8, generator=g))


FORWARDS = {"sliding_window": _forward}


def _pipeline():
    """A tiny ``AceStepPipeline``: a two-layer Qwen3 text encoder (width 16) over the tiny word tokenizer, a tiny
    condition encoder (one lyric and one timbre layer), a two-block ``AutoencoderOobleck`` (hop 2 at 14 Hz: 7
    latents a second, not run: latents out)."""
    from diffusers import AceStepPipeline, AutoencoderOobleck
    from diffusers.pipelines.ace_step.modeling_ace_step import AceStepConditionEncoder
    from transformers import Qwen3Config, Qwen3Model

    from diffusers_sp import tiny_models as tm

    torch.manual_seed(0)
    text_encoder = Qwen3Model(Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=1, head_dim=8)).eval()
    condition = AceStepConditionEncoder(hidden_size=32, intermediate_size=32, text_hidden_dim=16, timbre_hidden_dim=4,
                                        num_lyric_encoder_hidden_layers=1, num_timbre_encoder_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=5).eval()
    vae = AutoencoderOobleck(encoder_hidden_size=4, downsampling_ratios=[1, 2], channel_multiples=[1, 2],
                             decoder_channels=4, decoder_input_channels=4, audio_channels=2, sampling_rate=14).eval()
    return AceStepPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tm.tiny_tokenizer(), transformer=_transformer(),
                           condition_encoder=condition, scheduler=tm._flow_scheduler())


PIPELINES = {
    # 10 s: 70 latents, 35 tokens; CFG (guidance with the learned null condition) folded into the batch; lyrics.
    "AceStepPipeline": Pipe(_pipeline, lambda: dict(audio_duration=10.0, lyrics=["la la la", "oh"], guidance_scale=4.0)),
}
