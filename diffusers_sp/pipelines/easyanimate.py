"""EasyAnimate (text-to-video, inpainting / image-to-video, control) for sequence parallelism.

``EasyAnimateTransformer3DModel`` patchifies the video frame by frame into ``[B, F*H*W, C]`` tokens and
runs MMDiT-style blocks whose self-attention joins ``[text; video]`` in the processor (the text is a
*prefix*; no text mask reaches the attention). Its 3-D RoPE tables are made from the latent shape by
``rope_embedding`` (``(cos, sin)``, ``[S, D]`` each) and applied to the video part only. Inpainting and
control latents are joined to the video along the channels before the patch embedding.

Sharding plan (Diffusers 0.42 ships no ``_cp_plan`` for it): split the RoPE tables (outputs of
``rope_embedding``, dim 0) and the video tokens where the first block receives them
(``transformer_blocks.0``'s ``hidden_states``, ``[B, S, C]``, dim 1); gather ``proj_out`` (the model
unpatchifies after it).
"""

from __future__ import annotations

from .spec import GATHER_TOKENS, SPLIT_ROWS_OUT, SPLIT_TOKENS, FamilySpec

EASYANIMATE = FamilySpec(
    name="easyanimate", model_classes=("EasyAnimateTransformer3DModel",), is_video=True,
    sharding_plan={"rope_embedding": {0: SPLIT_ROWS_OUT, 1: SPLIT_ROWS_OUT}, "transformer_blocks.0": {"hidden_states": SPLIT_TOKENS},
                   "proj_out": GATHER_TOKENS},
    attention_modules=("transformer_blocks.*.attn1",), joint_text="prefix", cfg_strategy="batch",
    note="text first in self-attention; RoPE tables split; inpaint and control latents joined before the split")
