"""Stable Audio Open (text-to-audio) for sequence parallelism: a 1-D DiT over audio latents.

``StableAudioDiTModel`` embeds the audio latents per position (``preprocess_conv`` and ``proj_in`` have a
reach of one position), prepends one global token (the timing and timestep conditions), and runs blocks
of self-attention over ``[global; audio]`` (RoPE over those positions, from the pipeline; grouped K/V
heads repeated before the attention call), cross-attention to the T5 text (left whole on every rank) and
a per-token MLP. So the global token is a one-token *prefix* of every self-attention sequence.

Sharding plan (Diffusers 0.42 ships no ``_cp_plan`` for it): split ``hidden_states`` (``[B, C, L]``, dim
2) at the model input, and the audio rows of the RoPE tables (``rotary_embedding``, ``(cos, sin)``, each
``[1 + L, D]``; the global token's row stays whole); gather the audio part of ``proj_out``'s output
(``[B, 1 + L, C]``; the model drops the global token after it). A mask over the audio tokens
(``attention_mask``, which the pipeline does not pass) is refused.
"""

from __future__ import annotations

from diffusers.models._modeling_parallel import ContextParallelInput

from ..plan_entries import JointSequence
from .spec import GATHER_TOKENS, SPLIT_ROWS, FamilySpec

_ROPE = JointSequence(SPLIT_ROWS, text="prefix")

STABLE_AUDIO = FamilySpec(
    name="stable_audio", model_classes=("StableAudioDiTModel",), is_video=False,
    sharding_plan={"": {"hidden_states": ContextParallelInput(split_dim=2, expected_dims=3, split_output=False),
                        "rotary_embedding": (_ROPE, _ROPE)},
                   "proj_out": JointSequence(GATHER_TOKENS, text="prefix")},
    attention_modules=("transformer_blocks.*.attn1",), joint_text="prefix", cfg_strategy="batch",
    unsupported_inputs={"attention_mask": "a mask over the audio tokens"},
    note="1-D audio latents after one global token; text in cross-attention only")
