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

from diffusers.models._modeling_parallel import ContextParallelInput

from .spec import CONTROLNET_RESIDUALS, GATHER_TOKENS, SPLIT_ROWS_OUT, SPLIT_TOKENS, FamilySpec, model_plan

_TEXT_ENTRIES = {"transformer_blocks.0": ("encoder_hidden_states",),
                 "transformer_blocks.*": ("encoder_hidden_states_mask",),
                 "pos_embed": (1,)}
_QWEN_PLAN = {
    "transformer_blocks.0": {"hidden_states": SPLIT_TOKENS},
    "transformer_blocks.*": {"modulate_index": ContextParallelInput(split_dim=1, expected_dims=2, split_output=False)},
    "pos_embed": {0: SPLIT_ROWS_OUT},
    "proj_out": GATHER_TOKENS,
}


def qwenimage_sharding_plan(model) -> dict:
    """The model's ``_cp_plan`` without its text entries, ControlNet residuals added (see the module docstring)."""
    return model_plan(model, _QWEN_PLAN, _TEXT_ENTRIES, {"controlnet_block_samples": CONTROLNET_RESIDUALS})


QWENIMAGE = FamilySpec(
    name="qwenimage", model_classes=("QwenImageTransformer2DModel",), is_video=False,
    sharding_plan=qwenimage_sharding_plan, attention_modules=("transformer_blocks.*.attn",),
    joint_text="prefix", text_mask=True, cfg_strategy="two_call", cfg_by_default=False,
    note="text first; Edit's reference-image tokens and ControlNet residuals split with the image")
