"""Krea 2 (text-to-image, and its modular pipelines) for sequence parallelism.

``Krea2Transformer2DModel`` fuses the text encoder's layers into text tokens (``text_fusion``, over the
text alone), then joins ``[text; image]`` into one sequence for single-stream blocks: the text is a
*prefix* of every self-attention sequence. RoPE comes from ``position_ids`` ``[T + S, 3]`` (text rows
first), and with a text mask the model builds the key padding mask ``[B, 1, 1, T + S]`` from the image
length it sees, so on each rank it covers the rank's image tokens and the processors gather it.
Grouped-query attention repeats the K/V heads before the attention call, so every head is a query head
to the strategies.

Sharding plan (Diffusers 0.42 ships no ``_cp_plan`` for it): split ``hidden_states`` (``[B, S, C]``, dim 1)
and the image rows of ``position_ids`` (its text rows stay whole:
:class:`~diffusers_sp.plan_entries.JointSequence`) at the model input; gather ``final_layer``. Only the
single-stream blocks' attention is wrapped (``text_fusion``'s is over the text alone).
"""

from __future__ import annotations

from ..plan_entries import JointSequence
from .spec import GATHER_TOKENS, SPLIT_ROWS, SPLIT_TOKENS, FamilySpec

_POSITION_IDS = JointSequence(SPLIT_ROWS, text="prefix")

KREA2 = FamilySpec(
    name="krea2", model_classes=("Krea2Transformer2DModel",), is_video=False,
    sharding_plan={"": {"hidden_states": SPLIT_TOKENS, "position_ids": _POSITION_IDS}, "final_layer": GATHER_TOKENS},
    attention_modules=("transformer_blocks.*.attn",), joint_text="prefix", text_mask=True,
    # Its pipeline (Diffusers 0.42) makes the two CFG calls outside cache_context("cond"/"uncond"), by which
    # CFG parallelism pairs them.
    cfg_strategy=None, note="one [text; image] sequence, text first, with its key padding mask")
