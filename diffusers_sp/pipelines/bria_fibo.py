"""Bria FIBO (text-to-image and editing) for sequence parallelism.

``BriaFiboTransformer2DModel`` is Flux's architecture (dual-stream blocks joining ``[text; image]`` in the
processor, single-stream blocks over the concatenation; RoPE over ``cat(txt_ids, img_ids)``) fed by a
SmolLM3 text encoder: every block mixes one of the encoder's layers into the text tokens (whole on every
rank). The text is a *prefix* of every self-attention sequence. When a prompt is padded, the pipelines
pass a key padding mask ``[B, 1, 1, T + S]`` over the full sequence in ``joint_attention_kwargs``; it is
made before any split, so the processors apply it whole (the rows of their queries).

Sharding plan (Diffusers 0.42 ships no ``_cp_plan`` for it): split ``hidden_states`` (``[B, S, C]``, dim 1)
and ``img_ids`` (``[S, 3]``, or ``[B, S, 3]`` along dim 1) at the model input, gather ``proj_out``. The edit
pipeline's reference image tokens, when it joins them, split with the latent tokens.
"""

from __future__ import annotations

from .flux import FLUX_ATTENTION, FLUX_LIKE_PLAN
from .spec import FamilySpec

BRIA_FIBO = FamilySpec(
    name="bria_fibo", model_classes=("BriaFiboTransformer2DModel",), is_video=False,
    sharding_plan=FLUX_LIKE_PLAN, attention_modules=FLUX_ATTENTION, joint_text="prefix", text_mask=True,
    cfg_strategy="batch", note="Flux's layout, text first; its full-sequence key padding mask applied whole")
