"""CogView4: CogView4Transformer2DModel (joint attention, text first; its attention_mask becomes a
padding mask over queries and keys)."""

import torch

import families
from families import Pipe, gen, ragged_mask


def _transformer(in_channels: int = 4, seed: int = 0):
    """5 heads of 8 (uneven over 2 and 3 ranks), patch 2, two blocks."""
    from diffusers import CogView4Transformer2DModel

    torch.manual_seed(seed)
    return CogView4Transformer2DModel(patch_size=2, in_channels=in_channels, out_channels=4, num_layers=2,
                                      attention_head_dim=8, num_attention_heads=5, text_embed_dim=16,
                                      time_embed_dim=8, condition_dim=4).eval()


def _forward(mask: bool = True):
    """10 x 14 latents, patch 2: 5 x 7 = 35 image tokens; two prompts of 8 and 3 valid tokens (left
    padded, as the pipeline pads) with the transformer's text ``attention_mask``, or without it."""
    g = gen()
    size = torch.tensor([[80.0, 112.0]] * 2)
    kwargs = dict(hidden_states=torch.randn(2, 4, 10, 14, generator=g), encoder_hidden_states=torch.randn(2, 8, 16, generator=g),
                  timestep=torch.tensor([500.0, 250.0]), original_size=size, target_size=size,
                  crop_coords=torch.zeros(2, 2))
    if mask:
        kwargs["attention_mask"] = ragged_mask([8, 3], 8).flip(1)
    return _transformer(), kwargs


FORWARDS = {"ragged_prompts": _forward, "no_mask": lambda: _forward(mask=False)}


def _pipeline(cls_name: str, in_channels: int = 4, seed: int = 0):
    """``() -> pipeline``: a 2-layer GLM text encoder and a 4-level (8x) tiny VAE: 80 x 112 pixels
    give 10 x 14 latents, 35 tokens (the pipelines need sizes divisible by 16)."""
    def build():
        import diffusers
        from diffusers import AutoencoderKL
        from transformers import GlmConfig, GlmModel

        from diffusers_sp import tiny_models as tm

        torch.manual_seed(seed)
        glm = GlmModel(GlmConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=8, pad_token_id=0)).eval()
        torch.manual_seed(seed)
        vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(4, 4, 4, 4),
                            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                            layers_per_block=1, norm_num_groups=1, sample_size=32).eval()
        return getattr(diffusers, cls_name)(tokenizer=tm.tiny_tokenizer(), text_encoder=glm, vae=vae,
                                            transformer=_transformer(in_channels, seed),
                                            scheduler=tm._flow_scheduler())
    return build


PIPELINES = {
    # Two calls per step (CFG); the batch of two prompts is left padded to one length.
    "CogView4Pipeline": Pipe(_pipeline("CogView4Pipeline"), lambda: dict(height=80, width=112)),
    # The control image's latents join the latents along the channels (4 + 4).
    "CogView4ControlPipeline": Pipe(_pipeline("CogView4ControlPipeline", in_channels=8),
                                    lambda: dict(height=80, width=112, control_image=families.image(112, 80, seed=1))),
}
