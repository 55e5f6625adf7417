"""CogView4 (text-to-image, and its Control variant) for sequence parallelism.

Joint attention with the text first: ``CogView4AttnProcessor`` concatenates ``[text; image]`` and
applies RoPE to the image part only. CogView4Pipeline pads the prompts of a batch to one length
(the tokenizer's padding, then pad tokens in front up to a multiple of 16) and passes no mask: the
padding tokens are attended, as in one process.
The transformer also takes ``attention_mask`` ``[B, T]`` (1 = text token, 0 = padding), from which
the processor builds, over its local ``T + S_r`` tokens, ``(m mᵀ > 0).to(dtype)`` with
``m = [text mask; ones]``: an additive 1.0 on valid query-key pairs and 0.0 elsewhere (not a
masking one: the padding keys stay visible, one logit lower). That mask varies with the query, but
as a padding mask over queries and keys it runs exactly
(:func:`~diffusers_sp.processors.base.symmetric_padding_vector`), at the cost of a second
attention call per block when the batch has padding.

Sharding plan (explicit; Diffusers 0.42 ships no ``_cp_plan`` for this model): split the image
tokens at the output of ``patch_embed`` (output 0, ``[B, S, C]``, dim 1) and the RoPE tables of
``rope`` (``(cos, sin)``, ``[S, D]``, dim 0), or of ``image_rotary_emb`` when the caller passes it
(then ``rope`` is not called); gather ``proj_out``. CogView4ControlPipeline concatenates the control
latents with the latents along the channels before the patch embedding, so it needs nothing more.
"""

from __future__ import annotations

from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

from . import FamilySpec

_ROPE = ContextParallelInput(split_dim=0, expected_dims=2, split_output=True)
_COGVIEW4_PLAN = {
    "": {"image_rotary_emb": [ContextParallelInput(split_dim=0, expected_dims=2, split_output=False)] * 2},
    "patch_embed": {0: ContextParallelInput(split_dim=1, expected_dims=3, split_output=True)},
    "rope": {0: _ROPE, 1: _ROPE},
    "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
}


def cogview4_patch_size(model) -> tuple[int, ...]:
    """Patch size of a ``CogView4Transformer2DModel`` from its config."""
    return (int(model.config.patch_size),) * 2


def cogview4_sharding_plan(model) -> dict:
    """The explicit plan of the module docstring."""
    return dict(_COGVIEW4_PLAN)


def cogview4_attention_modules(model) -> list:
    """``transformer_blocks.{i}.attn1`` (joint text + image attention)."""
    return [(f"transformer_blocks.{i}.attn1", b.attn1) for i, b in enumerate(model.transformer_blocks)]


COGVIEW4 = FamilySpec(
    name="cogview4",
    model_classes=("CogView4Transformer2DModel",),
    is_video=False,
    patch_size=cogview4_patch_size,
    sharding_plan=cogview4_sharding_plan,
    attention_modules=cogview4_attention_modules,
    joint_text="prefix",
    text_mask=True,
    cfg_strategy="two_call",
    note="text first; its padding mask over queries and keys applied exactly",
)
