"""Motif-Video (text-to-video, image-to-video) for sequence parallelism.

``MotifVideoTransformer3DModel`` (Diffusers 0.42, ``transformer_motif_video.py``) runs dual-stream
blocks, then single-stream blocks, both over ``[video; text]`` (text last: a *suffix*, with the image
embeddings of image-to-video in front of the text and a key padding mask ``[B, 1, 1, S + T]`` that the
model pads with ones over the video tokens it sees). The last ``num_decoder_layers`` single-stream blocks
form a decoder: each attends over ``[decoder tokens; encoder output]``, two streams of the same video
tokens (the decoder stream starts from the patch embedding, the encoder stream is the output of the
blocks before), with no text and no mask. Both streams are split alike, so such a call holds two shards
of this rank; its processor runs with ``streams=2`` (exact: without a mask the keys may be gathered rank
by rank; see :class:`~diffusers_sp.processors.base.SequenceParallelAttnProcessor`). The optional text
cross-attention of the blocks is local (this rank's video queries over the whole text).

Sharding plan (no Diffusers ``_cp_plan``): split the output of ``x_embedder`` (``[B, S, C]``, dim 1) and the
RoPE tables of ``rope`` (``(cos, sin)``, ``[S, D]``, dim 0); gather ``proj_out``.
"""

from __future__ import annotations

from .spec import GATHER_TOKENS, SPLIT_ROWS_OUT, SPLIT_TOKENS_OUT, FamilySpec, modules_matching


def _encoder_blocks(model) -> int:
    return len(model.single_transformer_blocks) - model.num_decoder_layers


def motif_attention_modules(model) -> list:
    """The joint self-attention of the dual-stream blocks and of the single-stream blocks before the decoder."""
    single = modules_matching(model, ("single_transformer_blocks.*.attn",))[:_encoder_blocks(model)]
    return modules_matching(model, ("transformer_blocks.*.attn",)) + single


def motif_decoder_attention_modules(model) -> list:
    """The self-attention of the decoder blocks, over ``[decoder tokens; encoder output]``."""
    return modules_matching(model, ("single_transformer_blocks.*.attn",))[_encoder_blocks(model):]


MOTIF_VIDEO = FamilySpec(
    name="motif_video", model_classes=("MotifVideoTransformer3DModel",), is_video=True,
    sharding_plan={"x_embedder": {0: SPLIT_TOKENS_OUT}, "rope": {0: SPLIT_ROWS_OUT, 1: SPLIT_ROWS_OUT},
                   "proj_out": GATHER_TOKENS},
    attention_modules=motif_attention_modules, two_stream_attention_modules=motif_decoder_attention_modules,
    joint_text="suffix", text_mask=True, attention_call="dispatch",
    # With a guider, the pipelines make the conditional and unconditional predictions as two calls.
    cfg_strategy="two_call",
    note="text after the video; the decoder's two streams of the video tokens split alike")
