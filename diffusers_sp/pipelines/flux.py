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
dim 1 (:class:`~diffusers_sp.sharding.SplitByDims`), 3-D ``txt_ids`` pass whole.

ControlNet residuals (``controlnet_block_samples``, ``controlnet_single_block_samples``: one
``[B, S, C]`` tensor per block, added to the image tokens) are split like the image tokens
(:data:`~diffusers_sp.pipelines.CONTROLNET_RESIDUALS`); the ControlNet itself runs whole on every rank.
"""

from __future__ import annotations

from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

from ..sharding import SplitByDims
from . import CONTROLNET_RESIDUALS, FamilySpec, plan_without

_TEXT_ENTRIES = {"": ("encoder_hidden_states", "txt_ids")}
_IMG_IDS = SplitByDims((ContextParallelInput(split_dim=0, expected_dims=2, split_output=False),
                        ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)))
# Our plan, used when a model lacks ``_cp_plan`` (the 0.42 plan minus its text entries).
_FLUX_PLAN = {
    "": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False),
         "img_ids": ContextParallelInput(split_dim=0, expected_dims=2, split_output=False)},
    "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
}


def flux_patch_size(model) -> tuple[int, ...]:
    """Patch size of a ``FluxTransformer2DModel`` from its config."""
    return (int(model.config.patch_size),) * 2


def flux_sharding_plan(model) -> dict:
    """The model's ``_cp_plan`` without its text entries (see the module docstring)."""
    plan = getattr(model, "_cp_plan", None)
    plan = plan_without(plan, _TEXT_ENTRIES) if plan else dict(_FLUX_PLAN)
    if "img_ids" in plan.get("", {}):
        plan[""] = {**plan[""], "img_ids": _IMG_IDS}
    plan[""] = {**plan.get("", {}), "controlnet_block_samples": CONTROLNET_RESIDUALS,
                "controlnet_single_block_samples": CONTROLNET_RESIDUALS}
    return plan


def flux_attention_modules(model) -> list:
    """``transformer_blocks.{i}.attn`` (joint) and ``single_transformer_blocks.{i}.attn``."""
    return ([(f"transformer_blocks.{i}.attn", b.attn) for i, b in enumerate(model.transformer_blocks)]
            + [(f"single_transformer_blocks.{i}.attn", b.attn) for i, b in enumerate(model.single_transformer_blocks)])


FLUX = FamilySpec(
    name="flux",
    model_classes=("FluxTransformer2DModel",),
    is_video=False,
    patch_size=flux_patch_size,
    sharding_plan=flux_sharding_plan,
    attention_modules=flux_attention_modules,
    joint_text="prefix",
    text_mask=False,
    cfg_strategy="two_call",
    cfg_by_default=False,
    note="text first; reference-image tokens (Kontext) and ControlNet residuals split with the image",
)
