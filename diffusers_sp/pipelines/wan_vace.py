"""Wan VACE (Wan 2.1 / 2.2 with the VACE control branch) for sequence parallelism.

``WanVACETransformer3DModel`` is Wan (the same ``WanAttention``, ``WanAttnProcessor`` and RoPE) with a
control branch: ``vace_blocks`` run first on ``control_hidden_states`` (the patchified control video
and mask, zero-padded by the model to the length of the video tokens) and return one hint per VACE
layer, ``[B, S, C]``, which the main blocks add to the video tokens. Self-attention
(``blocks.*.attn1`` and ``vace_blocks.*.attn1``) runs over video tokens only; text and the image
context enter through cross-attention, left alone.

Sharding plan (Diffusers ships no ``_cp_plan`` for it): the RoPE tables (outputs of ``rope``) as in
Wan; at ``vace_blocks.0`` both its ``hidden_states`` (the first VACE block adds them to the projected
control states) and ``control_hidden_states``, so that the control branch, its hints and the video
tokens are split alike (in VSA's tile order too); at ``blocks.0`` the video tokens; gather
``proj_out``. Both self-attentions run in dispatch mode (``WanAttnProcessor`` marks them) with Wan's
K/V-first path (``overlap_query_projection``).

VSA runs on the latent grid read as in Wan. ``vsa_gate_weights`` are read per attention module as
``blocks.{i}`` over ``blocks`` then ``vace_blocks`` (the layout of a file trained for this model, if
any; a Wan file lacks the VACE blocks' keys and is refused, naming the first missing key).
"""

from __future__ import annotations

from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

from . import FamilySpec
from .wan import wan_latent_grid, wan_patch_size, wan_self_attention_kv_first

_SPLIT_TOKENS = ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)
_SPLIT_ROPE = ContextParallelInput(split_dim=1, expected_dims=4, split_output=True)
_WAN_VACE_PLAN = {
    "rope": {0: _SPLIT_ROPE, 1: _SPLIT_ROPE},
    "vace_blocks.0": {"hidden_states": _SPLIT_TOKENS, "control_hidden_states": _SPLIT_TOKENS},
    "blocks.0": {"hidden_states": _SPLIT_TOKENS},
    "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
}


def wan_vace_sharding_plan(model) -> dict:
    """The plan of the module docstring (a copy)."""
    return dict(_WAN_VACE_PLAN)


def wan_vace_attention_modules(model) -> list:
    """``blocks.{i}.attn1`` then ``vace_blocks.{i}.attn1`` (video self-attention)."""
    return ([(f"blocks.{i}.attn1", b.attn1) for i, b in enumerate(model.blocks)]
            + [(f"vace_blocks.{i}.attn1", b.attn1) for i, b in enumerate(model.vace_blocks)])


WAN_VACE = FamilySpec(
    name="wan_vace",
    model_classes=("WanVACETransformer3DModel",),
    is_video=True,
    patch_size=wan_patch_size,
    sharding_plan=wan_vace_sharding_plan,
    attention_modules=wan_vace_attention_modules,
    modes=("ulysses", "kv_gather", "vsa"),
    latent_grid=wan_latent_grid,
    self_attention_kv_first=wan_self_attention_kv_first,
    attention_call="dispatch",
    cfg_strategy="two_call",
    note="the VACE control branch and its hints split like the video tokens",
)
