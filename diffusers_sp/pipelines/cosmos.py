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

from .spec import GATHER_TOKENS, SPLIT_ROWS_OUT, SPLIT_TOKENS, SPLIT_TOKENS_OUT, FamilySpec, latent_grid_of

_PLAN = {
    "rope": {0: SPLIT_ROWS_OUT, 1: SPLIT_ROWS_OUT},
    "transformer_blocks.0": {"hidden_states": SPLIT_TOKENS},
    "transformer_blocks.*": {"embedded_timestep": SPLIT_TOKENS, "temb": SPLIT_TOKENS, "controlnet_residual": SPLIT_TOKENS},
    "norm_out": {"embedded_timestep": SPLIT_TOKENS, "temb": SPLIT_TOKENS},
    "proj_out": GATHER_TOKENS,
}


def cosmos_sharding_plan(model) -> dict:
    """The explicit plan of the module docstring, with the learnable position embedding where the model has one."""
    plan = dict(_PLAN)
    if model.learnable_pos_embed is not None:
        plan["learnable_pos_embed"] = {0: SPLIT_TOKENS_OUT}
    return plan


COSMOS = FamilySpec(
    name="cosmos", model_classes=("CosmosTransformer3DModel",), is_video=True,
    sharding_plan=cosmos_sharding_plan, attention_modules=("transformer_blocks.*.attn1",),
    modes=("ulysses", "kv_gather", "vsa"), latent_grid=latent_grid_of("BCFHW"),
    note="video self-attention only; per-frame modulation split with its tokens")
