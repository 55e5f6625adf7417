"""Helios: HeliosTransformer3DModel (history of earlier chunks and the chunk as one sequence, text in
cross-attention, no text mask)."""

import torch

from diffusers_sp import tiny_models as tm
from families import Modular, Pipe, gen, randomize_norms


def tiny_transformer(seed: int = 0, **overrides):
    """A ``HeliosTransformer3DModel``: 3 heads of 12, two blocks, patch (1, 2, 2), text dim 32."""
    from diffusers import HeliosTransformer3DModel

    torch.manual_seed(seed)
    cfg = dict(patch_size=(1, 2, 2), num_attention_heads=3, attention_head_dim=12, in_channels=4, out_channels=4,
               text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2, rope_dim=(4, 4, 4))
    cfg.update(overrides)
    model = randomize_norms(HeliosTransformer3DModel(**cfg).eval())
    with torch.no_grad():
        for block in model.blocks:
            if getattr(block.attn1, "is_amplify_history", False):
                block.attn1.history_key_scale.normal_(0.0, 1.0)  # per-head key scales that differ
    return model


def _forward(**overrides):
    """The chunk (4 frames of 2 x 10 latents: 20 tokens) after its history: short (2 frames, 10 tokens),
    mid (2 frames at 2 x 4 x 4: 3 tokens) and long (2 frames at 4 x 8 x 8: 2 tokens), 35 in all. The
    history/chunk boundary (15) falls inside a shard at 2 and at 3 ranks."""
    def build():
        g = gen()
        history = {f"latents_history_{k}": torch.randn(2, 4, 2, 2, 10, generator=g) for k in ("short", "mid", "long")}
        return tiny_transformer(**overrides), dict(
            hidden_states=torch.randn(2, 4, 4, 2, 10, generator=g), timestep=torch.tensor([500, 250]),
            encoder_hidden_states=torch.randn(2, 8, 32, generator=g), indices_hidden_states=torch.arange(6, 10)[None],
            indices_latents_history_short=torch.tensor([[0, 5]]), indices_latents_history_mid=torch.tensor([[3, 4]]),
            indices_latents_history_long=torch.tensor([[1, 2]]), **history)
    return build


FORWARDS = {
    "history": _forward(),
    # Helios-Distilled style: the history keys scaled per head inside the self-attention.
    "amplify_history": _forward(is_amplify_history=True),
    # Every token takes the cross-attention; the history keeps the chunk's timestep.
    "no_guidance_cross_attn": _forward(guidance_cross_attn=False, zero_history_timestep=False),
}


def _components(seed: int, scheduler):
    return dict(tokenizer=tm.tiny_tokenizer(), text_encoder=tm.tiny_umt5_encoder(seed=seed), vae=tm.tiny_wan_vae(seed),
                scheduler=scheduler, transformer=tiny_transformer(seed, in_channels=16, out_channels=16))


def tiny_helios_pipeline(seed: int = 0):
    """``HeliosPipeline`` (UMT5, Wan VAE; a one-stage scheduler)."""
    from diffusers import HeliosPipeline, HeliosScheduler

    return HeliosPipeline(**_components(seed, HeliosScheduler(stages=1, stage_range=[0, 1])))


def tiny_helios_pyramid_pipeline(seed: int = 0):
    """``HeliosPyramidPipeline`` with two stages (the chunk at half, then full resolution).

    The pipeline draws its block noise from ``N(0, (1 + gamma) I - gamma 11^T)`` over each 2 x 2 patch
    (``sample_block_noise``, a float32 Cholesky factorisation). The eigenvalues of that covariance are
    ``1 + gamma`` and, along the all-ones vector, ``1 - 3 gamma``: with the scheduler's default
    ``gamma = 1/3`` it is singular, and whether the factorisation succeeds depends on the CPU and the
    BLAS build (the ``1e-8`` Diffusers adds is lost in float32). ``gamma = 0.25`` makes the smallest
    eigenvalue 0.25, so the reference run is the same on every machine."""
    from diffusers import HeliosPyramidPipeline, HeliosScheduler

    return HeliosPyramidPipeline(**_components(seed, HeliosScheduler(stages=2, stage_range=[0, 0.5, 1],
                                                                    gamma=_PYRAMID_GAMMA)))


# Two chunks of 2 latent frames (5 video frames each; the second one's history holds the first) and a
# history of [2, 2, 1] latent frames (long, mid, short after the first frame). At 16 x 80 pixels
# (2 x 10 latents) a forward has 2 x 5 chunk tokens and 10 + 3 + 2 history tokens: 25. At 32 x 96
# (4 x 12) the pyramid's last stage has 24 + 24 + 3 + 2: 53 (its first stage, the chunk at 2 x 6: 6 + 29 = 35).
#: The pyramid scheduler's ``gamma`` (see :func:`tiny_helios_pyramid_pipeline`).
_PYRAMID_GAMMA = 0.25

_CHUNKS = dict(num_frames=6, num_latent_frames_per_chunk=2, history_sizes=[2, 2, 1], max_sequence_length=8)

PIPELINES = {
    "HeliosPipeline": Pipe(tiny_helios_pipeline, lambda: dict(height=16, width=80, **_CHUNKS), tokens=25),
    "HeliosPyramidPipeline": Pipe(tiny_helios_pyramid_pipeline, lambda: dict(
        height=32, width=96, pyramid_num_inference_steps_list=[1, 1], **_CHUNKS), tokens=53),
}


def _dmd_scheduler():
    from diffusers import HeliosDMDScheduler

    return {"scheduler": HeliosDMDScheduler(stages=2, stage_range=[0, 0.5, 1], gamma=_PYRAMID_GAMMA)}


# Modular pipelines (diffusers.modular_pipelines) run with the components and call of a classic case.
MODULAR = {
    "HeliosModularPipeline": Modular("HeliosPipeline"),
    "HeliosPyramidModularPipeline": Modular("HeliosPyramidPipeline"),
    # The distilled blocks step a DMD scheduler (HeliosDMDScheduler) over the same two stages.
    "HeliosPyramidDistilledModularPipeline": Modular("HeliosPyramidPipeline", components=_dmd_scheduler),
}
