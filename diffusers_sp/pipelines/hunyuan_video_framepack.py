"""HunyuanVideo Framepack (image-to-video in sections, with a history of clean frames) for sequence parallelism.

``HunyuanVideoFramepackTransformer3DModel`` embeds the latents being denoised and, before them, the
history: the clean latents (the first image and the last frame generated, 1x), two frames at 2x
compression and the older frames at 4x (``clean_x_embedder``, one RoPE table per part, downsampled
for the compressed ones). Its ``_pack_history_states`` joins them into one sequence
``[history 4x; history 2x; clean; latents]`` of ``S`` tokens with one RoPE row each, and every block
attends over all of them with the text (the SigLIP image tokens and the Llama tokens) after them
(``[video; text]``), as HunyuanVideo's blocks do. The blocks are HunyuanVideo's; their processor
marks its attention call (dispatch mode).

Sharding plan (explicit; Diffusers 0.42 ships no ``_cp_plan`` for this model): the joined sequence
exists only inside the model's forward, between ``_pack_history_states`` (a method, not a module)
and the first block, so it is split at the first block's input (``hidden_states``, ``[B, S, C]``,
dim 1) and every block's RoPE tables (``[S, D]`` cos and sin, dim 0: the model passes the full
tables to every block), and gathered at the last block's output (``[B, S, C]``, dim 1), before the
model keeps the latents' tokens (the last ones) for ``norm_out``. All ``S`` tokens (history and
latents) are split alike, so a rank's shard may hold history tokens, latents' tokens or both. With a
batch of more than one sample, the model builds the key padding mask ``[B, 1, 1, S + T]`` over the
whole ``[video; text]`` sequence before the split and hands it to every block: its video part is split
there like the tokens, its text part stays whole (:class:`~diffusers_sp.plan_entries.JointSequence`), so
the processors get this rank's key padding mask. With one sample the model drops the text padding
instead and passes no mask.
"""

from __future__ import annotations

from diffusers.models._modeling_parallel import ContextParallelInput

from ..plan_entries import JointSequence
from ..errors import SequenceParallelConfigError
from .flux import FLUX_ATTENTION
from .spec import GATHER_TOKENS, SPLIT_ROWS, SPLIT_TOKENS, FamilySpec

_ROPE = [SPLIT_ROWS] * 2
# [B, 1, 1, S + T]: the video's keys, then the text's (after the RoPE split in the same entry, which sets S).
_MASK = JointSequence(ContextParallelInput(split_dim=3, expected_dims=4, split_output=False), text="suffix")
# A block returns (hidden_states, encoder_hidden_states): the first is gathered, the text stays.
_GATHER = [GATHER_TOKENS, None]


def _blocks(model) -> list[tuple[str, str]]:
    """``(block name, name of its RoPE argument)`` of every block in the order the model runs them."""
    return ([(f"transformer_blocks.{i}", "freqs_cis") for i in range(len(model.transformer_blocks))]
            + [(f"single_transformer_blocks.{i}", "image_rotary_emb") for i in range(len(model.single_transformer_blocks))])


def framepack_patch_size(model) -> tuple[int, ...]:
    """Patch size of the latents' embedding, frames first (the history's are fixed: 1x, 2x, 4x of it).

    Raises:
        SequenceParallelConfigError: a model with fewer than 2 blocks (the sequence is split at the
            first block's input and gathered at the last block's output) or without the history
            embedding (``has_clean_x_embedder``), which its forward needs.
    """
    cfg = model.config
    if len(_blocks(model)) < 2 or model.clean_x_embedder is None:
        raise SequenceParallelConfigError(
            f"{type(model).__name__} with {len(_blocks(model))} block(s) and has_clean_x_embedder="
            f"{cfg.has_clean_x_embedder}: sequence parallelism splits the joined history and latents at the first "
            f"block and gathers them after the last one, so it needs at least 2 blocks and the history embedding.")
    return (int(cfg.patch_size_t), int(cfg.patch_size), int(cfg.patch_size))


def framepack_sharding_plan(model) -> dict:
    """Split ``hidden_states`` at the first block, the RoPE tables and the mask's video part at every
    block; gather the last block's hidden states (see the module docstring)."""
    blocks = _blocks(model)
    plan = {"transformer_blocks.*": {"freqs_cis": _ROPE, "attention_mask": _MASK},
            "single_transformer_blocks.*": {"image_rotary_emb": _ROPE, "attention_mask": _MASK}}
    plan[blocks[0][0]] = {"hidden_states": SPLIT_TOKENS}
    plan[blocks[-1][0]] = _GATHER
    return plan


HUNYUAN_VIDEO_FRAMEPACK = FamilySpec(
    name="hunyuan_video_framepack", model_classes=("HunyuanVideoFramepackTransformer3DModel",), is_video=True,
    patch_size=framepack_patch_size, sharding_plan=framepack_sharding_plan, attention_modules=FLUX_ATTENTION,
    joint_text="suffix", text_mask=True, attention_call="dispatch",
    note="history (clean frames at 1x, 2x, 4x) and latents split as one sequence at the first block")
