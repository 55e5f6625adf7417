"""LTX-Video: LTXVideoTransformer3DModel (text in cross-attention, text mask)."""

import torch

from diffusers_sp import tiny_models as tm
from families import FEW_TOKENS, Forward, Modular, PROMPTS, Pipe, gen, image, ragged_mask


def _forward():
    g = gen()
    return tm.tiny_ltx_transformer(), dict(
        hidden_states=torch.randn(2, 35, 8, generator=g), encoder_hidden_states=torch.randn(2, 7, 32, generator=g),
        encoder_attention_mask=ragged_mask([7, 4], 7), timestep=torch.tensor([500, 250]), num_frames=1, height=5,
        width=7)


def _forward_per_token_timestep():
    """One timestep per token as [B, S, 1] (LTXI2VLongMultiPromptPipeline; the first frame's tokens at 0)
    with the RoPE coordinates passed as ``video_coords`` [1, 3, S] for the batch (5 frames of 1 x 7)."""
    g = gen()
    frame = torch.arange(5.0).repeat_interleave(7)
    coords = torch.stack([frame / 25.0, torch.zeros(35), torch.arange(7.0).repeat(5) * 32])[None]
    timestep = (frame > 0).float()[None, :, None] * torch.tensor([500.0, 250.0])[:, None, None]
    return tm.tiny_ltx_transformer(), dict(
        hidden_states=torch.randn(2, 35, 8, generator=g), encoder_hidden_states=torch.randn(2, 7, 32, generator=g),
        encoder_attention_mask=ragged_mask([7, 4], 7), timestep=timestep, num_frames=1, height=1, width=1,
        rope_interpolation_scale=(8, 32, 32), video_coords=coords)


def _forward_few_tokens():
    """One frame of 1 x 2 latents: 2 tokens, fewer than 3 ranks, with ragged prompts."""
    g = gen()
    return tm.tiny_ltx_transformer(), dict(
        hidden_states=torch.randn(2, 2, 8, generator=g), encoder_hidden_states=torch.randn(2, 7, 32, generator=g),
        encoder_attention_mask=ragged_mask([7, 4], 7), timestep=torch.tensor([500, 250]), num_frames=1, height=1,
        width=2)

FORWARDS = {"ragged_prompts": _forward, "per_token_timestep": _forward_per_token_timestep,
            "few_tokens": Forward(_forward_few_tokens, tokens=FEW_TOKENS)}


def _tiny(cls_name: str):
    """``() -> pipeline``: the tiny LTX components (:func:`diffusers_sp.tiny_models.tiny_ltx_pipeline`)
    in pipeline class ``cls_name``; 160 x 224 pixels are 5 x 7 latent tokens per latent frame."""
    def build():
        import diffusers

        return getattr(diffusers, cls_name)(**tm.tiny_ltx_pipeline().components)
    return build


def _condition_call():
    """LTXConditionPipeline: an image at frame 0 (its latent frame replaces the first, timestep 0 on its
    tokens) and one at frame 8, whose latent frame is joined to the sequence as 35 extra tokens with their
    own ``video_coords``: 4 latent frames + 1 = 175 tokens. One prompt (with CFG a batch of 2, ragged text
    masks): the pipeline joins the extra tokens of a batch of 1 to the latents, which fails for a larger
    batch in one process as well."""
    from diffusers.pipelines.ltx.pipeline_ltx_condition import LTXVideoCondition

    return dict(prompt=PROMPTS[0], conditions=[LTXVideoCondition(image=image(224, 160, seed=1), frame_index=0),
                            LTXVideoCondition(image=image(224, 160, seed=2), frame_index=8, strength=0.8)],
                height=160, width=224, num_frames=25, max_sequence_length=8, guidance_scale=3.0)


def _long_call():
    """LTXI2VLongMultiPromptPipeline: 6 latent frames in two temporal windows of 4 (overlap 2), one
    prompt each (its batch is 1); each window joins the conditioning image's latent frame (and the second
    window the previous window's last 2 frames) as tokens at the end: 5 frames (175 tokens), then 7 (245)."""
    return dict(prompt=PROMPTS, cond_image=image(224, 160, seed=1), height=160, width=224,
                num_frames=41, temporal_tile_size=32, temporal_overlap=16, max_sequence_length=8, guidance_scale=3.0)


PIPELINES = {
    "LTXPipeline": Pipe(tm.tiny_ltx_pipeline, lambda: dict(height=160, width=224, num_frames=1, max_sequence_length=8,
                                                           guidance_scale=3.0)),
    # 4 latent frames of 5 x 7 (140 tokens would divide 2): 5 frames, with one timestep per token
    # (the first frame's tokens, the image, at 0).
    "LTXImageToVideoPipeline": Pipe(_tiny("LTXImageToVideoPipeline"), lambda: dict(
        image=image(224, 160), height=160, width=224, num_frames=33, max_sequence_length=8, guidance_scale=3.0),
        tokens=175),
    "LTXConditionPipeline": Pipe(_tiny("LTXConditionPipeline"), _condition_call, tokens=175),
    "LTXI2VLongMultiPromptPipeline": Pipe(_tiny("LTXI2VLongMultiPromptPipeline"), _long_call, tokens=245),
}


# Modular pipelines (diffusers.modular_pipelines) run with the components and call of a classic case.
MODULAR = {
    "LTXModularPipeline": Modular("LTXPipeline"),
}
