"""Latte (text-to-video) for sequence parallelism.

``LatteTransformer3DModel`` factorises attention: spatial blocks attend over the ``H * W`` tokens of each
frame (``[B * F, H * W, C]``; PixArt-style, with the T5 text in cross-attention, left whole), and temporal
blocks over the ``F`` frames of each spatial position (``[B * H * W, F, C]``). So the split is *spatial*:
every rank holds the same spatial tokens of every frame; the spatial self-attention (``attn1`` of
``transformer_blocks``) runs in the dense modes over them, and the temporal blocks attend locally, each
rank over its positions' whole frame axis, unwrapped. The temporal blocks' per-position timestep rows
(``[B * H * W, C]``) split with the tokens (:class:`~diffusers_sp.plan_entries.SplitBatchFolded`).

Sharding plan (Diffusers 0.42 ships no ``_cp_plan`` for it): split the output of ``pos_embed`` (``[B * F, S,
C]``, dim 1), the temporal blocks' ``timestep``; gather ``proj_out`` (the model unpatchifies after it).
"""

from __future__ import annotations

from ..plan_entries import SplitBatchFolded
from .spec import GATHER_TOKENS, SPLIT_TOKENS_OUT, FamilySpec

LATTE = FamilySpec(
    name="latte", model_classes=("LatteTransformer3DModel",), is_video=True,
    sharding_plan={"pos_embed": {0: SPLIT_TOKENS_OUT},
                   "temporal_transformer_blocks.*": {"timestep": SplitBatchFolded()}, "proj_out": GATHER_TOKENS},
    attention_modules=("transformer_blocks.*.attn1",), cfg_strategy="batch",
    note="spatial tokens split; temporal attention local (every rank holds every frame of its tokens)")
