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
a :class:`~diffusers_sp.plan_entries.JointSequence` with the text last), so that each RoPE table covers
``[this rank's image tokens; text]``, and ``hidden_states_masks`` at every block (``[B, S]``, and
``[B, S + T]``, again a text-last :class:`~diffusers_sp.plan_entries.JointSequence`, in the single-stream
blocks); gather the output of
``final_layer`` (``[B, S, p * p * C]``). The model computes the lengths it slices with from the local
tensors (``image_tokens_seq_len``), so its ``[:, :S]`` slices select this rank's image tokens.
"""

from __future__ import annotations

from diffusers.models._modeling_parallel import ContextParallelInput

from ..plan_entries import JointSequence
from .spec import GATHER_TOKENS, SPLIT_TOKENS, FamilySpec

_MASK = ContextParallelInput(split_dim=1, expected_dims=2, split_output=False)

HIDREAM = FamilySpec(
    name="hidream", model_classes=("HiDreamImageTransformer2DModel",), is_video=False,
    sharding_plan={"x_embedder": {"latent": SPLIT_TOKENS}, "pe_embedder": {"ids": JointSequence(SPLIT_TOKENS, text="suffix")},
                   "double_stream_blocks.*": {"hidden_states_masks": _MASK},
                   "single_stream_blocks.*": {"hidden_states_masks": JointSequence(_MASK, text="suffix")},
                   "final_layer": GATHER_TOKENS},
    attention_modules=("double_stream_blocks.*.block.attn1", "single_stream_blocks.*.block.attn1"),
    joint_text="suffix", note="text after the image; MoE feed-forward per token")
