"""aMUSEd (masked image token generation, Diffusers' deprecated pipelines) for sequence parallelism.

``UVit2DModel`` is a U-ViT over VQ-GAN token ids: a convolutional block on the token grid
(``down_block``), then transformer layers over the grid's ``H * W`` tokens (Diffusers'
``BasicTransformerBlock``: self-attention over the image tokens, ``attn1``; cross-attention to the CLIP
text, left whole; a per-token MLP), then a convolutional ``up_block`` and the codebook logits. Only the
transformer layers split: the convolutional blocks run whole on every rank, as one process runs them.

Sharding plan (its Diffusers class has no ``_cp_plan``): split the tokens where the first transformer layer
receives them (``transformer_layers.0``'s ``hidden_states``, ``[B, S, C]``, dim 1) and gather the output
of ``project_from_hidden`` (the last per-token projection before the grid is rebuilt).
"""

from __future__ import annotations

from .spec import GATHER_TOKENS, SPLIT_TOKENS, FamilySpec

AMUSED = FamilySpec(
    name="amused", model_classes=("UVit2DModel",), is_video=False,
    sharding_plan={"transformer_layers.0": {"hidden_states": SPLIT_TOKENS}, "project_from_hidden": GATHER_TOKENS},
    attention_modules=("transformer_layers.*.attn1",), cfg_strategy="batch",
    note="the transformer layers split; the convolutional blocks around them run whole")
