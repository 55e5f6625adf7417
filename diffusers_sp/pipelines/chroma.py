"""Chroma (text-to-image, image-to-image, inpainting) for sequence parallelism.

``ChromaTransformer2DModel`` is Flux's architecture (Diffusers 0.42 reuses ``FluxAttention`` and
``FluxAttnProcessor``) with pruned modulation and a text mask: the text is a *prefix* of every
self-attention sequence (dual-stream blocks join ``[text; image]`` in the processor, single-stream
blocks receive the concatenation). ``FluxAttnProcessor`` hands ``dispatch_attention_fn`` its
``_parallel_config`` for exactly that joint call, so the family runs in dispatch mode.

The mask. The pipeline passes ``attention_mask`` ``[B, T + S]``: 0/1 floats over the text tokens
(T5's padding, all but the first padding token masked) followed by ones over every image token.
Each block turns it into the outer product ``[B, 1, T + S, T + S]`` and hands that to the attention
as it is, so SDPA *adds* it to the scores (0 or 1, not -inf). The mask is made over the full
sequence before any split, so it is left whole (not in the plan) and the processors apply it exactly
as one process does: K/V-gather with the rows of its queries, Ulysses whole
(:mod:`diffusers_sp.processors.base`, full-sequence masks).

Sharding plan (Diffusers ships no ``_cp_plan`` for Chroma): split ``hidden_states`` (``[B, S, C]``,
dim 1) and ``img_ids`` (``[S, 3]``, or the deprecated ``[B, S, 3]`` along dim 1) at the model input,
gather ``proj_out``; ControlNet residuals are split like the image tokens, as for Flux. The text,
its ids and the mask stay whole.
"""

from __future__ import annotations

from .spec import GATHER_TOKENS, SPLIT_TOKENS, FamilySpec
from .flux import _IMG_IDS, FLUX_ATTENTION, FLUX_CONTROLNET

CHROMA = FamilySpec(
    name="chroma", model_classes=("ChromaTransformer2DModel",), is_video=False,
    sharding_plan={"": {"hidden_states": SPLIT_TOKENS, "img_ids": _IMG_IDS, **FLUX_CONTROLNET}, "proj_out": GATHER_TOKENS},
    attention_modules=FLUX_ATTENTION, joint_text="prefix", text_mask=True, attention_call="dispatch",
    # Chroma's pipelines (Diffusers 0.42) make their two CFG calls outside the transformer's
    # cache_context("cond"/"uncond"), by which CFG parallelism pairs them: every call would run on both
    # CFG groups, so cfg_parallel="auto" would halve the sequence-parallel degree for nothing.
    cfg_strategy=None, note="its [B, 1, L, L] additive 0/1 mask is applied whole, as one process does")
