"""CogVideoX: CogVideoXTransformer3DModel (joint attention, text first, no text mask)."""

import torch

from diffusers_sp import tiny_models as tm
from families import FEW_TOKENS, Forward, Pipe, gen, image


def _inputs(g):
    return dict(hidden_states=torch.randn(2, 1, 4, 10, 14, generator=g),
                encoder_hidden_states=torch.randn(2, 8, 32, generator=g), timestep=torch.tensor([500, 250]))


def _forward():
    return tm.tiny_cogvideox_transformer(), _inputs(gen())


def _forward_rope():
    """CogVideoX 1.5 / 5b style: RoPE tables passed by the pipeline as image_rotary_emb, split at the input."""
    g = gen()
    rope = (torch.randn(35, 16, generator=g), torch.randn(35, 16, generator=g))
    return tm.tiny_cogvideox_transformer(use_rotary_positional_embeddings=True), dict(_inputs(g), image_rotary_emb=rope)


def _forward_few_tokens():
    """One frame of 2 x 4 latents: 2 tokens, fewer than 3 ranks (Diffusers' own CogVideoX test size)."""
    g = gen()
    return tm.tiny_cogvideox_transformer(), dict(hidden_states=torch.randn(2, 1, 4, 2, 4, generator=g),
                                                 encoder_hidden_states=torch.randn(2, 8, 32, generator=g),
                                                 timestep=torch.tensor([500, 250]))

FORWARDS = {"": _forward, "rope": _forward_rope, "few_tokens": Forward(_forward_few_tokens, tokens=FEW_TOKENS)}


def _tiny(cls_name: str, **transformer):
    """``() -> pipeline``: the tiny CogVideoX components (:func:`diffusers_sp.tiny_models.tiny_cogvideox_pipeline`,
    8x spatial / 4x temporal VAE with 4 latent channels: 80 x 112 pixels are 5 x 7 tokens per latent frame
    at patch 2) in pipeline class ``cls_name``, with a transformer of config ``transformer``."""
    def build():
        import diffusers

        parts = tm.tiny_cogvideox_pipeline().components
        parts["transformer"] = tm.tiny_cogvideox_transformer(**transformer)
        return getattr(diffusers, cls_name)(**parts)
    return build


def _video(frames: int, seed: int = 0):
    """A list of ``frames`` random 112 x 80 PIL frames (the input video of video-to-video pipelines)."""
    return [image(112, 80, seed=seed + i) for i in range(frames)]


PIPELINES = {
    "CogVideoXPipeline": Pipe(tm.tiny_cogvideox_pipeline, lambda: dict(
        height=80, width=112, num_frames=1, max_sequence_length=8, guidance_scale=6.0)),
    # CogVideoX 1.5 I2V: the image latents joined along channels (in_channels 2 x 4), a temporal patch of
    # 2 frames with RoPE over the patches, and the ofs embedding (its width is the time embedding's); one image per prompt (the pipeline
    # pads the image latents of each prompt, so a single image fails for two prompts). 33 frames are 9 latent frames, padded to
    # 10 by the pipeline: 5 temporal patches of 5 x 7 = 175 tokens.
    "CogVideoXImageToVideoPipeline": Pipe(
        _tiny("CogVideoXImageToVideoPipeline", in_channels=8, patch_size_t=2, ofs_embed_dim=2,
              use_rotary_positional_embeddings=True),
        lambda: dict(image=[image(112, 80, seed=1), image(112, 80, seed=2)], height=80, width=112, num_frames=33, max_sequence_length=8,
                     guidance_scale=6.0),
        tokens=175),
    # CogVideoX 5b style (RoPE without a temporal patch): a 17-frame input video is 5 latent frames, 175
    # tokens; strength 0.7 of 3 steps runs 2.
    "CogVideoXVideoToVideoPipeline": Pipe(
        _tiny("CogVideoXVideoToVideoPipeline", use_rotary_positional_embeddings=True),
        lambda: dict(video=_video(17), height=80, width=112, strength=0.7, num_inference_steps=3,
                     max_sequence_length=8, guidance_scale=6.0),
        tokens=175),
    # CogVideoX-Fun control, 2b style (sin-cos positions): the control video's latents joined along
    # channels, one control video per prompt (the pipeline does not repeat one for a batch); 17 frames
    # are 5 latent frames, 175 tokens.
    "CogVideoXFunControlPipeline": Pipe(
        _tiny("CogVideoXFunControlPipeline", in_channels=8),
        lambda: dict(control_video=[_video(17), _video(17, seed=17)], height=80, width=112, max_sequence_length=8, guidance_scale=6.0),
        tokens=175),
}
