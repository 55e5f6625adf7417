"""AnyFlow (text-to-video flow maps; Wan-style DiT) for sequence parallelism.

``AnyFlowTransformer3DModel`` is Wan's architecture with a flow-map timestep pair: video self-attention with
3-D RoPE (``attn1``), text cross-attention (left whole on every rank), per-token AdaLN modulation. It makes
the per-token modulation itself, one timestep per frame repeated over the frame's tokens
(``condition_embedder``'s first two outputs, ``[B, S, C]`` and ``[B, S, 6 * C]``), and its RoPE tables as a
dict ``{"query": [1, 1, S, D], "key": [1, 1, S, D]}`` (``rope``'s output, passed to every block).

Sharding plan (Diffusers 0.42 ships no ``_cp_plan`` for it): split the modulation outputs of
``condition_embedder`` (dim 1), the tokens where the first block receives them (``blocks.0``'s
``hidden_states``, ``[B, S, C]``, dim 1), and each block's RoPE dict (dim 2); gather ``proj_out`` (the model
unpatchifies after it).
"""

from __future__ import annotations

from diffusers.models._modeling_parallel import ContextParallelInput

from .spec import GATHER_TOKENS, SPLIT_TOKENS, SPLIT_TOKENS_OUT, FamilySpec

_TABLE = ContextParallelInput(split_dim=2, expected_dims=4, split_output=False)

ANYFLOW = FamilySpec(
    name="anyflow", model_classes=("AnyFlowTransformer3DModel",), is_video=True,
    sharding_plan={"condition_embedder": {0: SPLIT_TOKENS_OUT,
                                          1: SPLIT_TOKENS_OUT},
                   "blocks.0": {"hidden_states": SPLIT_TOKENS},
                   "blocks.*": {"rotary_emb": {"query": _TABLE, "key": _TABLE}}, "proj_out": GATHER_TOKENS},
    attention_modules=("blocks.*.attn1",), cfg_strategy="batch",
    note="per-token modulation and the RoPE dict split with the tokens; text in cross-attention only")
