"""JoyImage Edit and Edit Plus (image editing, and text-to-image without a reference) for sequence parallelism.

Both transformers (Diffusers 0.42, ``transformer_joyimage.py``, ``transformer_joyimage_edit_plus.py``) run
double-stream blocks whose processor joins ``[image; text]``: the text is a *suffix* of every
self-attention sequence, and stays whole on every rank. The image tokens are split at the first block.

* ``JoyImageEditTransformer3DModel`` patchifies ``[B, C, N * T, H, W]`` (the reference image and the
  target as frames) and passes the blocks ``image_rotary_emb = ((cos, sin), text table or None)``: the image
  RoPE tables ``[S, D]`` split by rows, the text's whole. No text mask (prompts are padded and attended to,
  as in one process).
* ``JoyImageEditPlusTransformer3DModel`` takes patches ``[B, N, C, p_t, p_h, p_w]`` padded to the batch's
  longest sample, per-sample RoPE tables ``[B, N, D]`` (split along dim 1), and builds a mask
  ``[B, 1, 1, N + T]`` over the padding patches and the text from the global ``N``: it covers the full
  joint sequence, and the processors apply it as one made before the split (``processors/base.py``).

Sharding plan (no Diffusers ``_cp_plan``): split ``hidden_states`` of ``double_blocks.0`` (``[B, S, C]``, dim 1)
and the image RoPE tables at every block; gather ``proj_out``. Attention in dispatch mode: both processors
pass their ``_parallel_config`` to ``dispatch_attention_fn``.
"""

from __future__ import annotations

from diffusers.models._modeling_parallel import ContextParallelInput

from .spec import GATHER_TOKENS, SPLIT_ROWS, SPLIT_TOKENS, FamilySpec

_PER_SAMPLE_ROPE = ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)


def joyimage_sharding_plan(model) -> dict:
    """The plan of the module docstring, for either transformer."""
    if type(model).__name__ == "JoyImageEditPlusTransformer3DModel":
        rope = (_PER_SAMPLE_ROPE, _PER_SAMPLE_ROPE)
    else:
        rope = ((SPLIT_ROWS, SPLIT_ROWS), None)
    return {"double_blocks.0": {"hidden_states": SPLIT_TOKENS}, "double_blocks.*": {"image_rotary_emb": rope},
            "proj_out": GATHER_TOKENS}


JOYIMAGE = FamilySpec(
    name="joyimage", model_classes=("JoyImageEditTransformer3DModel", "JoyImageEditPlusTransformer3DModel"),
    is_video=False, patch_size=lambda model: tuple(int(p) for p in model.config.patch_size[1:]),
    sharding_plan=joyimage_sharding_plan, attention_modules=("double_blocks.*.attn",), joint_text="suffix",
    text_mask=True, attention_call="dispatch",
    # The pipelines make the conditional and the unconditional prediction as two calls (Edit Plus folds them
    # into one batch of two).
    cfg_strategy=None, note="text after the image; reference images split with the target")
