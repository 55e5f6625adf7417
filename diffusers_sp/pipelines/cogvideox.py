"""CogVideoX (text-to-video, 2b and 5b) for sequence parallelism.

Joint attention with the text first: ``CogVideoXAttnProcessor2_0`` concatenates ``[text; video]``
and applies RoPE (5b) to the video part only. No text mask (prompts are padded with T5 padding
embeddings that are attended to, as in one process). The 2b model has 30 heads, which do not divide
4 ranks: Ulysses then splits them unevenly, K/V-gather has no constraint.

Sharding plan (explicit; Diffusers 0.42 ships no ``_cp_plan`` for this model): the patch embedding
adds its positional embedding over ``[text; video]`` before the model separates the two, so the
video tokens are split at the input of ``transformer_blocks.0`` (``hidden_states`` ``[B, S, C]``,
dim 1); the RoPE tables the pipeline passes as ``image_rotary_emb`` (``([S, D], [S, D])``, or
``None`` for 2b) are split at the model input (dim 0); ``proj_out`` is gathered.
"""

from __future__ import annotations

from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

from . import FamilySpec

_ROPE = ContextParallelInput(split_dim=0, expected_dims=2, split_output=False)
_COGVIDEOX_PLAN = {
    "": {"image_rotary_emb": [_ROPE, _ROPE]},
    "transformer_blocks.0": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)},
    "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
}


def cogvideox_patch_size(model) -> tuple[int, ...]:
    """Patch size of a ``CogVideoXTransformer3DModel`` from its config, frames first."""
    return (int(model.config.patch_size_t or 1), int(model.config.patch_size), int(model.config.patch_size))


def cogvideox_sharding_plan(model) -> dict:
    """The explicit plan of the module docstring."""
    return dict(_COGVIDEOX_PLAN)


def cogvideox_attention_modules(model) -> list:
    """``transformer_blocks.{i}.attn1`` (joint text + video attention)."""
    return [(f"transformer_blocks.{i}.attn1", b.attn1) for i, b in enumerate(model.transformer_blocks)]


COGVIDEOX = FamilySpec(
    name="cogvideox",
    model_classes=("CogVideoXTransformer3DModel",),
    is_video=True,
    patch_size=cogvideox_patch_size,
    sharding_plan=cogvideox_sharding_plan,
    attention_modules=cogvideox_attention_modules,
    joint_text="prefix",
    text_mask=False,
    cfg_strategy="batch",
    note="text first in self-attention; 2b's 30 heads split unevenly by Ulysses at 4 ranks",
)
