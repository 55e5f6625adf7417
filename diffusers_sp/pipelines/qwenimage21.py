"""QwenImage 2.1 (text-to-image, image-conditioned) for sequence parallelism.

``QwenImage21Transformer2DModel`` (Diffusers 0.42, ``transformer_qwenimage21.py``) is single-stream and
unlike QwenImage (``pipelines/qwenimage.py``: double-stream, full joint attention, text prefix split off
per block) in the ways that decide the plan here:

* One joint sequence per forward, ``[text with condition-image tokens substituted at their slots;
  target image]``: the target image is last, everything before it is the *prefix*. It goes through
  every block as one tensor, with one RoPE table ``[L, D/2]``, a per-token ``target_token_mask`` that
  picks each token's modulation (the prefix is modulated from t = 0 under ``causal_condition``) and a
  key mask ``[B, L]`` from the text mask (ragged prompts).
* Block-causal attention: the prefix attends causally (text) or within its image block, never to the
  target; the target attends to everything. ``QwenImage21AttnProcessor`` makes it one attention call
  per prefix block over the keys before its end (text blocks with a causal mask), plus one call of the
  target's queries over all keys.
* A K/V cache (``use_kv_cache``, the pipeline's default): the prefix depends on the prompt and the
  condition images only, so the first step stores its K and V per block and the later steps run the
  target tokens alone, attending to ``[cached prefix K/V; target K/V]``.

What is split: the target image's tokens only; the prefix (text and condition images) stays whole on
every rank, so its block-causal calls run unchanged, as do the cache writes and reads of its K/V. The
target's call becomes K/V-gather over ``[prefix; all target tokens]`` in both modes
(:class:`~diffusers_sp.processors.kv_gather.PrefixKVAttnProcessor`, in dispatch mode: Diffusers' processor
passes its ``_parallel_config`` with every call). The target length ``S`` comes from ``img_shapes``
(its last entry; :class:`~diffusers_sp.plan_entries.SequenceLength`); it is a multiple of 4 (each
vision-language slot stands for 2 x 2 latent tokens), so it divides evenly over 2 ranks.

Sharding plan (no Diffusers ``_cp_plan``): with text-first :class:`~diffusers_sp.plan_entries.JointSequence`
entries (the prefix whole, the last S entries split) the joint hidden states at the first block
(``[B, W + S, C]``), and at every block the RoPE table (``[W + S, D/2]`` complex),
``target_token_mask`` (``[W + S]``), the key mask (``key_valid``, ``[B, W + S]``) and the cached steps'
``attention_mask`` (``[B, 1, 1, W + S]``, where the blocks' own sequence is the target alone,
``W = 0``); the final norm's ``target_token_mask``; gather the target part of ``proj_out`` (a
text-first ``JointSequence`` of a ``ContextParallelOutput``). ``QwenImage21FlexAttnProcessor`` (a flex
``BlockMask`` over the whole sequence) is refused at its first call.
"""

from __future__ import annotations

import math

from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

from ..processors.kv_gather import PrefixKVAttnProcessor
from ..plan_entries import JointSequence, SequenceLength
from .spec import FamilySpec


def _target_tokens(img_shapes) -> int:
    """Tokens of the target image: the last ``(frames, height, width)`` of the first sample's
    ``img_shapes`` (samples share a layout)."""
    return math.prod(img_shapes[0][-1])


def _tail(split_dim: int, expected_dims: int) -> JointSequence:
    """The last S entries along ``split_dim`` split, the prefix before them whole."""
    return JointSequence(ContextParallelInput(split_dim=split_dim, expected_dims=expected_dims, split_output=False),
                         text="prefix")


_QWENIMAGE21_PLAN = {
    "": {"img_shapes": SequenceLength(_target_tokens)},
    "transformer_blocks.0": {"hidden_states": _tail(1, 3)},
    "transformer_blocks.*": {"rotary_emb": _tail(0, 2), "target_token_mask": _tail(0, 1), "key_valid": _tail(1, 2),
                             "attention_mask": _tail(3, 4)},
    "norm_out": {"target_token_mask": _tail(0, 1)},
    "proj_out": JointSequence(ContextParallelOutput(gather_dim=1, expected_dims=3), text="prefix"),
}


QWENIMAGE21 = FamilySpec(
    name="qwenimage21", model_classes=("QwenImage21Transformer2DModel",), is_video=False,
    sharding_plan=_QWENIMAGE21_PLAN, attention_modules=("transformer_blocks.*.attn",),
    joint_text="prefix", text_mask=True, attention_call="dispatch", attention_processor=PrefixKVAttnProcessor,
    note="the target image split, the text and condition-image prefix whole; K/V-gather in both modes")
