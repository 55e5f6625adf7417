"""Wan 2.1 / 2.2 (text-to-video, image-to-video, two-transformer MoE, TI2V) for sequence parallelism.

Wan's self-attention (``blocks.*.attn1``) runs over the video tokens only; text and the CLIP image
context enter through cross-attention (``attn2``), which needs no communication and is left alone.
The sharding plan is the model's own Diffusers ``_cp_plan``: split the RoPE tables and the first
block's hidden states along the tokens, split per-token timesteps (Wan 2.2 TI2V, ``timestep`` of
shape ``[B, S]``) at the model input, gather the output projection.
"""

from __future__ import annotations

from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

from . import FamilySpec

# The plan Diffusers 0.42 ships as WanTransformer3DModel._cp_plan; used when a model lacks one.
_WAN_PLAN = {
    "rope": {0: ContextParallelInput(split_dim=1, expected_dims=4, split_output=True),
             1: ContextParallelInput(split_dim=1, expected_dims=4, split_output=True)},
    "blocks.0": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)},
    "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    "": {"timestep": ContextParallelInput(split_dim=1, expected_dims=2, split_output=False)},
}


def wan_patch_size(model) -> tuple[int, ...]:
    """Patch size of a ``WanTransformer3DModel`` from its config, frames first."""
    return tuple(int(p) for p in model.config.patch_size)


def wan_sharding_plan(model) -> dict:
    """The model's Diffusers ``_cp_plan`` (or the 0.42 plan when absent), whose splits are made uneven-aware."""
    return dict(getattr(model, "_cp_plan", None) or _WAN_PLAN)


def wan_latent_grid(model, args, kwargs) -> tuple[int, int, int]:
    """Patchified latent grid ``(frames, height, width)`` of a forward call: ``hidden_states``
    ``[B, C, F, H, W]`` divided by the config's ``patch_size`` ``(p_t, p_h, p_w)``."""
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    p_t, p_h, p_w = model.config.patch_size
    _, _, frames, height, width = hidden.shape
    return frames // p_t, height // p_h, width // p_w


def wan_attention_modules(model) -> list:
    """``blocks.{i}.attn1`` (video self-attention) of every block."""
    return [(f"blocks.{i}.attn1", block.attn1) for i, block in enumerate(model.blocks)]


WAN = FamilySpec(
    name="wan",
    pipeline_classes=("WanPipeline", "WanImageToVideoPipeline"),
    model_classes=("WanTransformer3DModel",),
    is_video=True,
    patch_size=wan_patch_size,
    sharding_plan=wan_sharding_plan,
    attention_modules=wan_attention_modules,
    transformer_attributes=("transformer", "transformer_2"),
    modes=("ulysses", "kv_gather", "vsa"),
    latent_grid=wan_latent_grid,
)
