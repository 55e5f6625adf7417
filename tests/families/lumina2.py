"""Lumina 2: Lumina2Transformer2DModel (per-sample padded [caption; image] joint sequence, caption
mask; caption and noise refiners before the joint blocks)."""

import torch

from families import Pipe, gen, ragged_mask


def _transformer(seed: int = 0):
    """3 query heads of 8 over 1 K/V head (grouped, as Lumina 2's 24 over 8), one refiner block of
    each kind, two joint blocks; RoPE axes (caption position, row, column) of 4, 2, 2 channels."""
    from diffusers import Lumina2Transformer2DModel

    torch.manual_seed(seed)
    return Lumina2Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, hidden_size=24, num_layers=2,
                                     num_refiner_layers=1, num_attention_heads=3, num_kv_heads=1, multiple_of=16,
                                     axes_dim_rope=(4, 2, 2), axes_lens=(64, 32, 32), cap_feat_dim=16).eval()


def _forward(lengths=(8, 3)):
    """10 x 14 latents, patch 2: 5 x 7 = 35 image tokens; captions of ``lengths`` valid tokens (right
    padded to 8, as Lumina2Pipeline's tokenizer pads)."""
    g = gen()
    return _transformer(), dict(
        hidden_states=torch.randn(2, 4, 10, 14, generator=g), timestep=torch.tensor([0.5, 0.25]),
        encoder_hidden_states=torch.randn(2, 8, 16, generator=g), encoder_attention_mask=ragged_mask(list(lengths), 8))


FORWARDS = {
    "ragged_prompts": _forward,
    # Equal caption lengths shorter than the padded length: the model builds no joint mask at all.
    "equal_prompts": lambda: _forward((5, 5)),
}


def _pipeline(seed: int = 0):
    """Lumina2Pipeline with a 2-layer Gemma 2 text encoder; the VAE (not run: latents out) only fills
    the component. 80 x 112 pixels: 10 x 14 latents (the pipeline's fixed factor 8), 35 tokens."""
    from diffusers import Lumina2Pipeline
    from transformers import Gemma2Config, Gemma2Model

    from diffusers_sp import tiny_models as tm

    torch.manual_seed(seed)
    gemma = Gemma2Model(Gemma2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=8)).eval()
    return Lumina2Pipeline(transformer=_transformer(seed), scheduler=tm._flow_scheduler(), vae=tm._tiny_kl_vae(4, seed),
                           text_encoder=gemma, tokenizer=tm.tiny_tokenizer())


PIPELINES = {
    # Two calls per step (CFG with the empty negative prompt); the pipeline pads captions to
    # max_sequence_length and the batch of two prompts gives two caption lengths.
    "Lumina2Pipeline": Pipe(_pipeline, lambda: dict(height=80, width=112, max_sequence_length=24, system_prompt="")),
}
