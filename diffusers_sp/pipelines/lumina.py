"""Lumina-Next (text-to-image, ``LuminaPipeline``) for sequence parallelism.

``LuminaNextDiT2DModel`` (Diffusers 0.42, ``lumina_nextdit2d.py``): the text is in cross-attention only
(``attn2``, local on every rank: its queries are this rank's tokens, its keys the whole caption). The
patch embedding returns the tokens ``[B, S, C]``, an all-ones token mask ``[B, S]`` (the self-attention
mask), the image sizes and the RoPE table ``[1, S, D/2]`` (complex), all split with the tokens.

Proportional attention: with the pipeline's ``proportional_attn=True`` (its default) the self-attention
processor (``LuminaAttnProcessor2_0``) scales the softmax by ``sqrt(log_base(S))`` with ``S`` the number of
query tokens it sees and ``base`` the pipeline's ``base_sequence_length``; on a rank that would be the
shard's length. :func:`lumina_attention_scale` gives the processors the scale over the full sequence
(:attr:`~diffusers_sp.pipelines.FamilySpec.attention_scale`), which replaces the scale of the call.

Sharding plan (no Diffusers ``_cp_plan``): split outputs 0 (tokens, dim 1), 1 (mask, dim 1) and 3 (RoPE,
dim 1) of ``patch_embedder``; gather ``norm_out`` (``[B, S, p * p * C]``), before the model keeps its first
``S`` rows and unpatchifies.
"""

from __future__ import annotations

import math

from diffusers.models._modeling_parallel import ContextParallelInput

from .spec import GATHER_TOKENS, SPLIT_TOKENS_OUT, FamilySpec

_MASK_OUT = ContextParallelInput(split_dim=1, expected_dims=2, split_output=True)
_ROPE_OUT = ContextParallelInput(split_dim=1, expected_dims=3, split_output=True)


def lumina_attention_scale(attn, arguments: dict, seq_len: int) -> float | None:
    """The softmax scale ``LuminaAttnProcessor2_0`` computes over ``seq_len`` query tokens: with keys rotated
    (self-attention) and a ``base_sequence_length``, ``sqrt(log(seq_len, base)) * attn.scale`` (proportional
    attention, Lumina-Next: Zhuo et al. 2024); with keys rotated and no base, ``attn.scale``; else ``None``
    (the call's own)."""
    if arguments.get("key_rotary_emb") is None:
        return None
    base = arguments.get("base_sequence_length")
    return attn.scale if base is None else math.sqrt(math.log(seq_len, base)) * attn.scale


LUMINA = FamilySpec(
    name="lumina", model_classes=("LuminaNextDiT2DModel",), is_video=False,
    sharding_plan={"patch_embedder": {0: SPLIT_TOKENS_OUT, 1: _MASK_OUT, 3: _ROPE_OUT}, "norm_out": GATHER_TOKENS},
    attention_modules=("layers.*.attn1",), attention_scale=lumina_attention_scale,
    # The pipeline folds CFG into a batch of two.
    cfg_strategy="batch", note="text in cross-attention only; proportional attention scaled by the full length")
