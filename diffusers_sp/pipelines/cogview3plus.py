"""CogView3-Plus (text-to-image) for sequence parallelism.

``CogView3PlusTransformer2DModel`` embeds the text and the image patches in one call (``patch_embed``
returns ``[text; image]``) and slices them apart; each block's self-attention (``attn1``, CogVideoX's
processor) joins them again as ``[text; image]``, so the text is a *prefix* of the self-attention
sequence. There is no text mask.

Sharding plan (Diffusers 0.42 ships no ``_cp_plan`` for it): split the image tokens where the first block
receives them (``transformer_blocks.0``'s ``hidden_states``, ``[B, S, C]``, dim 1), after the slicing;
gather ``proj_out`` (the model unpatchifies after it). The size conditions stay whole.
"""

from __future__ import annotations

from .spec import GATHER_TOKENS, SPLIT_TOKENS, FamilySpec

COGVIEW3PLUS = FamilySpec(
    name="cogview3plus", model_classes=("CogView3PlusTransformer2DModel",), is_video=False,
    sharding_plan={"transformer_blocks.0": {"hidden_states": SPLIT_TOKENS}, "proj_out": GATHER_TOKENS},
    attention_modules=("transformer_blocks.*.attn1",), joint_text="prefix", cfg_strategy="batch",
    note="text first in self-attention, no text mask")
