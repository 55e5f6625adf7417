"""Stable Audio 3 (text-to-audio, audio-to-audio, inpainting) for sequence parallelism: a 1-D DiT.

``StableAudio3DiTModel`` patchifies the audio latents into tokens (``proj_in``), prepends learned memory
tokens and runs blocks of (differential) self-attention over ``[memory; audio]`` with partial RoPE,
cross-attention to the text and duration context (left whole on every rank), an optional per-position
inpainting condition added to the audio tokens, and a per-token MLP. The memory tokens are a *prefix*
of every self-attention sequence. The model builds its RoPE table for the length it sees
(``rotary_pos_emb(seq_len)``) and the processor takes the table's last rows: so the table is built for
the whole ``[memory; audio]`` length (:class:`~diffusers_sp.plan_entries.WholeLength`) and split like
the tokens, the memory rows whole (:class:`~diffusers_sp.plan_entries.JointSequence`).

Sharding plan (Diffusers 0.42 ships no ``_cp_plan`` for it): split the output of ``proj_in`` (``[B, T, C]``,
dim 1) and the inpainting condition ``local_add_cond`` (``[B, C, T]``, dim 2; the model allows it only
unpatched); gather ``proj_out`` (after the memory tokens are dropped; the model unpatchifies after it).
"""

from __future__ import annotations

from diffusers.models._modeling_parallel import ContextParallelInput

from ..plan_entries import JointSequence, WholeLength
from .spec import GATHER_TOKENS, SPLIT_ROWS_OUT, SPLIT_TOKENS_OUT, FamilySpec

_ROPE = JointSequence(SPLIT_ROWS_OUT, text="prefix")

STABLE_AUDIO3 = FamilySpec(
    name="stable_audio3", model_classes=("StableAudio3DiTModel",), is_video=False,
    sharding_plan={"": {"local_add_cond": ContextParallelInput(split_dim=2, expected_dims=3, split_output=False)},
                   "proj_in": {0: SPLIT_TOKENS_OUT}, "rotary_pos_emb": {"seq_len": WholeLength(), 0: _ROPE},
                   "proj_out": GATHER_TOKENS},
    attention_modules=("transformer_blocks.*.self_attn",), joint_text="prefix", cfg_strategy="batch",
    note="1-D audio tokens after the memory tokens; text in cross-attention only")
