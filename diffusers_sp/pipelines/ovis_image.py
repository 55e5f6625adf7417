"""Ovis-Image (text-to-image) for sequence parallelism.

``OvisImageTransformer2DModel`` is Flux's architecture (dual-stream blocks joining ``[text; image]`` in
the processor, single-stream blocks over the concatenation; RoPE over ``cat(txt_ids, img_ids)``) with a
Qwen3 text encoder and no pooled projection: the text is a *prefix* of every self-attention sequence
and there is no text mask.

Sharding plan (Diffusers 0.42 ships no ``_cp_plan`` for it): split ``hidden_states`` (``[B, S, C]``, dim 1)
and ``img_ids`` (``[S, 3]``, or ``[B, S, 3]`` along dim 1) at the model input, gather ``proj_out``. The
pipeline makes its two CFG calls inside the transformer's ``cache_context("cond"/"uncond")``.
"""

from __future__ import annotations

from .flux import FLUX_ATTENTION, FLUX_LIKE_PLAN
from .spec import FamilySpec

OVIS_IMAGE = FamilySpec(
    name="ovis_image", model_classes=("OvisImageTransformer2DModel",), is_video=False,
    sharding_plan=FLUX_LIKE_PLAN, attention_modules=FLUX_ATTENTION, joint_text="prefix", cfg_strategy="two_call",
    note="Flux's layout, text first, no text mask")
