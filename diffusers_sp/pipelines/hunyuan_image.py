"""HunyuanImage 2.1 (text-to-image, and its refiner) for sequence parallelism.

Joint attention with the text *after* the image tokens (``[image; text]``) in the dual- and the
single-stream blocks, and a text key padding mask: the model pads ``encoder_attention_mask`` with
True over ``hidden_states.shape[1]`` image tokens in front (``[B, 1, 1, S + T]``); since the image
tokens are split at the patch embedding, that is this rank's ``S_r``, which is what the processors
expect (its image part is gathered with the keys). The text (the MLLM tokens, and the glyph (ByT5)
tokens the model reorders per sample in front of them) is refined and joined on every rank and
stays whole; the token refiner's own attention (``context_embedder``) is left alone.

``HunyuanImageAttnProcessor`` passes its ``_parallel_config`` to ``dispatch_attention_fn`` for its
one attention call, the joint self-attention: the family runs in dispatch mode.

Sharding plan (explicit; Diffusers 0.42 ships no ``_cp_plan`` for this model): split the output of
``x_embedder`` (``[B, S, C]``, dim 1; 2-D patches, or 3-D for the refiner's ``[B, C, 1, H, W]``
latents) and the RoPE tables ``rope`` returns (``(cos, sin)``, ``[S, D]``, dim 0); gather
``proj_out``.
"""

from __future__ import annotations

from .spec import GATHER_TOKENS, SPLIT_ROWS_OUT, SPLIT_TOKENS_OUT, FamilySpec

HUNYUAN_IMAGE = FamilySpec(
    name="hunyuan_image", model_classes=("HunyuanImageTransformer2DModel",), is_video=False,
    sharding_plan={"x_embedder": {0: SPLIT_TOKENS_OUT},
                   "rope": {0: SPLIT_ROWS_OUT, 1: SPLIT_ROWS_OUT}, "proj_out": GATHER_TOKENS},
    attention_modules=("transformer_blocks.*.attn", "single_transformer_blocks.*.attn"),
    joint_text="suffix", text_mask=True, attention_call="dispatch",
    # With a guider, the pipelines make the conditional and the unconditional prediction as two calls
    # named through cache_context; the distilled checkpoint and the refiner make one call per step, so
    # cfg_parallel="auto" leaves CFG parallelism off.
    cfg_strategy="two_call", cfg_by_default=False, note="text after the image; the token refiner whole on every rank")
