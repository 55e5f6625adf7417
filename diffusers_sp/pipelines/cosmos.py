"""Cosmos (Predict 1, Predict 2, Predict 2.5, Transfer 2.5) for sequence parallelism.

``CosmosTransformer3DModel``'s self-attention (``transformer_blocks.*.attn1``) runs over the video
tokens only; the text (and Cosmos 2.5's image context) enter through cross-attention (``attn2``),
whose mask covers the text keys only, so neither needs communication. ``CosmosAttnProcessor2_0``
calls ``dispatch_attention_fn`` without a parallel config and without a backend of its own, so its
self-attention call is found through SDPA (``attention_call="sdpa"``: Diffusers' default native
backend ends in ``F.scaled_dot_product_attention``).

Sharding plan (explicit; Diffusers 0.42 ships no ``_cp_plan`` for this model): split the RoPE tables
``rope`` returns (``[S, D]`` cos and sin, dim 0) and the learnable positional embedding of Cosmos 1
(``[B, S, C]``, dim 1) at their modules; the patchified ``hidden_states`` at the first block
(``[B, S, C]``, dim 1; the patch embedding returns ``[B, T, H, W, C]``, flattened in the model's
forward); at every block the per-token modulation inputs ``embedded_timestep`` and ``temb`` (``[B, S,
C]`` when the timestep is per frame, ``[B, 1, T, 1, 1]``, as in video-to-world: the model expands
them over the tokens; ``[B, C]`` per sample passes whole) and ControlNet residuals
(``controlnet_residual``, ``[B, S, C]``, Transfer 2.5's ControlNet, which runs whole on every rank);
the same modulation inputs at ``norm_out``; gather ``proj_out``.

VSA: the self-attention holds only video tokens and the latent grid is the input's ``[B, C, T, H, W]``
over the patch size, so ``mode="vsa"`` runs (tokens are in raster order, frames first).
"""

from __future__ import annotations

from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

from . import FamilySpec

_TOKENS = ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)
_TABLE = ContextParallelInput(split_dim=0, expected_dims=2, split_output=True)


def cosmos_patch_size(model) -> tuple[int, ...]:
    """Patch size of a ``CosmosTransformer3DModel`` from its config, frames first."""
    return tuple(int(p) for p in model.config.patch_size)


def cosmos_sharding_plan(model) -> dict:
    """The explicit plan of the module docstring."""
    plan = {
        "rope": {0: _TABLE, 1: _TABLE},
        "transformer_blocks.0": {"hidden_states": _TOKENS},
        "transformer_blocks.*": {"embedded_timestep": _TOKENS, "temb": _TOKENS, "controlnet_residual": _TOKENS},
        "norm_out": {"embedded_timestep": _TOKENS, "temb": _TOKENS},
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }
    if model.learnable_pos_embed is not None:
        plan["learnable_pos_embed"] = {0: ContextParallelInput(split_dim=1, expected_dims=3, split_output=True)}
    return plan


def cosmos_latent_grid(model, args, kwargs) -> tuple[int, int, int]:
    """Patchified latent grid ``(frames, height, width)``: ``hidden_states`` ``[B, C, T, H, W]`` over the patch size."""
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    p_t, p_h, p_w = model.config.patch_size
    _, _, frames, height, width = hidden.shape
    return frames // p_t, height // p_h, width // p_w


def cosmos_attention_modules(model) -> list:
    """``transformer_blocks.{i}.attn1`` (video self-attention) of every block."""
    return [(f"transformer_blocks.{i}.attn1", b.attn1) for i, b in enumerate(model.transformer_blocks)]


COSMOS = FamilySpec(
    name="cosmos",
    model_classes=("CosmosTransformer3DModel",),
    is_video=True,
    patch_size=cosmos_patch_size,
    sharding_plan=cosmos_sharding_plan,
    attention_modules=cosmos_attention_modules,
    modes=("ulysses", "kv_gather", "vsa"),
    latent_grid=cosmos_latent_grid,
    note="video self-attention only; per-frame modulation split with its tokens",
)
