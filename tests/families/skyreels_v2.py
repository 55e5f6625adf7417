"""SkyReels-V2: SkyReelsV2Transformer3DModel (Wan 2.1 with diffusion forcing: per-frame timesteps and a
block-causal frame mask; text in cross-attention)."""

import torch

import families
from diffusers_sp import tiny_models as tm
from families import Forward, Pipe, gen

#: 5 heads: split unevenly by Ulysses over 2 and 3 ranks.
_TINY = dict(patch_size=(1, 2, 2), num_attention_heads=5, attention_head_dim=12, in_channels=16, out_channels=16,
             text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True,
             qk_norm="rms_norm_across_heads", rope_max_seq_len=32)


def _transformer(seed: int = 0, **overrides):
    """A ``SkyReelsV2Transformer3DModel`` of :data:`_TINY` size with random weights (norm weights too,
    as in ``tm.tiny_wan_transformer``: at ones, ``norm_q`` and ``norm_k`` would be the same function)."""
    from diffusers import SkyReelsV2Transformer3DModel

    torch.manual_seed(seed)
    model = SkyReelsV2Transformer3DModel(**{**_TINY, **overrides}).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.normal_(1.0, 0.5)
    return model


def _t2v():
    """One timestep per sample (SkyReels-V2 T2V): 1 frame of 5 x 7 patches."""
    g = gen()
    return _transformer(), dict(hidden_states=torch.randn(2, 16, 1, 10, 14, generator=g),
                                timestep=torch.tensor([700, 300]), encoder_hidden_states=torch.randn(2, 7, 32, generator=g))


# Diffusion forcing with causal blocks of 5 frames: 25 frames of 1 x 5 patches (125 tokens), so that
# the block-causal mask has 5 blocks and the shards end inside a frame (the model repeats each frame's
# modulation over its 5 tokens).
_DF_TOKENS = 25 * 5


def _diffusion_forcing():
    g = gen()
    return _transformer(num_frame_per_block=5), dict(
        hidden_states=torch.randn(2, 16, 25, 2, 10, generator=g), timestep=torch.randint(0, 1000, (2, 25), generator=g),
        encoder_hidden_states=torch.randn(2, 7, 32, generator=g), enable_diffusion_forcing=True)


def _diffusion_forcing_fps():
    """Per-frame timesteps without a mask (``num_frame_per_block=1``) and the fps embedding
    (``inject_sample_info``, which Diffusers 0.42 adds correctly for a batch of 1 only): 5 frames of
    1 x 7 patches."""
    g = gen()
    return _transformer(inject_sample_info=True), dict(
        hidden_states=torch.randn(1, 16, 5, 2, 14, generator=g), timestep=torch.randint(0, 1000, (1, 5), generator=g),
        encoder_hidden_states=torch.randn(1, 7, 32, generator=g), enable_diffusion_forcing=True, fps=[1])


FORWARDS = {
    "t2v": Forward(_t2v, modes=("ulysses", "kv_gather", "vsa")),
    "diffusion_forcing": Forward(_diffusion_forcing, tokens=_DF_TOKENS),
    "diffusion_forcing_fps": _diffusion_forcing_fps,
}


# ------------------------------------------------------------------ tiny pipelines
# The tiny Wan VAE compresses 8x in space and 4x in time; patches are 2 x 2: 80 x 112 pixels give
# 5 x 7 patches per frame. Diffusion forcing runs 97 frames (25 latent frames) of 16 x 80 pixels
# (1 x 5 patches), synchronously (2 iterations) unless said otherwise. Text-to-video runs causal
# blocks of 5 frames asynchronously (ar_step=1: each block a step ahead of the next, so one call's
# frames have different timesteps; 6 iterations); video-to-video conditions on a 17-frame history
# (5 latent frames, one causal block); image-to-video on its image's latent frame, which the pipeline
# would drop to align it to blocks of 5 frames, so its blocks are single frames (no mask).


def _pipeline(name: str, transformer=None, **extra):
    """A tiny pipeline of class ``name`` with UniPC in flow mode (SkyReels-V2's scheduler: diffusion
    forcing steps each frame's scheduler with its own integer timestep)."""
    import diffusers

    scheduler = diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=8.0)
    return getattr(diffusers, name)(
        tokenizer=tm.tiny_tokenizer(), text_encoder=tm.tiny_umt5_encoder(), vae=tm.tiny_wan_vae(),
        scheduler=scheduler, transformer=transformer or _transformer(), **extra)


def _build(name: str):
    return lambda: _pipeline(name)


def _i2v():
    """SkyReelsV2ImageToVideoPipeline: a CLIP image encoder (its penultimate states, width 4, enter
    cross-attention through added K/V projections) and 16 + 20 input channels (latents, condition)."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    torch.manual_seed(0)
    encoder = CLIPVisionModelWithProjection(CLIPVisionConfig(
        hidden_size=4, projection_dim=4, num_hidden_layers=2, num_attention_heads=2, image_size=32,
        intermediate_size=16, patch_size=8)).eval()
    transformer = _transformer(in_channels=36, image_dim=4, added_kv_proj_dim=60)
    return _pipeline("SkyReelsV2ImageToVideoPipeline", transformer, image_encoder=encoder,
                     image_processor=CLIPImageProcessor(crop_size=32, size=32))


def _call(**extra):
    return {**dict(height=80, width=112, num_frames=1, guidance_scale=5.0, negative_prompt=["rain", "snow at night"],
                   max_sequence_length=8), **extra}


def _df_call(**extra):
    return {**dict(height=16, width=80, num_frames=97, guidance_scale=5.0, negative_prompt=["rain", "snow at night"],
                   max_sequence_length=8, causal_block_size=5, ar_step=0), **extra}


PIPELINES = {
    "SkyReelsV2Pipeline": Pipe(_build("SkyReelsV2Pipeline"), _call),
    # The processor takes the last 512 context tokens for text (its text length is fixed), so the
    # prompts are padded to 512.
    "SkyReelsV2ImageToVideoPipeline": Pipe(_i2v, lambda: _call(image=families.image(112, 80), max_sequence_length=512)),
    "SkyReelsV2DiffusionForcingPipeline": Pipe(_build("SkyReelsV2DiffusionForcingPipeline"),
                                               lambda: _df_call(ar_step=1), tokens=_DF_TOKENS),
    "SkyReelsV2DiffusionForcingImageToVideoPipeline": Pipe(
        _build("SkyReelsV2DiffusionForcingImageToVideoPipeline"),
        lambda: _df_call(image=families.image(80, 16), causal_block_size=1), tokens=_DF_TOKENS),
    "SkyReelsV2DiffusionForcingVideoToVideoPipeline": Pipe(
        _build("SkyReelsV2DiffusionForcingVideoToVideoPipeline"),
        lambda: _df_call(video=[families.image(80, 16, seed=i) for i in range(17)], overlap_history=17),
        tokens=_DF_TOKENS),
}
