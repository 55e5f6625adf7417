"""CogView4 (text-to-image, and its Control variant) for sequence parallelism.

Joint attention with the text first: ``CogView4AttnProcessor`` concatenates ``[text; image]`` and
applies RoPE to the image part only. CogView4Pipeline pads the prompts of a batch to one length
(the tokenizer's padding, then pad tokens in front up to a multiple of 16) and passes no mask: the
padding tokens are attended, as in one process.
The transformer also takes ``attention_mask`` ``[B, T]`` (1 = text token, 0 = padding), from which
the processor builds, over its local ``T + S_r`` tokens, ``(m mᵀ > 0).to(dtype)`` with
``m = [text mask; ones]``: an additive 1.0 on valid query-key pairs and 0.0 elsewhere (not a
masking one: the padding keys stay visible, one logit lower). That mask varies with the query, but
as a padding mask over queries and keys it runs exactly
(:func:`~diffusers_sp.processors.base.symmetric_padding_vector`), at the cost of a second
attention call per block when the batch has padding.

Sharding plan (explicit; Diffusers 0.42 ships no ``_cp_plan`` for this model): split the image
tokens at the output of ``patch_embed`` (output 0, ``[B, S, C]``, dim 1) and the RoPE tables of
``rope`` (``(cos, sin)``, ``[S, D]``, dim 0), or of ``image_rotary_emb`` when the caller passes it
(then ``rope`` is not called); gather ``proj_out``. CogView4ControlPipeline concatenates the control
latents with the latents along the channels before the patch embedding, so it needs nothing more.
"""

from __future__ import annotations

from .spec import GATHER_TOKENS, SPLIT_ROWS, SPLIT_ROWS_OUT, SPLIT_TOKENS_OUT, FamilySpec

COGVIEW4 = FamilySpec(
    name="cogview4", model_classes=("CogView4Transformer2DModel",), is_video=False,
    sharding_plan={"": {"image_rotary_emb": [SPLIT_ROWS] * 2},
                   "patch_embed": {0: SPLIT_TOKENS_OUT},
                   "rope": {0: SPLIT_ROWS_OUT, 1: SPLIT_ROWS_OUT}, "proj_out": GATHER_TOKENS},
    attention_modules=("transformer_blocks.*.attn1",), joint_text="prefix", text_mask=True, cfg_strategy="two_call",
    note="text first; its padding mask over queries and keys applied exactly")
