"""Sana-Video: SanaVideoTransformer3DModel (linear self-attention over the video tokens, a convolutional
feed-forward over the latent grid; text in cross-attention with a text mask)."""

import torch

import families
from families import Pipe, gen, ragged_mask


def _transformer(seed: int = 0):
    """3 heads of 16 (RoPE 8 + 4 + 4) in self- and cross-attention, two blocks, caption width 16 (the tiny
    Gemma2's); patches of 1 x 4 x 4 (the pipelines need sizes divisible by 32: with the 8x VAE and 2 x 2
    patches every frame would hold an even number of tokens)."""
    from diffusers import SanaVideoTransformer3DModel

    torch.manual_seed(seed)
    model = SanaVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=3, attention_head_dim=16, num_layers=2,
        num_cross_attention_heads=3, cross_attention_head_dim=16, cross_attention_dim=48, caption_channels=16,
        mlp_ratio=2.5, sample_size=30, patch_size=(1, 4, 4), rope_max_seq_len=64).eval()
    with torch.no_grad():  # norm weights start at ones (QK-norms then equal); trained ones do not
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.normal_(1.0, 0.5)
    return model


def _forward(per_token: bool):
    """5 frames of 1 x 7 patches (35 tokens: shards cut frames, so the feed-forward's temporal convolution
    reaches across ranks), two samples with ragged text masks; a timestep per sample, or per token with
    the first frame's at zero (the image-to-video pipeline's)."""
    def build():
        g = gen()
        timestep = torch.tensor([900.0, 300.0])
        if per_token:
            first = torch.zeros(2, 1, 5, 1, 7).index_fill_(2, torch.tensor([0]), 1.0)
            timestep = timestep[:, None, None, None, None] * (1 - first)
        return _transformer(), dict(
            hidden_states=torch.randn(2, 4, 5, 4, 28, generator=g), encoder_hidden_states=torch.randn(2, 6, 16, generator=g),
            encoder_attention_mask=ragged_mask([6, 2], 6), timestep=timestep)
    return build


FORWARDS = {"per_sample_timestep": _forward(False), "per_token_timestep": _forward(True)}


# ------------------------------------------------------------------ tiny pipelines
# The tiny Wan VAE compresses 8x in space and 4x in time: 32 x 224 pixels and 17 frames are 5 frames of
# 1 x 7 patches, 35 tokens.


def _build(name: str, scheduler: str):
    """A tiny Gemma2 text encoder and an ``AutoencoderKLWan`` with 4 latent channels (the transformer's)."""
    def build():
        import diffusers
        from diffusers import AutoencoderKLWan
        from transformers import Gemma2Config, Gemma2Model

        from diffusers_sp import tiny_models as tm

        torch.manual_seed(0)
        vae = AutoencoderKLWan(base_dim=3, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                               temperal_downsample=[False, True, True], latents_mean=[0.0] * 4,
                               latents_std=[1.0] * 4).eval()
        torch.manual_seed(0)
        gemma = Gemma2Model(Gemma2Config(vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)).eval()
        return getattr(diffusers, name)(tokenizer=tm.tiny_tokenizer(), text_encoder=gemma, vae=vae,
                                        transformer=_transformer(), scheduler=getattr(diffusers, scheduler)())
    return build


def _call(**extra):
    """No resolution binning (its buckets are for the real sample size) and no prompt-enhancing
    instruction (hundreds of tokens for the real tokenizer)."""
    return dict(height=32, width=224, frames=17, max_sequence_length=12, guidance_scale=3.0,
                use_resolution_binning=False, complex_human_instruction=[], **extra)


PIPELINES = {
    "SanaVideoPipeline": Pipe(_build("SanaVideoPipeline", "DPMSolverMultistepScheduler"), _call),
    "SanaImageToVideoPipeline": Pipe(_build("SanaImageToVideoPipeline", "FlowMatchEulerDiscreteScheduler"),
                                     lambda: _call(image=families.image(224, 32))),
}
