"""Lumina 2 (Lumina-Image 2.0, text-to-image) for sequence parallelism.

``Lumina2Transformer2DModel`` (Diffusers 0.42) runs three kinds of blocks, all with
``Lumina2AttnProcessor2_0`` (grouped K/V heads repeated to the query heads before SDPA):

* ``context_refiner``: caption tokens alone, with the caption mask. Replicated, left alone.
* ``noise_refiner``: image tokens alone, no mask, RoPE table ``img_freqs`` ``[B, S, D/2]``. Split:
  the image tokens at the output of ``x_embedder`` (``[B, S, C]``, dim 1), ``img_freqs`` (output 2
  of ``rope_embedder``, dim 1); gathered after the last refiner block.
* ``layers``: the joint blocks. The model builds their sequence per sample as
  ``[caption c_i; image S; zeros]``, padded to ``max(c_i) + S``, with one RoPE table per sample and,
  only when the ``c_i`` differ, a key padding mask ``[B, max(c_i) + S]`` (True on the first
  ``c_i + S`` tokens). Its image tokens start at a different offset in each sample, where the
  processors expect one text prefix for the whole batch.

So the family rewrites the layout (:func:`lumina2_forward_hooks`): on ``rope_embedder``'s outputs, every
caption length becomes ``T = max(c_i)`` and the joint table ``[caption c_i; table of the padding
rows; image S]``, so that the model itself builds ``[caption T (padding masked); image S]``, and the
blocks of ``layers`` get the key padding mask (True on the first ``c_i`` and the last ``S``
tokens) that the model then no longer builds. Each valid token keeps its hidden state and its RoPE
row, and attends to the same valid tokens: the result is the model's, up to the order of the
softmax sums (the padding rows, masked as keys and cut at the output, hold the caption refiner's
padding outputs instead of zeros). Without padding (equal ``c_i``) nothing changes. The plan then
splits the image part of the joint hidden states (``layers.0``), mask and RoPE table (every block)
as :class:`~diffusers_sp.plan_entries.JointSequence` entries and gathers it at the output of
``norm_out``, before the model cuts out each sample's image tokens.
"""

from __future__ import annotations

import torch
from diffusers.hooks import ModelHook
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

from ..plan_entries import JointSequence
from .spec import SPLIT_TOKENS_OUT, FamilySpec

#: ``SequenceState.extra`` key of the current forward's joint key padding mask (``None``: no padding).
_MASK = "lumina2_joint_mask"


def _tokens(dims: int) -> ContextParallelInput:
    return ContextParallelInput(split_dim=1, expected_dims=dims, split_output=False)


def lumina2_sharding_plan(model) -> dict:
    """The plan of the module docstring (Diffusers 0.42 ships no ``_cp_plan`` for this model).

    ``img_freqs`` is split even without refiner blocks: its split sets the image length ``S`` of the
    forward, which the joint entries read their caption length from (``n - S``)."""
    plan = {
        "rope_embedder": {2: SPLIT_TOKENS_OUT},
        "layers.0": {"hidden_states": JointSequence(_tokens(3))},
        "layers.*": {"attention_mask": JointSequence(_tokens(2)), "image_rotary_emb": JointSequence(_tokens(3))},
        "norm_out": JointSequence(ContextParallelOutput(gather_dim=1, expected_dims=3)),
    }
    refiners = len(model.noise_refiner)
    if refiners:
        plan["x_embedder"] = {0: SPLIT_TOKENS_OUT}
        plan[f"noise_refiner.{refiners - 1}"] = ContextParallelOutput(gather_dim=1, expected_dims=3)
    return plan


class _OneCaptionPrefix(ModelHook):
    """On ``rope_embedder``: outputs ``(image patches, caption table, image table, joint table
    [B, max(c_i) + S, D/2], caption lengths, joint lengths)`` become those of one caption prefix of
    ``T = max(c_i)`` tokens for every sample, and ``state.extra[_MASK]`` the key padding mask of that
    layout (``None`` when every caption has ``T`` tokens: then nothing changes)."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def post_forward(self, module, output):
        patches, caption_table, image_table, joint_table, caption_lens, joint_lens = output
        longest = max(caption_lens)
        if all(c == longest for c in caption_lens):
            self.state.extra[_MASK] = None
            return output
        image = joint_lens[0] - caption_lens[0]
        # Each sample's image rows of the model's table (after its own caption), behind the longest caption.
        image_rows = torch.stack([joint_table[i, c:c + image] for i, c in enumerate(caption_lens)])
        table = torch.cat([joint_table[:, :longest], image_rows], dim=1)
        position = torch.arange(longest + image, device=table.device)
        lens = torch.tensor(caption_lens, device=table.device)
        self.state.extra[_MASK] = (position[None, :] < lens[:, None]) | (position[None, :] >= longest)
        batch = len(caption_lens)
        return (patches, caption_table, image_table, table, [longest] * batch, [longest + image] * batch)


class _JointMask(ModelHook):
    """On each block of ``layers``: passes the key padding mask of the rewritten layout, which the
    model, seeing equal lengths, leaves out (``attention_mask=None``)."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def pre_forward(self, module, *args, **kwargs):
        mask = self.state.extra.get(_MASK)
        if mask is None:
            return args, kwargs
        if "attention_mask" in kwargs:
            if kwargs["attention_mask"] is None:
                kwargs["attention_mask"] = mask
        elif len(args) > 1 and args[1] is None:  # forward(hidden_states, attention_mask, image_rotary_emb, temb)
            args = (args[0], mask, *args[2:])
        return args, kwargs


def lumina2_forward_hooks(model, state) -> dict:
    """The layout rewrite of the module docstring: ``rope_embedder`` outputs and the blocks' mask."""
    return {"rope_embedder": lambda: _OneCaptionPrefix(state), "layers.*": lambda: _JointMask(state)}


LUMINA2 = FamilySpec(
    name="lumina2", model_classes=("Lumina2Transformer2DModel",), is_video=False,
    # The caption-only context_refiner runs whole on every rank.
    sharding_plan=lumina2_sharding_plan, attention_modules=("noise_refiner.*.attn", "layers.*.attn"),
    joint_text="prefix", text_mask=True, forward_hooks=lumina2_forward_hooks,
    # Lumina2Pipeline makes its two CFG calls without Diffusers' cache_context names, so the CFG
    # hook could never pair them: CFG parallelism would only compute each call twice.
    cfg_strategy=None, note="per-sample caption lengths aligned to one text prefix; the noise refiner split")
