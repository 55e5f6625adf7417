"""Mochi 1 (text-to-video) for sequence parallelism.

Joint attention with the text after the video tokens and a text mask. ``MochiAttnProcessor2_0``
handles the mask itself: per batch element it keeps only the valid text tokens and calls SDPA on
``[video; valid text]`` with batch 1 and no mask, so each call carries a different number of text
tokens. The processors read that number from each call (query length minus this rank's video
tokens), so ragged prompts are exact under both modes.

Sharding plan (explicit; Diffusers 0.42 ships no ``_cp_plan`` for this model): the patch embedding
runs per frame, so the video tokens are split at the input of ``transformer_blocks.0``
(``hidden_states`` ``[B, S, C]``, dim 1), the RoPE tables ``rope`` returns (``[S, H, D/2]`` cos and
sin, dim 0) are split, and ``proj_out`` is gathered.
"""

from __future__ import annotations

from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

from . import FamilySpec

_MOCHI_PLAN = {
    "transformer_blocks.0": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)},
    "rope": {0: ContextParallelInput(split_dim=0, expected_dims=3, split_output=True),
             1: ContextParallelInput(split_dim=0, expected_dims=3, split_output=True)},
    "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
}


def mochi_patch_size(model) -> tuple[int, ...]:
    """Patch size of a ``MochiTransformer3DModel`` from its config, frames first."""
    return (1, int(model.config.patch_size), int(model.config.patch_size))


def mochi_sharding_plan(model) -> dict:
    """The explicit plan of the module docstring."""
    return dict(_MOCHI_PLAN)


def mochi_attention_modules(model) -> list:
    """``transformer_blocks.{i}.attn1`` (joint video + text attention)."""
    return [(f"transformer_blocks.{i}.attn1", b.attn1) for i, b in enumerate(model.transformer_blocks)]


MOCHI = FamilySpec(
    name="mochi",
    model_classes=("MochiTransformer3DModel",),
    is_video=True,
    patch_size=mochi_patch_size,
    sharding_plan=mochi_sharding_plan,
    attention_modules=mochi_attention_modules,
    joint_text="suffix",
    text_mask=True,
    cfg_strategy="batch",
    note="text after the video, its valid tokens per sample",
)
