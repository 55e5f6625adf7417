"""MiniMax-Music-3 (its modular text-to-music pipeline) for sequence parallelism.

``MiniMaxMusic3Transformer1DModel`` (Diffusers 0.42, ``transformer_minimax_music3.py``) joins the audio latents
and their frame-aligned condition along channels (a kernel-1 convolution and a linear layer: per frame),
puts the timestep embedding in front as one extra token, and runs self-attention blocks over ``[time;
audio]`` with partial RoPE (``(cos, sin)``, ``[L, D_rot]``) built from the whole length; every other
operation is per token. The sequence is split as a whole (the time token is its first token) at the first
block, with the RoPE tables at every block; the output of the last block is gathered before the model
drops the time token.
"""

from __future__ import annotations

from .spec import GATHER_TOKENS, SPLIT_ROWS, SPLIT_TOKENS, FamilySpec


def minimax_music3_sharding_plan(model) -> dict:
    """The plan of the module docstring (the last block's index from the model)."""
    return {"transformer_blocks.0": {"hidden_states": SPLIT_TOKENS},
            "transformer_blocks.*": {"rotary_emb": (SPLIT_ROWS, SPLIT_ROWS)},
            f"transformer_blocks.{len(model.transformer_blocks) - 1}": GATHER_TOKENS}


MINIMAX_MUSIC3 = FamilySpec(
    name="minimax_music3", model_classes=("MiniMaxMusic3Transformer1DModel",), is_video=False,
    patch_size=lambda model: (1,), sharding_plan=minimax_music3_sharding_plan,
    attention_modules=("transformer_blocks.*.attn",), attention_call="dispatch",
    note="modular pipeline only; 1-D audio after one time token, split as one sequence")
