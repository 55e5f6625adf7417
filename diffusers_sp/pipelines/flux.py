"""Flux (FLUX.1 dev / schnell) for sequence parallelism.

Flux's attention is joint: the dual-stream blocks concatenate ``[text; image]`` inside
``FluxAttnProcessor`` and the single-stream blocks receive the concatenation as one sequence, so
the text is a *prefix* of every self-attention sequence. There is no text mask. The RoPE table is
computed from ``cat(txt_ids, img_ids)``; splitting ``img_ids`` at the model input makes it cover
exactly ``[text; this rank's image tokens]``.

Sharding plan: derived from the model's Diffusers ``_cp_plan`` by dropping its text entries
(``encoder_hidden_states`` and ``txt_ids``, which Diffusers shards and diffusers-sp keeps replicated): split
``hidden_states`` (``[B, S, C]``, dim 1) and ``img_ids`` (``[S, 3]``, dim 0) at the model input,
gather ``proj_out``. Guidance, timestep and pooled projections stay whole. Diffusers still accepts
the deprecated ``[B, S, 3]`` ids (its forward takes ``ids[0]``): such ``img_ids`` are split along
dim 1 (:class:`~diffusers_sp.plan_entries.SplitByDims`), 3-D ``txt_ids`` pass whole.

ControlNet residuals (``controlnet_block_samples``, ``controlnet_single_block_samples``: one
``[B, S, C]`` tensor per block, added to the image tokens) are split like the image tokens
(:data:`~diffusers_sp.pipelines.CONTROLNET_RESIDUALS`); the ControlNet itself runs whole on every rank.
"""

from __future__ import annotations

from diffusers.models._modeling_parallel import ContextParallelInput

from ..plan_entries import SplitByDims
from .spec import CONTROLNET_RESIDUALS, GATHER_TOKENS, SPLIT_ROWS, SPLIT_TOKENS, FamilySpec, model_plan

_TEXT_ENTRIES = {"": ("encoder_hidden_states", "txt_ids")}
_IMG_IDS = SplitByDims((SPLIT_ROWS,
                        ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)))
# Our plan, used when a model lacks ``_cp_plan`` (the 0.42 plan minus its text entries).
_FLUX_PLAN = {"": {"hidden_states": SPLIT_TOKENS, "img_ids": SPLIT_ROWS},
              "proj_out": GATHER_TOKENS}
#: The plan of the models built like Flux with neither ``_cp_plan`` nor ControlNet inputs (LongCat-Image,
#: Ovis-Image): the image tokens and their ids split at the model input, ``proj_out`` gathered.
FLUX_LIKE_PLAN = {"": {"hidden_states": SPLIT_TOKENS, "img_ids": _IMG_IDS}, "proj_out": GATHER_TOKENS}
#: The self-attention of Flux's dual-stream (joint) and single-stream blocks (Chroma's too).
FLUX_ATTENTION = ("transformer_blocks.*.attn", "single_transformer_blocks.*.attn")
#: The ControlNet residuals of Flux's forward (Chroma's too).
FLUX_CONTROLNET = {"controlnet_block_samples": CONTROLNET_RESIDUALS,
                   "controlnet_single_block_samples": CONTROLNET_RESIDUALS}


def flux_sharding_plan(model) -> dict:
    """The model's ``_cp_plan`` without its text entries (see the module docstring)."""
    plan = model_plan(model, _FLUX_PLAN, _TEXT_ENTRIES, FLUX_CONTROLNET)
    if "img_ids" in plan[""]:
        plan[""]["img_ids"] = _IMG_IDS
    return plan


FLUX = FamilySpec(
    name="flux", model_classes=("FluxTransformer2DModel",), is_video=False,
    sharding_plan=flux_sharding_plan, attention_modules=FLUX_ATTENTION,
    joint_text="prefix", cfg_strategy="two_call", cfg_by_default=False,
    note="text first; reference-image tokens (Kontext) and ControlNet residuals split with the image")
