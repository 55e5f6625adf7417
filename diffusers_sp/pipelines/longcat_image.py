"""LongCat-Image (text-to-image and editing) for sequence parallelism.

``LongCatImageTransformer2DModel`` is Flux's architecture (dual-stream blocks joining ``[text; image]``
in the processor, single-stream blocks over the concatenation; RoPE over ``cat(txt_ids, img_ids)``)
with a Qwen2.5-VL text encoder: the text is a *prefix* of every self-attention sequence and there is no
text mask (the pipeline passes none). The edit pipeline appends the reference image's tokens to the
latent tokens (and their ids to ``img_ids``), so they are split with them.

Sharding plan (Diffusers 0.42 ships no ``_cp_plan`` for it): Flux's without ControlNet inputs, split
``hidden_states`` (``[B, S, C]``, dim 1) and ``img_ids`` (``[S, 3]``, or ``[B, S, 3]`` along dim 1) at the
model input, gather ``proj_out``. The pipelines make their two CFG calls inside the transformer's
``cache_context("cond"/"uncond")``, so CFG parallelism pairs them.
"""

from __future__ import annotations

from .flux import FLUX_ATTENTION, FLUX_LIKE_PLAN
from .spec import FamilySpec

LONGCAT_IMAGE = FamilySpec(
    name="longcat_image", model_classes=("LongCatImageTransformer2DModel",), is_video=False,
    sharding_plan=FLUX_LIKE_PLAN, attention_modules=FLUX_ATTENTION, joint_text="prefix", cfg_strategy="two_call",
    note="Flux's layout, text first; the edit pipeline's reference tokens split with the image")
