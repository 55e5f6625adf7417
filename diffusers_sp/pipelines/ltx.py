"""LTX-Video (text-to-video) for sequence parallelism.

Self-attention (``attn1``) runs over the video tokens only; the text enters through cross-attention
(``attn2``, video queries over the text keys with the text key padding mask), which needs no
communication and is left alone: each rank's video rows attend to the whole, replicated text.

Sharding plan: derived from the model's Diffusers ``_cp_plan`` by dropping its text entries
(``encoder_hidden_states`` and ``encoder_attention_mask``, which Diffusers shards and
diffusers-sp keeps replicated): split ``hidden_states`` (``[B, S, C]``, dim 1) at the model input and the RoPE tables
``rope`` returns (``[B, S, D]``, dim 1); gather ``proj_out``. The image-to-video and condition
pipelines pass one timestep per token (``timestep`` ``[B, S]``: the conditioning frames' tokens
keep timestep 0; Diffusers 0.42's ``LTXI2VLongMultiPromptPipeline`` passes it as ``[B, S, 1]``,
which the model flattens alike), which is split with the tokens; a ``[B]`` timestep passes whole. The condition
pipelines' ``video_coords`` (``[B, 3, S]``) need no entry: ``rope`` reads them whole and its
tables are split.
"""

from __future__ import annotations

from diffusers.models._modeling_parallel import ContextParallelInput

from ..plan_entries import SplitByDims
from .spec import GATHER_TOKENS, SPLIT_TOKENS, SPLIT_TOKENS_OUT, FamilySpec, model_plan

_TEXT_ENTRIES = {"": ("encoder_hidden_states", "encoder_attention_mask")}
# [B, S] or [B, S, 1] per token (the model flattens either to B x S timesteps); [B] has neither layout.
_TIMESTEP = {"timestep": SplitByDims((ContextParallelInput(split_dim=1, expected_dims=2, split_output=False),
                                      ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)))}
_LTX_ROPE = SPLIT_TOKENS_OUT
_LTX_PLAN = {"": {"hidden_states": SPLIT_TOKENS}, "rope": {0: _LTX_ROPE, 1: _LTX_ROPE}, "proj_out": GATHER_TOKENS}


def ltx_sharding_plan(model) -> dict:
    """The model's ``_cp_plan`` without its text entries, with per-token timesteps (see the module docstring)."""
    return model_plan(model, _LTX_PLAN, _TEXT_ENTRIES, _TIMESTEP)


LTX = FamilySpec(
    name="ltx", model_classes=("LTXVideoTransformer3DModel",), is_video=True,
    sharding_plan=ltx_sharding_plan, attention_modules=("transformer_blocks.*.attn1",),
    text_mask=True, cfg_strategy="batch",
    note="text in cross-attention; per-token timesteps (image-to-video, condition) split")
