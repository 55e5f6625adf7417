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

Image-to-video. ``image_condition_type="latent_concat"`` joins the image latents along channels
and needs nothing more. ``"token_replace"`` (HunyuanVideo I2V) puts the image's latent frame first
and every block modulates the first frame's tokens with their own (timestep 0) embedding: the
model passes each block their count, ``num_tokens`` (positional), and the block slices its tokens
at it (Diffusers 0.42, ``HunyuanVideoTokenReplaceTransformerBlock`` and its single-stream twin). Those tokens lead the sequence, so on every rank they are a leading part of its shard; the
plan hands each block this rank's part of the count (:class:`~diffusers_sp.plan_entries.PrefixCount`),
and the blocks' slicing then selects exactly this rank's first-frame tokens.
"""

from __future__ import annotations

from ..plan_entries import PrefixCount
from .flux import FLUX_ATTENTION
from .spec import GATHER_TOKENS, SPLIT_ROWS_OUT, SPLIT_TOKENS_OUT, FamilySpec

_HUNYUAN_PLAN = {
    "x_embedder": {0: SPLIT_TOKENS_OUT},
    "rope": {0: SPLIT_ROWS_OUT, 1: SPLIT_ROWS_OUT},
    "proj_out": GATHER_TOKENS,
}
# image_condition_type="token_replace": the first frame's token count each block receives.
_TOKEN_REPLACE = {"transformer_blocks.*": {"num_tokens": PrefixCount()},
                  "single_transformer_blocks.*": {"num_tokens": PrefixCount()}}


def hunyuan_video_sharding_plan(model) -> dict:
    """The explicit plan of the module docstring (with the token-replace entries for such a model)."""
    plan = dict(_HUNYUAN_PLAN)
    if getattr(model.config, "image_condition_type", None) == "token_replace":
        plan.update(_TOKEN_REPLACE)
    return plan


HUNYUAN_VIDEO = FamilySpec(
    name="hunyuan_video", model_classes=("HunyuanVideoTransformer3DModel",), is_video=True,
    sharding_plan=hunyuan_video_sharding_plan, attention_modules=FLUX_ATTENTION,
    joint_text="suffix", text_mask=True, cfg_strategy="two_call", cfg_by_default=False,
    note="text after the video; token_replace's first-frame count split per rank")
