"""LongCat-Audio-DiT (text-to-audio, ``LongCatAudioDiTPipeline``) for sequence parallelism.

``LongCatAudioDiTTransformer`` (Diffusers 0.42, ``transformer_longcat_audio_dit.py``) embeds the 1-D audio
latents ``[B, S, C]`` and refines the text with ConvNeXt-V2 blocks, whose global response norm sums over
the text tokens (the text stays whole on every rank, so they run as in one process). Its blocks attend
over the audio with RoPE and a key padding mask ``[B, S]`` (also multiplied into the attention output),
then cross-attend to the text (local: this rank's audio queries over the whole text). A long skip adds the
embedded input back after the last block, and the final norm and projection are per token.

The RoPE tables ``[S, D]`` are made from the length of the tensor the model passes (its own ``[B, S, C]``),
so the split comes after them: ``hidden_states`` of ``blocks.0`` (``[B, S, C]``, dim 1), and at every
block its RoPE tables (dim 0) and ``mask`` (``[B, S]``, dim 1). The output of the last block is gathered,
before the long skip adds the whole input (a residual and a final layer that every rank then computes on
every token: one addition, one norm and one linear layer).
"""

from __future__ import annotations

from diffusers.models._modeling_parallel import ContextParallelInput

from .spec import GATHER_TOKENS, SPLIT_ROWS, SPLIT_TOKENS, FamilySpec

_PER_TOKEN = ContextParallelInput(split_dim=1, expected_dims=2, split_output=False)


def longcat_audio_sharding_plan(model) -> dict:
    """The plan of the module docstring (the last block's index from the model)."""
    return {"blocks.0": {"hidden_states": SPLIT_TOKENS},
            "blocks.*": {"mask": _PER_TOKEN, "rope": (SPLIT_ROWS, SPLIT_ROWS)},
            f"blocks.{len(model.blocks) - 1}": GATHER_TOKENS}


LONGCAT_AUDIO_DIT = FamilySpec(
    name="longcat_audio_dit", model_classes=("LongCatAudioDiTTransformer",), is_video=False,
    patch_size=lambda model: (1,), sharding_plan=longcat_audio_sharding_plan, attention_modules=("blocks.*.self_attn",),
    text_mask=True, attention_call="dispatch",
    # The pipeline makes the conditional and the unconditional prediction as two calls (no cache_context).
    cfg_strategy=None, note="1-D audio with its key padding mask; the text's ConvNeXt refiner whole on every rank")
