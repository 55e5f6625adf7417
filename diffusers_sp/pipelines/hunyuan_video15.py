"""HunyuanVideo 1.5 (text-to-video, image-to-video) for sequence parallelism.

``HunyuanVideo15Transformer3DModel`` runs dual-stream blocks only: every block's attention joins the
video tokens and the text after them (``[video; text]``: the Qwen2.5-VL tokens, the ByT5 glyph tokens
and the SigLIP image tokens, reordered by the model so that each sample's valid tokens come first).
The processor (``HunyuanVideo15AttnProcessor2_0``) pads the text mask with True over the video tokens
it holds and builds ``p[i] & p[j]`` (``[B, 1, L, L]``): a padding mask over queries and keys, which
the processors run as a key padding mask with the padding text queries' rows fully masked
(:func:`~diffusers_sp.processors.base.symmetric_padding_vector`). The processor marks its attention
call for context parallelism (``parallel_config``), so it runs in dispatch mode. The token refiner and
the ByT5 and image projections run on every rank whole.

Sharding plan (explicit; Diffusers 0.42 ships no ``_cp_plan`` for this model): split the patchified
hidden states at the first block (``[B, S, C]``, dim 1: a forward argument, so that dispatch mode
knows the blocks' attention calls hold split tokens) and the RoPE tables ``rope`` returns (``[S, D]``
cos and sin, dim 0); gather ``proj_out``. The timestep (and MeanFlow's ``timestep_r``) is per sample.
The image-to-video pipeline joins its image latents and mask along the channels.
"""

from __future__ import annotations

from .spec import GATHER_TOKENS, SPLIT_ROWS_OUT, SPLIT_TOKENS, FamilySpec

HUNYUAN_VIDEO15 = FamilySpec(
    name="hunyuan_video15", model_classes=("HunyuanVideo15Transformer3DModel",), is_video=True,
    sharding_plan={"transformer_blocks.0": {"hidden_states": SPLIT_TOKENS}, "rope": {0: SPLIT_ROWS_OUT, 1: SPLIT_ROWS_OUT},
                   "proj_out": GATHER_TOKENS},
    attention_modules=("transformer_blocks.*.attn",), joint_text="suffix", text_mask=True, attention_call="dispatch",
    cfg_strategy="two_call", note="text after the video in every block; its outer-product text mask as a key padding mask")
