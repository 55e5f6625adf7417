"""CogVideoX (text-to-video, 2b and 5b) for sequence parallelism.

Joint attention with the text first: ``CogVideoXAttnProcessor2_0`` concatenates ``[text; video]``
and applies RoPE (5b) to the video part only. No text mask (prompts are padded with T5 padding
embeddings that are attended to, as in one process). The 2b model has 30 heads, which do not divide
4 ranks: Ulysses then splits them unevenly, K/V-gather has no constraint.

Sharding plan (explicit; Diffusers 0.42 ships no ``_cp_plan`` for this model): the patch embedding
adds its positional embedding over ``[text; video]`` before the model separates the two, so the
video tokens are split at the input of ``transformer_blocks.0`` (``hidden_states`` ``[B, S, C]``,
dim 1); the RoPE tables the pipeline passes as ``image_rotary_emb`` (``([S, D], [S, D])``, or
``None`` for 2b) are split at the model input (dim 0); ``proj_out`` is gathered.
"""

from __future__ import annotations

from .spec import GATHER_TOKENS, SPLIT_ROWS, SPLIT_TOKENS, FamilySpec

COGVIDEOX = FamilySpec(
    name="cogvideox", model_classes=("CogVideoXTransformer3DModel",), is_video=True,
    sharding_plan={"": {"image_rotary_emb": [SPLIT_ROWS, SPLIT_ROWS]}, "transformer_blocks.0": {"hidden_states": SPLIT_TOKENS},
                   "proj_out": GATHER_TOKENS},
    attention_modules=("transformer_blocks.*.attn1",), joint_text="prefix", cfg_strategy="batch",
    note="text first in self-attention; 2b's 30 heads split unevenly by Ulysses at 4 ranks")
