"""Sana / Sana 1.5 / Sana Sprint (text-to-image, img2img, ControlNet) for sequence parallelism.

``SanaTransformer2DModel`` (Diffusers 0.42, ``sana_transformer.py``) differs from the softmax DiTs in
two ways that decide what sequence parallelism is here:

* Its self-attention (``attn1``, ``SanaLinearAttnProcessor2_0``) is linear attention with a ReLU
  kernel: ``out_i = phi(q_i) (Σ_j phi(k_j)ᵀ v_j) / (phi(q_i) · Σ_j phi(k_j))``. Both sums over the keys
  are independent of the query, so each rank sums its own tokens and one all-reduce of a
  ``[B, H, D + 1, D]`` state per layer completes them (:mod:`diffusers_sp.processors.linear`); the
  queries never move, and neither K/V nor heads travel. "ulysses" and "kv_gather" both run this
  scheme (it moves less than either, independent of the sequence length). The text enters through
  cross-attention (``attn2``: image queries, text keys, with the text mask), which needs nothing.
* Its feed-forward (``GLUMBConv``) is convolutional: 1 x 1, then 3 x 3 depthwise, then 1 x 1
  convolutions over the 2-D token grid (the block reshapes its tokens with ``unflatten(1, (height,
  width))``). A token's output depends on its 8 neighbours, which lie on other ranks at a shard's
  edges. The blocks' ``height`` / ``width`` arguments are replaced by ``(S_r, 1)``
  (:class:`~diffusers_sp.grid_window.GridSide`), so that the reshape keeps the shard as one column, and the
  feed-forward runs on whole rows around the shard, completed with one row of neighbours above and
  below (:class:`~diffusers_sp.grid_window.GridWindow`: one small all-gather of shard ends per block;
  the halo rows' feed-forward is computed twice, by both ranks that need it).

Sharding plan (no Diffusers ``_cp_plan``): split the output of ``patch_embed`` (``[B, S, C]``, dim 1;
the sin-cos position embedding of Sana 1.0 is added inside it, before the split), the ControlNet
residuals (a tuple of ``[B, S, C]``, one per block, added to the image tokens), the grid sides of
every block and the window of every block's ``ff``; gather ``proj_out`` (``[B, S, p * p * C]``). The
ControlNet (``SanaControlNetModel``) runs whole on every rank. Timesteps, guidance (Sana Sprint) and
the text stay whole.

Sana's PAG pipeline puts perturbed-attention processors on its PAG layers' self-attention for each call
(``PAGCFGSanaLinearAttnProcessor2_0`` with CFG, ``PAGIdentitySanaLinearAttnProcessor2_0`` without):
they are wrapped at the next forward (:attr:`~diffusers_sp.pipelines.FamilySpec.swapped_processors`).
Each makes one linear attention over the batch's unperturbed samples (its sums all-reduced as above)
and an identity "attention" (the value projection of each token) for the perturbed ones, which is per
token.
"""

from __future__ import annotations

from diffusers.models._modeling_parallel import ContextParallelOutput

from ..processors.linear import LinearAttnProcessor
from ..grid_window import GridSide, GridWindow
from .spec import CONTROLNET_RESIDUALS, SPLIT_TOKENS_OUT, FamilySpec


def sana_sharding_plan(model) -> dict:
    """The plan of the module docstring (a grid window per block's feed-forward)."""
    plan = {
        "": {"controlnet_block_samples": CONTROLNET_RESIDUALS},
        "patch_embed": {0: SPLIT_TOKENS_OUT},
        "transformer_blocks.*": {"height": GridSide("height"), "width": GridSide("width")},
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }
    for i in range(len(model.transformer_blocks)):
        plan[f"transformer_blocks.{i}.ff"] = GridWindow(halo=1)  # a 3 x 3 depthwise convolution inside
    return plan


SANA = FamilySpec(
    name="sana", model_classes=("SanaTransformer2DModel",), is_video=False,
    sharding_plan=sana_sharding_plan, attention_modules=("transformer_blocks.*.attn1",),  # attn2: the text
    attention_processor=LinearAttnProcessor,
    swapped_processors=("PAGCFGSanaLinearAttnProcessor2_0", "PAGIdentitySanaLinearAttnProcessor2_0"),
    note="linear attention: its key sums all-reduced; the convolutional feed-forward gets its neighbour rows")
