"""QwenImage (text-to-image) for sequence parallelism.

Joint attention with the text first (``[text; image]``, built in
``QwenDoubleStreamAttnProcessor2_0``) and a text key padding mask: the processor builds
``[B, 1, 1, T + S_r]`` from ``encoder_hidden_states_mask`` and an all-True image part over this
rank's image tokens (gathered with the keys). Batched prompts of different lengths are padded to
the longest and masked. The RoPE tables are separate for video and text (``pos_embed`` returns
``(vid_freqs, txt_freqs)``), so only ``vid_freqs`` is sharded.

Sharding plan: derived from the model's Diffusers ``_cp_plan`` by dropping its text entries
(``encoder_hidden_states`` at ``transformer_blocks.0``, ``encoder_hidden_states_mask`` at every
block, output 1 = ``txt_freqs`` of ``pos_embed``): split ``hidden_states`` at the first block
(``[B, S, C]``, dim 1), the per-image-token ``modulate_index`` at every block (``[B, S]``, dim 1,
QwenImage-Edit-2511's zero-cond timestep), ``vid_freqs`` (``[S, D/2]`` complex, dim 0); gather
``proj_out``. ControlNet residuals (``controlnet_block_samples``, one ``[B, S, C]`` per block) are
split like the image tokens; the ControlNet runs whole on every rank.
"""

from __future__ import annotations

from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

from . import CONTROLNET_RESIDUALS, FamilySpec, plan_without

_TEXT_ENTRIES = {"transformer_blocks.0": ("encoder_hidden_states",),
                 "transformer_blocks.*": ("encoder_hidden_states_mask",),
                 "pos_embed": (1,)}
_QWEN_PLAN = {
    "transformer_blocks.0": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)},
    "transformer_blocks.*": {"modulate_index": ContextParallelInput(split_dim=1, expected_dims=2, split_output=False)},
    "pos_embed": {0: ContextParallelInput(split_dim=0, expected_dims=2, split_output=True)},
    "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
}


def qwenimage_patch_size(model) -> tuple[int, ...]:
    """Patch size of a ``QwenImageTransformer2DModel`` from its config."""
    return (int(model.config.patch_size),) * 2


def qwenimage_sharding_plan(model) -> dict:
    """The model's ``_cp_plan`` without its text entries (see the module docstring)."""
    plan = getattr(model, "_cp_plan", None)
    plan = plan_without(plan, _TEXT_ENTRIES) if plan else dict(_QWEN_PLAN)
    plan[""] = {**plan.get("", {}), "controlnet_block_samples": CONTROLNET_RESIDUALS}
    return plan


def qwenimage_attention_modules(model) -> list:
    """``transformer_blocks.{i}.attn`` (joint text + image attention)."""
    return [(f"transformer_blocks.{i}.attn", b.attn) for i, b in enumerate(model.transformer_blocks)]


QWENIMAGE = FamilySpec(
    name="qwenimage",
    model_classes=("QwenImageTransformer2DModel",),
    is_video=False,
    patch_size=qwenimage_patch_size,
    sharding_plan=qwenimage_sharding_plan,
    attention_modules=qwenimage_attention_modules,
    joint_text="prefix",
    text_mask=True,
    cfg_strategy="two_call",
    cfg_by_default=False,
    note="text first; Edit's reference-image tokens and ControlNet residuals split with the image",
)
