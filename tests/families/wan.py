"""Wan 2.1 / 2.2: WanTransformer3DModel (text in cross-attention). Its own cases (T2V, I2V, Wan 2.2
with two transformers, TI2V, VSA) are in tests/cases_wan.py and tests/cases_vsa.py; here, a forward of
fewer tokens than ranks."""

import torch

from diffusers_sp import tiny_models as tm
from families import FEW_TOKENS, Forward, Pipe, gen, image

COVERED_ELSEWHERE = {"WanPipeline": "tests/test_wan_parallel.py", "WanImageToVideoPipeline": "tests/test_wan_parallel.py"}


def _video(frames: int, seed: int = 0):
    """A list of ``frames`` random 112 x 80 PIL frames: with the tiny Wan VAE (8x spatial, 4x temporal)
    and patch (1, 2, 2), 17 frames are 5 latent frames of 5 x 7 tokens, 175 tokens."""
    return [image(112, 80, seed=seed + i) for i in range(frames)]


def _parts(**transformer) -> dict:
    """The tiny Wan 2.1 text-to-video components (:func:`diffusers_sp.tiny_models.tiny_wan_pipeline`), with
    a transformer of config ``transformer``."""
    parts = tm.tiny_wan_pipeline().components
    return dict(tokenizer=parts["tokenizer"], text_encoder=parts["text_encoder"], vae=parts["vae"],
                scheduler=parts["scheduler"], transformer=tm.tiny_wan_transformer(**transformer))


def _v2v_pipeline():
    from diffusers import WanVideoToVideoPipeline

    return WanVideoToVideoPipeline(**_parts())


def _lucy_pipeline():
    """A tiny ``LucyEditPipeline`` (Wan 2.2 TI2V style, ``expand_timesteps``: one timestep per token):
    the tiny Wan components, with a transformer taking the input video's latents joined along channels
    (in_channels 2 x 16)."""
    from diffusers import LucyEditPipeline

    return LucyEditPipeline(**_parts(in_channels=32), expand_timesteps=True)


def _forward_few_tokens():
    """One frame of 2 x 4 latents: 2 tokens, fewer than 3 ranks (text in cross-attention only)."""
    g = gen()
    return tm.tiny_wan_transformer(), dict(hidden_states=torch.randn(2, 16, 1, 2, 4, generator=g),
                                           encoder_hidden_states=torch.randn(2, 8, tm.TINY_WAN["text_dim"], generator=g),
                                           timestep=torch.tensor([500, 250]))

FORWARDS = {"few_tokens": Forward(_forward_few_tokens, tokens=FEW_TOKENS)}

PIPELINES = {
    # strength 0.7 of 3 steps runs 2.
    "WanVideoToVideoPipeline": Pipe(_v2v_pipeline, lambda: dict(
        video=_video(17), height=80, width=112, strength=0.7, num_inference_steps=3, max_sequence_length=8,
        guidance_scale=5.0), tokens=175),
    # One input video per prompt (the pipeline checks the video latents' shape against the batch's).
    "LucyEditPipeline": Pipe(_lucy_pipeline, lambda: dict(
        video=[_video(17), _video(17, seed=17)], height=80, width=112, num_frames=17, max_sequence_length=8,
        guidance_scale=5.0), tokens=175),
}
