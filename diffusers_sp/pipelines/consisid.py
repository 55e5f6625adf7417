"""ConsisID (identity-preserving image-to-video on CogVideoX) for sequence parallelism.

``ConsisIDTransformer3DModel`` is CogVideoX's transformer (``[text; video]`` joint attention, text first,
no text mask; the image latents joined along the channels) with a face branch: a local facial extractor
turns the face embedding and the face ViT's hidden states into 32 face tokens, and every
``cross_attn_interval`` blocks a perceiver cross-attention adds to each video token what it reads from
those face tokens (queries from the video tokens, keys and values from the face tokens only). That
cross-attention is per video token, so it runs on each rank's shard as it is; the face tokens are
computed whole on every rank. Source: Yuan et al., "Identity-Preserving Text-to-Video Generation by
Frequency Decomposition" (ConsisID, 2024); Diffusers' ``consisid_transformer_3d.py``.

Sharding plan, attention modules and CFG: CogVideoX's (:mod:`diffusers_sp.pipelines.cogvideox`): the
video tokens are split at the input of ``transformer_blocks.0`` after the patch embedding, the RoPE
tables at the model input, and ``proj_out`` is gathered.
"""

from __future__ import annotations

import dataclasses

from .cogvideox import COGVIDEOX

CONSISID = dataclasses.replace(
    COGVIDEOX, name="consisid", model_classes=("ConsisIDTransformer3DModel",),
    note="CogVideoX with a face branch; its perceiver cross-attention reads the whole face tokens per video token")
