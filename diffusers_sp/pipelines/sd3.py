"""Stable Diffusion 3 / 3.5 (text-to-image) for sequence parallelism.

Joint attention with the text appended after the image tokens (``JointAttnProcessor2_0``
concatenates ``[image; text]``); no text mask. SD3.5's dual-attention blocks add an image-only
self-attention (``attn2``), which is split too (it carries no text tokens).

Sharding plan (explicit; Diffusers 0.42 ships no ``_cp_plan`` for this model): split the output of
``pos_embed`` (patch embedding plus positional embedding, ``[B, S, C]``, dim 1); gather ``proj_out``.
Timestep and pooled projections stay whole. ControlNet residuals (``block_controlnet_hidden_states``,
one ``[B, S, C]`` per block) are split like the image tokens; the ControlNet runs whole on every rank.

PAG pipelines (``StableDiffusion3PAGPipeline``, ``...PAGImg2ImgPipeline``) put Diffusers'
``PAGCFGJointAttnProcessor2_0`` / ``PAGJointAttnProcessor2_0`` on the PAG layers for each call; they are
wrapped at the next forward (``swapped_processors``). Their perturbed pass masks the image-image
attention to the identity: exact per rank for the image rows, through the usual exchange for the text
rows (see :func:`diffusers_sp.processors.base.is_image_identity_mask`).
"""

from __future__ import annotations

from diffusers.models._modeling_parallel import ContextParallelOutput

from .spec import CONTROLNET_RESIDUALS, SPLIT_TOKENS_OUT, FamilySpec

_SD3_PLAN = {
    "": {"block_controlnet_hidden_states": CONTROLNET_RESIDUALS},
    "pos_embed": {0: SPLIT_TOKENS_OUT},
    "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
}


def sd3_attention_modules(model) -> list:
    """``transformer_blocks.{i}.attn`` (joint) and, in dual-attention blocks, ``transformer_blocks.{i}.attn2``."""
    found = []
    for i, b in enumerate(model.transformer_blocks):
        found.append((f"transformer_blocks.{i}.attn", b.attn))
        if getattr(b, "attn2", None) is not None:
            found.append((f"transformer_blocks.{i}.attn2", b.attn2))
    return found


SD3 = FamilySpec(
    name="sd3", model_classes=("SD3Transformer2DModel",), is_video=False,
    sharding_plan=_SD3_PLAN, attention_modules=sd3_attention_modules, joint_text="suffix", cfg_strategy="batch",
    swapped_processors=("PAGJointAttnProcessor2_0", "PAGCFGJointAttnProcessor2_0"),
    note="text after the image; ControlNet residuals split; PAG processors wrapped per call")
