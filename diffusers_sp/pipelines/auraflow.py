"""AuraFlow (text-to-image) for sequence parallelism.

``AuraFlowTransformer2DModel`` prepends learned register tokens to the UMT5 text, and runs MMDiT blocks
whose attention joins ``[registers and text; image]`` in the processor, then single-stream blocks over
that concatenation: the registers and text are a *prefix* of every self-attention sequence (the
processor reads its length off each call), and there is no text mask.

Sharding plan (Diffusers 0.42 ships no ``_cp_plan`` for it): split the output of ``pos_embed`` (patch
embedding plus cropped positions, ``[B, S, C]``, dim 1); gather ``proj_out`` (the model unpatchifies
after it). The registers, text and timestep stay whole.
"""

from __future__ import annotations

from .spec import GATHER_TOKENS, SPLIT_TOKENS_OUT, FamilySpec

AURAFLOW = FamilySpec(
    name="auraflow", model_classes=("AuraFlowTransformer2DModel",), is_video=False,
    sharding_plan={"pos_embed": {0: SPLIT_TOKENS_OUT},
                   "proj_out": GATHER_TOKENS},
    attention_modules=("joint_transformer_blocks.*.attn", "single_transformer_blocks.*.attn"), joint_text="prefix",
    cfg_strategy="batch", note="register tokens and text first in self-attention, no text mask")
