"""Ideogram 4 (text-to-image, and its modular pipeline) for sequence parallelism.

``Ideogram4Transformer2DModel`` (Diffusers 0.42, ``transformer_ideogram4.py``) runs single-stream layers over
one packed sequence ``[B, L, C]``: text and image tokens alike, each tagged by ``indicator``, placed by 3-axis
``position_ids`` and grouped by ``segment_ids`` (tokens attend within their segment: a block-diagonal mask
``[B, 1, L, L]`` the model builds before its layers). Every operation but attention is per token (the
modulation is per sample, or per token for a per-token timestep), so the packed sequence is split as a
whole, text included. The mask covers the full sequence, queries and keys, and the processors apply it
as one made before the split, rows and columns (``processors/base.py``). The pipeline calls two such
transformers per step: ``transformer`` over ``[text; image]`` and ``unconditional_transformer`` over the
image alone.

Sharding plan (no Diffusers ``_cp_plan``): split ``hidden_states`` of ``layers.0`` (``[B, L, C]``, dim 1) and at
every layer the RoPE tables (``(cos, sin)``, ``[B, L, D]``, dim 1) and the modulation (``[B, 1, C]`` passes,
``[B, L, C]`` splits); gather ``final_layer``.
"""

from __future__ import annotations

from diffusers.models._modeling_parallel import ContextParallelInput

from ..plan_entries import SplitUnlessBroadcast
from .spec import GATHER_TOKENS, SPLIT_TOKENS, FamilySpec

_PER_TOKEN = SplitUnlessBroadcast(SPLIT_TOKENS)
_ROPE = ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)

IDEOGRAM4 = FamilySpec(
    name="ideogram4", model_classes=("Ideogram4Transformer2DModel",), is_video=False, patch_size=lambda model: (1, 1),
    sharding_plan={"layers.0": {"hidden_states": SPLIT_TOKENS},
                   "layers.*": {"image_rotary_emb": (_ROPE, _ROPE), "adaln_input": _PER_TOKEN},
                   "final_layer": GATHER_TOKENS},
    attention_modules=("layers.*.attention",), text_mask=True, attention_call="dispatch",
    # The conditional and the unconditional prediction come from two different transformers.
    cfg_strategy=None, note="one packed [text; image] sequence split as a whole; its segment mask applied whole")
