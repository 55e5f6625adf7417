"""HunyuanVideo (text-to-video) for sequence parallelism.

Joint attention with the text *after* the video tokens (``[video; text]``) in both the dual-stream
and the single-stream blocks, and a text key padding mask: the model builds ``[B, 1, 1, N]`` from
``encoder_attention_mask`` over ``N = video tokens + text tokens``. Since the split happens at the
patch embedding, the model builds that mask over *this rank's* video tokens plus the text, which
is what the processors expect (its video part is gathered with the keys). The token refiner
(``context_embedder``) runs its own text-only attention on every rank and is not touched; the
guidance embedding and pooled projections stay whole.

Sharding plan (explicit; Diffusers 0.42 ships no ``_cp_plan`` for this model): split the
output of ``x_embedder`` (``[B, S, C]``, dim 1) and the RoPE tables ``rope`` returns
(``[S, D]`` cos and sin, dim 0); gather ``proj_out``.

Models with ``image_condition_type="token_replace"`` (HunyuanVideo I2V) address the first frame's
tokens by position inside every block and are rejected.
"""

from __future__ import annotations

from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

from ..validation import SequenceParallelConfigError
from . import FamilySpec

_HUNYUAN_PLAN = {
    "x_embedder": {0: ContextParallelInput(split_dim=1, expected_dims=3, split_output=True)},
    "rope": {0: ContextParallelInput(split_dim=0, expected_dims=2, split_output=True),
             1: ContextParallelInput(split_dim=0, expected_dims=2, split_output=True)},
    "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
}


def hunyuan_video_patch_size(model) -> tuple[int, ...]:
    """Patch size of a ``HunyuanVideoTransformer3DModel`` from its config, frames first.

    Raises:
        SequenceParallelConfigError: ``image_condition_type="token_replace"`` (first-frame tokens
            are addressed by position in every block, which a sequence shard breaks).
    """
    cfg = model.config
    if getattr(cfg, "image_condition_type", None) == "token_replace":
        raise SequenceParallelConfigError(
            f"{type(model).__name__} with image_condition_type='token_replace' (HunyuanVideo image-to-video) "
            f"is not supported: its blocks address the first frame's tokens by position. Supported: "
            f"HunyuanVideoPipeline (text-to-video) in modes 'ulysses' and 'kv_gather'.")
    return (int(cfg.patch_size_t), int(cfg.patch_size), int(cfg.patch_size))


def hunyuan_video_sharding_plan(model) -> dict:
    """The explicit plan of the module docstring."""
    return dict(_HUNYUAN_PLAN)


def hunyuan_video_attention_modules(model) -> list:
    """``transformer_blocks.{i}.attn`` and ``single_transformer_blocks.{i}.attn`` (not the token refiner)."""
    return ([(f"transformer_blocks.{i}.attn", b.attn) for i, b in enumerate(model.transformer_blocks)]
            + [(f"single_transformer_blocks.{i}.attn", b.attn) for i, b in enumerate(model.single_transformer_blocks)])


HUNYUAN_VIDEO = FamilySpec(
    name="hunyuan_video",
    model_classes=("HunyuanVideoTransformer3DModel",),
    is_video=True,
    patch_size=hunyuan_video_patch_size,
    sharding_plan=hunyuan_video_sharding_plan,
    attention_modules=hunyuan_video_attention_modules,
    joint_text="suffix",
    text_mask=True,
    cfg_strategy="two_call",
    cfg_by_default=False,
)
