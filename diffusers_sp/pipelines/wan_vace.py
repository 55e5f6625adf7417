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

from .spec import GATHER_TOKENS, SPLIT_TOKENS, FamilySpec
from .wan import WAN_ATTENTION, WAN_ROPE, wan_latent_grid, wan_self_attention_kv_first

WAN_VACE = FamilySpec(
    name="wan_vace", model_classes=("WanVACETransformer3DModel",), is_video=True,
    sharding_plan={"rope": {0: WAN_ROPE, 1: WAN_ROPE}, "blocks.0": {"hidden_states": SPLIT_TOKENS},
                   "vace_blocks.0": {"hidden_states": SPLIT_TOKENS, "control_hidden_states": SPLIT_TOKENS},
                   "proj_out": GATHER_TOKENS},
    attention_modules=(*WAN_ATTENTION, "vace_blocks.*.attn1"), modes=("ulysses", "kv_gather", "vsa"),
    latent_grid=wan_latent_grid, self_attention_kv_first=wan_self_attention_kv_first, attention_call="dispatch",
    cfg_strategy="two_call", note="the VACE control branch and its hints split like the video tokens")
