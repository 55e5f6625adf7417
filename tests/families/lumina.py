"""Lumina-Next: LuminaNextDiT2DModel (text in cross-attention only; proportional attention, scaled by the
number of image tokens)."""

import torch

from diffusers_sp import tiny_models as tm
from families import Pipe, gen, ragged_mask, randomize_norms

_TEXT_DIM = 16


def _transformer(seed: int = 0):
    """Three query heads of 8 over one K/V head (grouped, as the released 32 over 8), two layers, patch 2;
    ``sample_size=16`` makes the pipeline's proportional-attention base 8 x 8 = 64 tokens."""
    from diffusers import LuminaNextDiT2DModel

    torch.manual_seed(seed)
    model = LuminaNextDiT2DModel(sample_size=16, patch_size=2, in_channels=4, hidden_size=24, num_layers=2,
                                 num_attention_heads=3, num_kv_heads=1, multiple_of=16,
                                 cross_attention_dim=_TEXT_DIM).eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.gate.normal_(0.0, 1.0)  # the cross-attention gate starts at zero
    return randomize_norms(model)


def _forward():
    """10 x 14 latents, patch 2: 35 image tokens; two captions of 6 and 2 valid tokens; proportional
    attention over a base of 64 tokens, as the pipeline passes it."""
    from diffusers.models.embeddings import get_2d_rotary_pos_embed_lumina

    g = gen()
    model = _transformer()
    return model, dict(hidden_states=torch.randn(2, 4, 10, 14, generator=g), timestep=torch.tensor([0.5, 0.25]),
                       encoder_hidden_states=torch.randn(2, 6, _TEXT_DIM, generator=g),
                       encoder_mask=ragged_mask([6, 2], 6),
                       image_rotary_emb=get_2d_rotary_pos_embed_lumina(model.head_dim, 32, 32),
                       cross_attention_kwargs={"base_sequence_length": 64})


FORWARDS = {"ragged_prompts": _forward}


def _pipeline():
    """A tiny ``LuminaPipeline``: a two-layer Gemma text encoder over the tiny word tokenizer; the VAE (not
    run: latents out) fills the component."""
    from diffusers import LuminaPipeline
    from transformers import GemmaConfig, GemmaModel

    torch.manual_seed(0)
    gemma = GemmaModel(GemmaConfig(vocab_size=64, hidden_size=_TEXT_DIM, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=8)).eval()
    return LuminaPipeline(transformer=_transformer(), scheduler=tm._flow_scheduler(), vae=tm._tiny_kl_vae(4, 0),
                          text_encoder=gemma, tokenizer=tm.tiny_tokenizer())


PIPELINES = {
    # 80 x 112 pixels: 10 x 14 latents (the pipeline's fixed factor 8), 35 tokens; CFG folded into the batch,
    # with proportional attention (the pipeline's default).
    "LuminaPipeline": Pipe(_pipeline, lambda: dict(height=80, width=112, guidance_scale=4.0)),
}
