"""HunyuanDiT (text-to-image, PAG and ControlNet) for sequence parallelism.

``HunyuanDiT2DModel``'s blocks run a self-attention over the image tokens alone (``attn1``, 2-D RoPE),
a cross-attention to the joined CLIP-style BERT and mT5 text (``attn2``, left whole on every rank; its
padding is filled with a learned embedding, not masked), and a per-token MLP; the second half of the
blocks adds a long skip from the first half (per token). So the image sequence splits after
``pos_embed`` and only ``attn1`` is wrapped.

Sharding plan (Diffusers 0.42 ships no ``_cp_plan`` for it): split the output of ``pos_embed`` (``[B, S,
C]``, dim 1) and the pipeline's RoPE tables ``image_rotary_emb`` (``(cos, sin)``, ``[S, D]`` each, dim 0)
at the model input; gather ``proj_out`` (the model unpatchifies after it). ControlNet residuals (one
``[B, S, C]`` per skip) are split like the image tokens; the ControlNet runs whole on every rank.

``HunyuanDiTPAGPipeline`` puts Diffusers' ``PAGHunyuanAttnProcessor2_0`` / ``PAGCFGHunyuanAttnProcessor2_0``
on the PAG layers' ``attn1`` for each call; they are wrapped at the next forward (their perturbed pass
is the value projection, per token).
"""

from __future__ import annotations

from .spec import CONTROLNET_RESIDUALS, GATHER_TOKENS, SPLIT_ROWS, SPLIT_TOKENS_OUT, FamilySpec

_HUNYUAN_DIT_PLAN = {
    "": {"image_rotary_emb": [SPLIT_ROWS, SPLIT_ROWS], "controlnet_block_samples": CONTROLNET_RESIDUALS},
    "pos_embed": {0: SPLIT_TOKENS_OUT},
    "proj_out": GATHER_TOKENS,
}

HUNYUAN_DIT = FamilySpec(
    name="hunyuan_dit", model_classes=("HunyuanDiT2DModel",), is_video=False,
    sharding_plan=_HUNYUAN_DIT_PLAN, attention_modules=("blocks.*.attn1",), cfg_strategy="batch",
    swapped_processors=("PAGHunyuanAttnProcessor2_0", "PAGCFGHunyuanAttnProcessor2_0"),
    note="text in cross-attention only; RoPE tables and ControlNet residuals split; PAG processors wrapped per call")
