"""Ideogram 4: Ideogram4Transformer2DModel (one packed [left padding; text; image] sequence, block-diagonal segment
mask over queries and keys, 3-axis RoPE; the pipeline's two transformers)."""

import torch

from families import Forward, Modular, Pipe, draw_zero_weights, gen, qwen3_vl_config, randomize_norms

#: Text width of the tiny Qwen3-VL and its 13 tapped layers (the pipeline concatenates them).
_TEXT_DIM, _TAPS = 8, 13


def _transformer(seed: int = 0):
    """Three heads of 8 (uneven over 2 ranks; MRoPE sections 2 + 1 + 1), two layers, 4 latent channels; its
    zero-initialised layers drawn."""
    from diffusers import Ideogram4Transformer2DModel

    torch.manual_seed(seed)
    model = Ideogram4Transformer2DModel(in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=3,
                                        intermediate_size=32, adaln_dim=16, llm_features_dim=_TEXT_DIM * _TAPS,
                                        mrope_section=(2, 1, 1)).eval()
    return draw_zero_weights(randomize_norms(model))


def _forward():
    """8 text places (texts of 6 and 2 tokens, left-padded: the padding is a segment of its own) then 5 x 7 image
    tokens: 43 packed tokens."""
    from diffusers import Ideogram4Pipeline

    g = gen()
    position_ids, segment_ids, indicator = Ideogram4Pipeline._prepare_ids([6, 2], 5, 7, 8, "cpu")
    return _transformer(), dict(hidden_states=torch.randn(2, 43, 4, generator=g), timestep=torch.tensor([0.5, 0.25]),
                                encoder_hidden_states=torch.randn(2, 43, _TEXT_DIM * _TAPS, generator=g),
                                position_ids=position_ids, segment_ids=segment_ids, indicator=indicator)


FORWARDS = {"packed_segments": Forward(_forward, tokens=43)}


def _pipeline():
    """A tiny ``Ideogram4Pipeline``: a 36-layer Qwen3-VL text model of width 8 (the pipeline taps 13 fixed layers up
    to the 36th) over the tiny word tokenizer with a plain chat template, the tiny Flux 2 VAE (not run: latents
    out), two transformers."""
    from diffusers import Ideogram4Pipeline
    from transformers import Qwen3VLModel

    from diffusers_sp import tiny_models as tm
    from families.flux2 import _vae

    torch.manual_seed(0)
    text_encoder = Qwen3VLModel(qwen3_vl_config(_TEXT_DIM, layers=36, head_dim=4, mrope_section=(1, 1, 0))).eval()
    tokenizer = tm.tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{% for c in m['content'] %}{{ c['text'] }}{% endfor %}{% endfor %}"
    return Ideogram4Pipeline(scheduler=tm._flow_scheduler(), vae=_vae(), text_encoder=text_encoder, tokenizer=tokenizer,
                             transformer=_transformer(), unconditional_transformer=_transformer(seed=1))


PIPELINES = {
    # 80 x 112 pixels (the VAE's 8x, then the pipeline's patch 2): 5 x 7 image tokens after 12 text places (prompts
    # of 10 and 2 words), 47 in the conditional call; constant guidance.
    "Ideogram4Pipeline": Pipe(_pipeline, lambda: dict(height=80, width=112, max_sequence_length=12, guidance_scale=4.0,
                                                      guidance_schedule=None), tokens=47),
}


# Modular pipelines (diffusers.modular_pipelines) run with the components and call of a classic case.
MODULAR = {
    # The modular blocks take a guidance scale per step (guidance_schedule) instead of guidance_scale.
    "Ideogram4ModularPipeline": Modular("Ideogram4Pipeline", lambda: dict(guidance_schedule=[4.0, 3.0])),
}
