"""Kandinsky 6 (text/image-to-video-and-audio, ``Kandinsky6TI2VAPipeline``) for sequence parallelism.

``Kandinsky6Transformer3DModel`` (Diffusers 0.42, ``transformer_kandinsky6.py``) refines the text in two
branches (video, audio), patchifies the video into ``[B, T, H, W, C]``, flattens it to ``[B, S, C]`` with
its RoPE table ``[S, 1, D/2, 2, 2]``, and runs fused blocks in which the video and the audio each attend to
themselves and to their text, then to each other: video queries over the audio (``va_cross_attention``)
and audio queries over the video (``av_cross_attention``). The video tokens are split; the audio, like
the text, stays whole on every rank. So the video self-attention runs in the dense mode, the video-to-text
and video-to-audio attention is local (this rank's queries over whole keys), and the audio-to-video
attention has whole queries over split keys: K/V-gather in every mode
(:class:`~diffusers_sp.processors.kv_gather.SplitKVAttnProcessor`), as LTX-2's.

Sharding plan (no Diffusers ``_cp_plan``): split ``vis`` of the first fused block (``[B, S, C]``, dim 1) and
``vis_rope`` of every block (dim 0); gather the video output of the last block (before the model folds it
back to its ``(T, H, W)`` grid). Attention in dispatch mode: ``Kandinsky6AttnProcessor`` passes its
``_parallel_config`` to ``dispatch_attention_fn``, and each attention module has its own processor.
"""

from __future__ import annotations

from diffusers.models._modeling_parallel import ContextParallelInput

from .spec import GATHER_TOKENS, SPLIT_TOKENS, FamilySpec

_VISUAL_ROPE = ContextParallelInput(split_dim=0, expected_dims=5, split_output=False)


def kandinsky6_sharding_plan(model) -> dict:
    """The plan of the module docstring (the last block's index from the model)."""
    last = len(model.visual_transformer_blocks) - 1
    return {"visual_transformer_blocks.0": {"vis": SPLIT_TOKENS},
            "visual_transformer_blocks.*": {"vis_rope": _VISUAL_ROPE},
            f"visual_transformer_blocks.{last}": (GATHER_TOKENS, None)}


KANDINSKY6 = FamilySpec(
    name="kandinsky6", model_classes=("Kandinsky6Transformer3DModel",), is_video=True,
    sharding_plan=kandinsky6_sharding_plan,
    attention_modules=("visual_transformer_blocks.*.video_dec_block.self_attention",),
    split_kv_attention_modules=("visual_transformer_blocks.*.av_cross_attention",), attention_call="dispatch",
    # The pipeline makes the conditional and the unconditional prediction as two calls.
    cfg_strategy="two_call",
    note="video split, text and audio whole; audio-to-video attention gathers the video K/V in every mode")
