"""Mochi 1 (text-to-video) for sequence parallelism.

Joint attention with the text after the video tokens and a text mask. ``MochiAttnProcessor2_0``
handles the mask itself: per batch element it keeps only the valid text tokens and calls SDPA on
``[video; valid text]`` with batch 1 and no mask, so each call carries a different number of text
tokens. The processors read that number from each call (query length minus this rank's video
tokens), so ragged prompts are exact under both modes.

Sharding plan (explicit; Diffusers 0.42 ships no ``_cp_plan`` for this model): the patch embedding
runs per frame, so the video tokens are split at the input of ``transformer_blocks.0``
(``hidden_states`` ``[B, S, C]``, dim 1), the RoPE tables ``rope`` returns (``[S, H, D/2]`` cos and
sin, dim 0) are split, and ``proj_out`` is gathered.
"""

from __future__ import annotations

from diffusers.models._modeling_parallel import ContextParallelInput

from .spec import GATHER_TOKENS, SPLIT_TOKENS, FamilySpec

_ROPE = ContextParallelInput(split_dim=0, expected_dims=3, split_output=True)

MOCHI = FamilySpec(
    name="mochi", model_classes=("MochiTransformer3DModel",), is_video=True,
    sharding_plan={"transformer_blocks.0": {"hidden_states": SPLIT_TOKENS}, "rope": {0: _ROPE, 1: _ROPE},
                   "proj_out": GATHER_TOKENS},
    attention_modules=("transformer_blocks.*.attn1",), joint_text="suffix", text_mask=True, cfg_strategy="batch",
    note="text after the video, its valid tokens per sample")
