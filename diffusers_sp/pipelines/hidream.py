"""HiDream-I1 (text-to-image) for sequence parallelism.

``HiDreamImageTransformer2DModel`` (Diffusers 0.42, ``transformer_hidream_image.py``) has double-stream
blocks, whose ``HiDreamAttnProcessor`` concatenates ``[image; text]`` (text last), and single-stream
blocks, which receive ``[image; T5 + last Llama layer; this block's Llama layer]`` as one sequence:
the text is a *suffix* of every self-attention sequence, and is replicated on every rank. The text
has no mask (prompts are padded to ``max_sequence_length`` and attended to, as in one process). The
feed-forward of the image tokens is a mixture of experts whose gate routes each token on its own,
so splitting the tokens changes nothing there.

Non-square latents are patchified into ``max_seq`` tokens (``max_resolution`` of the config over the
patch area), the padding marked by ``hidden_states_masks`` (1 / 0 per token), which the processor
multiplies into the image keys: a per-token scale, split with the tokens. The single-stream blocks
get it extended by ones over the text (``[B, S + T]``).

Sharding plan (no Diffusers ``_cp_plan``): split the patchified tokens at the input of ``x_embedder``
(``[B, S, C]``, dim 1; this sets the sequence length S), the image part of the position ids at
``pe_embedder`` (``[B, S + T, 3]``: the first S entries are the image's, the text's ids stay whole;
a :class:`~diffusers_sp.sharding.JointSequence` with the text last), so that each RoPE table covers
``[this rank's image tokens; text]``, and ``hidden_states_masks`` at every block (``[B, S]``, and
``[B, S + T]``, again a text-last :class:`~diffusers_sp.sharding.JointSequence`, in the single-stream
blocks); gather the output of
``final_layer`` (``[B, S, p * p * C]``). The model computes the lengths it slices with from the local
tensors (``image_tokens_seq_len``), so its ``[:, :S]`` slices select this rank's image tokens.
"""

from __future__ import annotations

from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

from ..sharding import JointSequence
from . import FamilySpec

_TOKENS = ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)
_MASK = ContextParallelInput(split_dim=1, expected_dims=2, split_output=False)
_HIDREAM_PLAN = {
    "x_embedder": {"latent": _TOKENS},
    "pe_embedder": {"ids": JointSequence(_TOKENS, text="suffix")},
    "double_stream_blocks.*": {"hidden_states_masks": _MASK},
    "single_stream_blocks.*": {"hidden_states_masks": JointSequence(_MASK, text="suffix")},
    "final_layer": ContextParallelOutput(gather_dim=1, expected_dims=3),
}


def hidream_patch_size(model) -> tuple[int, ...]:
    """Patch size of a ``HiDreamImageTransformer2DModel`` from its config."""
    return (int(model.config.patch_size),) * 2


def hidream_sharding_plan(model) -> dict:
    """The plan of the module docstring."""
    return dict(_HIDREAM_PLAN)


def hidream_attention_modules(model) -> list:
    """``double_stream_blocks.{i}.block.attn1`` (image and text) and ``single_stream_blocks.{i}.block.attn1``."""
    return ([(f"double_stream_blocks.{i}.block.attn1", b.block.attn1) for i, b in enumerate(model.double_stream_blocks)]
            + [(f"single_stream_blocks.{i}.block.attn1", b.block.attn1)
               for i, b in enumerate(model.single_stream_blocks)])


HIDREAM = FamilySpec(
    name="hidream",
    model_classes=("HiDreamImageTransformer2DModel",),
    is_video=False,
    patch_size=hidream_patch_size,
    sharding_plan=hidream_sharding_plan,
    attention_modules=hidream_attention_modules,
    joint_text="suffix",
    text_mask=False,
    note="text after the image; MoE feed-forward per token",
)
