"""FLUX.3: Flux3Transformer2DModel (per-mode blocks over the text alone and the image alone, then single-stream
blocks over [text; image], text first). Its pipelines are modular only (accepted through the family)."""

import torch

from families import Refusal, draw_zero_weights, flux_ids, gen, randomize_norms


def _transformer(seed: int = 0):
    """Three heads of 8 (uneven over 2 ranks; RoPE axes 2 x 4), one per-mode block of each kind, two single-stream
    blocks, 4 latent channels, text of width 16; its zero-initialised layers drawn."""
    from diffusers import Flux3Transformer2DModel

    torch.manual_seed(seed)
    model = Flux3Transformer2DModel(in_channels=4, cond_in_channels=4, num_layers=1, num_single_layers=2,
                                    attention_head_dim=8, num_attention_heads=3, joint_attention_dim=16,
                                    timestep_channels=16, axes_dims_rope=(2, 2, 2, 2)).eval()
    return draw_zero_weights(randomize_norms(model))


def _forward():
    """5 x 7 image tokens (position ids (0, row, column, 0)) after 6 text tokens (ids (0, 0, 0, position))."""
    g = gen()
    img_ids = torch.cat([flux_ids(), torch.zeros(35, 1)], dim=1)
    txt_ids = torch.zeros(6, 4)
    txt_ids[:, 3] = torch.arange(6)
    return _transformer(), dict(hidden_states=torch.randn(2, 35, 4, generator=g),
                                encoder_hidden_states=torch.randn(2, 6, 16, generator=g),
                                timestep=torch.tensor([0.5, 0.25]), img_ids=img_ids, txt_ids=txt_ids)


FORWARDS = {"text_to_image": _forward}


def _with_reference():
    """:func:`_forward` with a 2 x 3 reference image (its tokens and position ids)."""
    model, kwargs = _forward()
    ref_ids = torch.cat([flux_ids(2, 3), torch.zeros(6, 1)], dim=1)
    ref_ids[:, 0] = 1
    return model, dict(kwargs, image_cond_hidden_states=torch.randn(2, 6, 4, generator=gen(2)), image_cond_ids=ref_ids)


REFUSED_FORWARDS = {"reference_image": Refusal(_with_reference, match="image_cond_hidden_states")}
