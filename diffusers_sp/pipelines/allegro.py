"""Allegro (text-to-video) for sequence parallelism.

``AllegroTransformer3DModel`` runs PixArt-style blocks over the video tokens: a self-attention over the
video alone (``attn1``, 3-D RoPE), a cross-attention to the T5 text (``attn2``, with its key padding mask,
left whole on every rank) and a per-token MLP. The pipeline passes the RoPE as ``image_rotary_emb =
((t, h, w) frequency tables, (t, h, w) positions)``: the tables are indexed by each token's position
(``[1, S]`` each), so only the positions split.

Sharding plan (Diffusers 0.42 ships no ``_cp_plan`` for it): split the RoPE positions (dim 1) at the model
input and the video tokens where the first block receives them (``transformer_blocks.0``'s
``hidden_states``, ``[B, S, C]``, dim 1); gather ``proj_out`` (the model unpatchifies after it). A mask
over the video tokens (``attention_mask``, which the pipeline does not pass) is refused.
"""

from __future__ import annotations

from diffusers.models._modeling_parallel import ContextParallelInput

from .spec import GATHER_TOKENS, SPLIT_TOKENS, FamilySpec

_POSITIONS = ContextParallelInput(split_dim=1, expected_dims=2, split_output=False)

ALLEGRO = FamilySpec(
    name="allegro", model_classes=("AllegroTransformer3DModel",), is_video=True,
    sharding_plan={"": {"image_rotary_emb": (None, (_POSITIONS, _POSITIONS, _POSITIONS))},
                   "transformer_blocks.0": {"hidden_states": SPLIT_TOKENS}, "proj_out": GATHER_TOKENS},
    attention_modules=("transformer_blocks.*.attn1",), cfg_strategy="batch",
    unsupported_inputs={"attention_mask": "a mask over the video tokens"},
    note="text in cross-attention only; RoPE positions split with the tokens")
