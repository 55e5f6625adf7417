"""DiT (class-conditional image generation, Peebles & Xie 2023) for sequence parallelism.

``DiTTransformer2DModel`` runs Diffusers' ``BasicTransformerBlock`` with the class label and timestep as
adaptive-norm conditions: a self-attention over the image tokens (``attn1``; there is no text) and a
per-token MLP; positions are sin-cos embeddings added by the patch embedding.

Sharding plan (Diffusers 0.42 ships no ``_cp_plan`` for it): split the output of ``pos_embed`` (``[B, S,
C]``, dim 1); gather ``proj_out_2`` (the model unpatchifies after it; ``proj_out_1`` maps the ``[B, C]``
condition, not tokens). The class-conditional pipeline folds its guidance into a batch of two (the
null class).
"""

from __future__ import annotations

from .spec import GATHER_TOKENS, SPLIT_TOKENS_OUT, FamilySpec

DIT = FamilySpec(
    name="dit", model_classes=("DiTTransformer2DModel",), is_video=False,
    sharding_plan={"pos_embed": {0: SPLIT_TOKENS_OUT},
                   "proj_out_2": GATHER_TOKENS},
    attention_modules=("transformer_blocks.*.attn1",), cfg_strategy="batch",
    note="class-conditional, no text")
