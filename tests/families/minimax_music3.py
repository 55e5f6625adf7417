"""MiniMax-Music-3: MiniMaxMusic3Transformer1DModel (1-D audio latents with frame-aligned conditions, one time token
in front, partial RoPE). Its pipeline is modular only (accepted through the family)."""

import torch

from families import gen, randomize_norms


def _transformer(seed: int = 0):
    """Three heads of 8 (uneven over 2 ranks; RoPE over 4 of each head's 8 dims), two blocks, 4 latent channels,
    conditions of width 8."""
    from diffusers import MiniMaxMusic3Transformer1DModel

    torch.manual_seed(seed)
    model = MiniMaxMusic3Transformer1DModel(in_channels=4, condition_dim=8, num_layers=2, num_attention_heads=3,
                                            attention_head_dim=8, ff_inner_dim=32, rotary_dim=4,
                                            fourier_embedding_dim=16).eval()
    return randomize_norms(model)


def _forward():
    """34 latent frames: with the time token, a sequence of 35."""
    g = gen()
    return _transformer(), dict(hidden_states=torch.randn(2, 4, 34, generator=g), timestep=torch.tensor([0.5, 0.25]),
                                encoder_hidden_states=torch.randn(2, 34, 8, generator=g))


FORWARDS = {"conditioned_audio": _forward}
