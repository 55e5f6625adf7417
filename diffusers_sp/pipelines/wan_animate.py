"""Wan Animate (Wan 2.2 Animate: character animation and replacement) for sequence parallelism.

``WanAnimateTransformer3DModel`` is Wan 2.1 (copies of ``WanAttention``, ``WanAttnProcessor``, the
blocks and RoPE) with pose latents added to the video latents before patchifying, and a *face
adapter* after every ``inject_face_latents_blocks``-th block: a cross-attention from the video tokens
to the face-motion tokens of their own frame (``[B, S, C] -> [B * F, S / F, C]`` queries against
``[B * F, N, C]`` keys), whose output is added to the video tokens. Self-attention (``blocks.*.attn1``)
runs over video tokens only, in dispatch mode (the processor marks it) with Wan's K/V-first path.

Sharding plan (Diffusers ships no ``_cp_plan`` for it): the RoPE tables and the first block's video
tokens split as in Wan, ``proj_out`` gathered. The face adapter groups its queries by frame, which a
shard cut inside a frame cannot do, so its input is gathered whole (:class:`~diffusers_sp.plan_entries.GatherInput`)
and its output split again: one all-gather of ``[B, S, C]`` per adapter (every fifth block by default,
about a tenth of K/V-gather's traffic) and the adapter's per-token work on every rank; exact, in VSA's
tile order too. The motion and face encoders run whole on every rank (they see no video token).

VSA runs on the latent grid read as in Wan (``hidden_states`` ``[B, 2C + 4, F, H, W]``).
"""

from __future__ import annotations

from ..plan_entries import GatherInput
from .spec import GATHER_TOKENS, SPLIT_TOKENS, SPLIT_TOKENS_OUT, FamilySpec
from .wan import WAN_ATTENTION, WAN_ROPE, wan_latent_grid, wan_self_attention_kv_first

WAN_ANIMATE = FamilySpec(
    name="wan_animate", model_classes=("WanAnimateTransformer3DModel",), is_video=True,
    sharding_plan={"rope": {0: WAN_ROPE, 1: WAN_ROPE}, "blocks.0": {"hidden_states": SPLIT_TOKENS},
                   "face_adapter.*": {"hidden_states": GatherInput(gather_dim=1, expected_dims=3),
                                      0: SPLIT_TOKENS_OUT},
                   "proj_out": GATHER_TOKENS},
    attention_modules=WAN_ATTENTION, modes=("ulysses", "kv_gather", "vsa"), latent_grid=wan_latent_grid,
    self_attention_kv_first=wan_self_attention_kv_first, attention_call="dispatch", cfg_strategy="two_call",
    cfg_by_default=False, note="the face adapter (per-frame cross-attention) runs on the gathered tokens")
