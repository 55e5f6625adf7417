"""LTX-2 (video and audio, ``LTX2VideoTransformer3DModel``) for sequence parallelism.

Only the video tokens are split; the text and the audio tokens stay whole on every rank, so every
rank computes the whole audio stream, identically. Each block has six attention modules
(``diffusers.models.transformers.transformer_ltx2.LTX2VideoTransformerBlock``); what each call holds
on a rank, and how it runs:

========================  ===================  ===================  ==========================================
module                    queries              keys / values        call
========================  ===================  ===================  ==========================================
``attn1``                 video shard          video shard          the mode's strategy (self-attention)
``attn2``                 video shard          text (whole)         local, left alone
``audio_attn1``           audio (whole)        audio (whole)        local, left alone
``audio_attn2``           audio (whole)        text (whole)         local, left alone
``audio_to_video_attn``   video shard          audio (whole)        local, left alone
``video_to_audio_attn``   audio (whole)        video shard          K/V gathered in every mode
========================  ===================  ===================  ==========================================

The video-to-audio call has whole queries over split keys: its video K/V are all-gathered whatever
the mode (:class:`~diffusers_sp.processors.kv_gather.SplitKVAttnProcessor`), and each rank computes
every audio row. Only ``attn1`` and ``video_to_audio_attn`` are wrapped (dispatch mode: the attention
calls of their processors are marked as in :mod:`diffusers_sp.pipelines.cp_plan`); the other four
keep Diffusers' own processors, unmarked.

Sharding plan, derived from the model's Diffusers ``_cp_plan``:

* its text entries (``encoder_hidden_states``, ``encoder_attention_mask``) dropped: the text stays
  replicated;
* ``hidden_states`` ``[B, S, C]`` split along dim 1, ``proj_out`` gathered (as in the plan);
* the video RoPE tables of ``rope`` split in both of the model's layouts (``rope_type``):
  ``[B, S, D]`` (interleaved) along dim 1 and ``[B, H, S, D / 2]`` (split, LTX-2.3) along dim 2
  (:class:`~diffusers_sp.plan_entries.SplitByDims`; Diffusers' plan covers only the first);
* the same for ``cross_attn_rope``, absent from Diffusers' plan: its video table rotates the queries
  of the audio-to-video call and the keys of the video-to-audio call, both video shards here;
* the per-token ``timestep`` ``[B, S]`` (image-to-video, condition, IC-LoRA and DFR pipelines: the
  conditioning tokens sit at a lower timestep) and ``video_keyframes_mask`` ``[B, S, 1]`` (DFR)
  split with the tokens; a ``[B]`` timestep passes whole.

The audio (``audio_hidden_states``, ``audio_timestep``, its RoPE) passes whole. Refused at the call:
``video_self_attention_mask`` ``[B, S, S]`` (see :data:`_REFUSED_INPUTS`).
"""

from __future__ import annotations

from diffusers.models._modeling_parallel import ContextParallelInput

from ..plan_entries import SplitByDims
from .spec import SPLIT_TOKENS_OUT, FamilySpec, plan_without

_TEXT_ENTRIES = {"": ("encoder_hidden_states", "encoder_attention_mask")}
#: A RoPE table ``(cos, sin)`` of the video tokens, in either layout.
_VIDEO_ROPE_TABLE = SplitByDims((SPLIT_TOKENS_OUT,
                                 ContextParallelInput(split_dim=2, expected_dims=4, split_output=True)))
_VIDEO_ROPE = {0: _VIDEO_ROPE_TABLE, 1: _VIDEO_ROPE_TABLE}
_PER_TOKEN = {
    "timestep": ContextParallelInput(split_dim=1, expected_dims=2, split_output=False),
    "video_keyframes_mask": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False),
}
#: Forward arguments refused when not ``None``: ``{name: what it is, and what runs instead}``.
_REFUSED_INPUTS = {
    "video_self_attention_mask": (
        "a [B, S, S] mask between pairs of video tokens, which LTX2InContextPipeline builds for reference "
        "conditions with conditioning_attention_strength below 1 or a conditioning_attention_mask; a rank "
        "holds the queries of its own tokens only and Diffusers' attention pads such a mask to the local "
        "length. Reference conditions at strength 1.0 without a mask run"),
}


def ltx2_sharding_plan(model) -> dict:
    """The model's ``_cp_plan`` without its text entries, with both RoPE layouts, the cross-modal
    RoPE and the per-token inputs (see the module docstring)."""
    plan = plan_without(type(model)._cp_plan, _TEXT_ENTRIES)
    plan[""] = {**plan.get("", {}), **_PER_TOKEN}
    plan["rope"] = dict(_VIDEO_ROPE)
    plan["cross_attn_rope"] = dict(_VIDEO_ROPE)
    return plan


LTX2 = FamilySpec(
    name="ltx2", model_classes=("LTX2VideoTransformer3DModel",), is_video=True,
    sharding_plan=ltx2_sharding_plan, attention_modules=("transformer_blocks.*.attn1",),
    # Whole audio queries over the split video.
    split_kv_attention_modules=("transformer_blocks.*.video_to_audio_attn",),
    text_mask=True, unsupported_inputs=_REFUSED_INPUTS, attention_call="dispatch",
    note="video split, text and audio whole; video-to-audio attention gathers the video K/V in every mode")
