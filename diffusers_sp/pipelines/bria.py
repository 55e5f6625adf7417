"""Bria 3.2 (text-to-image) for sequence parallelism.

``BriaTransformer2DModel`` is Flux's architecture (dual-stream blocks joining ``[text; image]`` in the
processor, single-stream blocks over the concatenation; RoPE over ``cat(txt_ids, img_ids)``) with a T5
text encoder: the text is a *prefix* of every self-attention sequence and there is no text mask. Its
forward takes Flux's ControlNet residuals, split like the image tokens.

Sharding plan (Diffusers 0.42 ships no ``_cp_plan`` for it): split ``hidden_states`` (``[B, S, C]``, dim 1)
and ``img_ids`` (``[S, 3]``, or ``[B, S, 3]`` along dim 1) at the model input, gather ``proj_out``. The
pipeline folds CFG into a batch of two.
"""

from __future__ import annotations

from .flux import FLUX_ATTENTION, FLUX_CONTROLNET, FLUX_LIKE_PLAN
from .spec import FamilySpec

BRIA = FamilySpec(
    name="bria", model_classes=("BriaTransformer2DModel",), is_video=False,
    sharding_plan={**FLUX_LIKE_PLAN, "": {**FLUX_LIKE_PLAN[""], **FLUX_CONTROLNET}},
    attention_modules=FLUX_ATTENTION, joint_text="prefix", cfg_strategy="batch",
    note="Flux's layout, text first; ControlNet residuals split")
