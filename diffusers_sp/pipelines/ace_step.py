"""ACE-Step 1.5 (text-to-music, ``AceStepPipeline``) for sequence parallelism.

``AceStepTransformer1DModel`` (Diffusers 0.42, ``ace_step_transformer.py``) patchifies the audio latents
(joined with the context latents along channels) into ``[B, S, C]`` with a strided convolution, builds
RoPE tables ``[S, D]`` and a banded mask ``[1, 1, S, S]`` (``|i - j| <= sliding_window``) over the full
sequence, and runs blocks that alternate sliding-window and full self-attention, each followed by
cross-attention to the encoded condition (text, lyrics, timbre: whole on every rank, local). The banded
mask is made before the split, so the processors apply it as a full-sequence mask, rows and columns
(``processors/base.py``): exact in both dense modes. Self-attention is grouped-query (fewer K/V heads):
the processors repeat the K/V heads to the query heads, as SDPA does.

Sharding plan (no Diffusers ``_cp_plan``): split ``hidden_states`` of ``layers.0`` (``[B, S, C]``, dim 1) and
the RoPE tables (``position_embeddings``, ``(cos, sin)``, dim 0) at every layer; gather ``norm_out`` (before
the model's per-token modulation, the de-patchifying transposed convolution and its slice to the input
length).
"""

from __future__ import annotations

from .spec import GATHER_TOKENS, SPLIT_ROWS, SPLIT_TOKENS, FamilySpec

ACE_STEP = FamilySpec(
    name="ace_step", model_classes=("AceStepTransformer1DModel",), is_video=False,
    patch_size=lambda model: (int(model.config.patch_size),),
    sharding_plan={"layers.0": {"hidden_states": SPLIT_TOKENS},
                   "layers.*": {"position_embeddings": (SPLIT_ROWS, SPLIT_ROWS)}, "norm_out": GATHER_TOKENS},
    attention_modules=("layers.*.self_attn",), attention_call="dispatch",
    # The pipeline folds CFG into a batch of two.
    cfg_strategy="batch", note="1-D audio; sliding-window layers' banded mask applied whole; grouped-query K/V repeated")
