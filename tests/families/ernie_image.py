"""ERNIE-Image: ErnieImageTransformer2DModel (sequence-major [image; text], text last, with a key padding
mask the model builds over the full joint sequence from ``text_lens``)."""

import torch

from diffusers_sp import tiny_models as tm
from families import Modular, Pipe, draw_zero_weights, gen, randomize_norms

_TEXT_DIM = 16


def _transformer(seed: int = 0):
    """Three heads of 8 (uneven over 2 ranks), two layers, 4 latent channels, patch 1, RoPE axes 2 + 2 + 4; its
    zero-initialised modulation and output layer drawn."""
    from diffusers import ErnieImageTransformer2DModel

    torch.manual_seed(seed)
    model = ErnieImageTransformer2DModel(hidden_size=24, num_attention_heads=3, num_layers=2, ffn_hidden_size=32,
                                         in_channels=4, out_channels=4, patch_size=1, text_in_dim=_TEXT_DIM,
                                         rope_axes_dim=(2, 2, 4)).eval()
    return draw_zero_weights(randomize_norms(model))


def _forward():
    """5 x 7 latents (35 image tokens); two prompts of 6 and 2 text tokens, padded to 6."""
    g = gen()
    return _transformer(), dict(hidden_states=torch.randn(2, 4, 5, 7, generator=g), timestep=torch.tensor([0.5, 0.25]),
                                text_bth=torch.randn(2, 6, _TEXT_DIM, generator=g), text_lens=torch.tensor([6, 2]))


FORWARDS = {"ragged_prompts": _forward}


def _pipeline():
    """A tiny ``ErnieImagePipeline``: a two-layer Mistral text encoder over the tiny word tokenizer (the
    pipeline reads its second-to-last hidden state), the tiny Flux 2 VAE (not run: latents out), no prompt
    enhancer."""
    from diffusers import ErnieImagePipeline
    from transformers import MistralConfig, MistralModel

    from families.flux2 import _vae

    torch.manual_seed(0)
    mistral = MistralModel(MistralConfig(vocab_size=64, hidden_size=_TEXT_DIM, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)).eval()
    return ErnieImagePipeline(transformer=_transformer(), vae=_vae(), text_encoder=mistral,
                              tokenizer=tm.tiny_tokenizer(), scheduler=tm._flow_scheduler())


PIPELINES = {
    # The VAE's 4 blocks: 16x down, 80 x 112 pixels -> 5 x 7 latents; CFG folded into the batch, prompts of
    # different lengths (ragged text).
    "ErnieImagePipeline": Pipe(_pipeline, lambda: dict(height=80, width=112, guidance_scale=4.0, use_pe=False,
                                                       negative_prompt=["rain", "snow at night over the city"])),
}


# Modular pipelines (diffusers.modular_pipelines) run with the components and call of a classic case.
MODULAR = {
    "ErnieImageModularPipeline": Modular("ErnieImagePipeline"),
}
