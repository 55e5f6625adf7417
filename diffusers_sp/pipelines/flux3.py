"""FLUX.3 (its modular text-to-image pipelines) for sequence parallelism.

``Flux3Transformer2DModel`` (Diffusers 0.42, ``transformer_flux3.py``) first runs per-mode blocks, each
attending within one kind of token: the text alone (``txt_mode_blocks``), the image alone
(``mode_blocks["image"]``) and, for image-to-image, the reference image alone; then single-stream blocks
over ``[text; image]`` (text first: a *prefix*, whole on every rank). The image tokens are split at the
model input with their position ids, so the image-mode blocks attend over the split image (the dense mode,
no text), the text-mode blocks run whole on every rank (not wrapped), and the joint blocks take the text
as a prefix. Modulations are per token, made from the local lengths.

Reference images (``image_cond_hidden_states``) are refused in one line at the call: their tokens form a
second sequence, of another length, joined after the image in the single-stream blocks (``[text; image;
reference]``), a layout with whole tokens on both sides of the split ones that the processors do not take.

Sharding plan (no Diffusers ``_cp_plan``): split ``hidden_states`` (``[B, S, C]``, dim 1) and ``img_ids``
(``[S, 4]``, dim 0) at the model input; gather ``proj_out``. Attention in dispatch mode.
"""

from __future__ import annotations

from .spec import GATHER_TOKENS, SPLIT_ROWS, SPLIT_TOKENS, FamilySpec

FLUX3 = FamilySpec(
    name="flux3", model_classes=("Flux3Transformer2DModel",), is_video=False, patch_size=lambda model: (1, 1),
    sharding_plan={"": {"hidden_states": SPLIT_TOKENS, "img_ids": SPLIT_ROWS}, "proj_out": GATHER_TOKENS},
    attention_modules=("mode_blocks.image.*.attn", "single_transformer_blocks.*.attn"), joint_text="prefix",
    attention_call="dispatch",
    unsupported_inputs={"image_cond_hidden_states": "reference-image tokens (a second sequence joined after the image)"},
    note="modular pipelines only; text first in the joint blocks, the text-mode blocks whole; reference images refused")
