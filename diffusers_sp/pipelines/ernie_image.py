"""ERNIE-Image (text-to-image, and its modular pipeline) for sequence parallelism.

``ErnieImageTransformer2DModel`` (Diffusers 0.42, ``transformer_ernie_image.py``) is sequence-major:
it patchifies the latents (``x_embedder``, ``[B, N, C]``), turns them to ``[N, B, C]`` and appends the
projected text, ``[image; text]``: the text is a *suffix* of every self-attention sequence. Inside its
forward it builds the 3-axis position ids of both parts (``[B, N + T, 3]``: image rows first) for
``pos_embed``, and the key padding mask ``[B, 1, 1, N + T]`` from the global image count and
``text_lens``; the mask therefore covers the full joint sequence, and the processors take it as one
made before the split (``processors/base.py``). The modulation is the same for every token (expanded
to the local length). The final layer keeps the first ``N`` rows of ``[N + T, B, C]``, ``N`` again the
global image count, so the output is gathered before that slice.

Sharding plan (no Diffusers ``_cp_plan``): split the output of ``x_embedder`` (``[B, N, C]``, dim 1),
the image rows of ``pos_embed``'s ``ids`` (the text rows stay whole:
:class:`~diffusers_sp.plan_entries.JointSequence`, text last); gather the image rows of
``final_linear``'s ``[N_r + T, B, C]`` output (dim 0, text last, kept in place). Attention in dispatch
mode: ``ErnieImageSingleStreamAttnProcessor`` passes its ``_parallel_config`` to ``dispatch_attention_fn``.
"""

from __future__ import annotations

from diffusers.models._modeling_parallel import ContextParallelOutput

from ..plan_entries import JointSequence
from .spec import SPLIT_TOKENS, SPLIT_TOKENS_OUT, FamilySpec

ERNIE_IMAGE = FamilySpec(
    name="ernie_image", model_classes=("ErnieImageTransformer2DModel",), is_video=False,
    sharding_plan={"x_embedder": {0: SPLIT_TOKENS_OUT}, "pos_embed": {"ids": JointSequence(SPLIT_TOKENS, text="suffix")},
                   "final_linear": JointSequence(ContextParallelOutput(gather_dim=0, expected_dims=3), text="suffix")},
    attention_modules=("layers.*.self_attention",), joint_text="suffix", text_mask=True, attention_call="dispatch",
    # The pipeline folds CFG into a batch of two (the unconditional prompts first).
    cfg_strategy="batch", note="sequence-major [image; text], text last; the model's own full-sequence text mask")
