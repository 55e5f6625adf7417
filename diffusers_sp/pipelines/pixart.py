"""PixArt-alpha and PixArt-Sigma (text-to-image, and Sigma with PAG) for sequence parallelism.

``PixArtTransformer2DModel`` runs Diffusers' ``BasicTransformerBlock``: a self-attention over the image
tokens alone (``attn1``), a cross-attention to the T5 text (``attn2``, with the text's key padding mask,
left whole on every rank), and a per-token MLP; positions are sin-cos embeddings added by the patch
embedding. So the image sequence splits after ``pos_embed`` and only ``attn1`` is wrapped.

Sharding plan (Diffusers 0.42 ships no ``_cp_plan`` for it): split the output of ``pos_embed`` (patch
embedding plus positions, ``[B, S, C]``, dim 1); gather ``proj_out`` (the model unpatchifies after it).
The timestep and resolution embeddings stay whole. A mask over the image tokens (``attention_mask``,
which no pipeline passes) is refused.

``PixArtSigmaPAGPipeline`` puts Diffusers' ``PAGIdentitySelfAttnProcessor2_0`` /
``PAGCFGIdentitySelfAttnProcessor2_0`` on the PAG layers' ``attn1`` for each call; they are wrapped at the
next forward. Their perturbed pass replaces the attention by its value projection (per token, exact
on each rank); the other passes attend through the usual exchange.
"""

from __future__ import annotations

from .spec import GATHER_TOKENS, SPLIT_TOKENS_OUT, FamilySpec

_PIXART_PLAN = {
    "pos_embed": {0: SPLIT_TOKENS_OUT},
    "proj_out": GATHER_TOKENS,
}

PIXART = FamilySpec(
    name="pixart", model_classes=("PixArtTransformer2DModel",), is_video=False,
    sharding_plan=_PIXART_PLAN, attention_modules=("transformer_blocks.*.attn1",), cfg_strategy="batch",
    unsupported_inputs={"attention_mask": "a mask over the image tokens"},
    swapped_processors=("PAGIdentitySelfAttnProcessor2_0", "PAGCFGIdentitySelfAttnProcessor2_0"),
    note="text in cross-attention only; PAG processors wrapped per call")
