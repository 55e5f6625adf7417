"""NucleusMoE-Image (text-to-image) for sequence parallelism.

``NucleusMoEImageTransformer2DModel``'s blocks attend with the image tokens as the only queries over
``[image; text]`` keys and values (the text, or its cached K/V, enters as keys only, after the image, with
a key padding mask the model builds from the image length it sees): each rank's image queries over every
rank's image keys and the whole text, :class:`~diffusers_sp.processors.kv_gather.SuffixKVAttnProcessor`,
K/V-gather in every dense mode. Its mixture-of-experts layers route by *expert choice*: each expert
takes its top-C tokens of the whole image sequence, so a rank cannot route its shard alone; their inputs
are gathered (:class:`~diffusers_sp.plan_entries.GatherInput`), every rank routes all tokens as one
process does, and the output is split again. That costs one all-gather of two ``[B, S, C]`` tensors and
the expert work of every token on every rank, per MoE layer.

Sharding plan (Diffusers 0.42 ships no ``_cp_plan`` for it): split ``hidden_states`` (``[B, S, C]``, dim 1)
at the model input and the image RoPE table (``pos_embed``'s first output, ``[S, D/2]``, dim 0); around
each MoE layer, gather its inputs and split its output; gather ``proj_out``.
"""

from __future__ import annotations

from ..plan_entries import GatherInput
from ..processors.kv_gather import SuffixKVAttnProcessor
from .spec import GATHER_TOKENS, SPLIT_ROWS_OUT, SPLIT_TOKENS, SPLIT_TOKENS_OUT, FamilySpec

_WHOLE_FOR_ROUTING = {"hidden_states": GatherInput(1, 3), "hidden_states_unmodulated": GatherInput(1, 3),
                      0: SPLIT_TOKENS_OUT}


def nucleusmoe_plan(model) -> dict:
    """The plan above, with the gather around the MoE layer of every block that has one."""
    plan = {"": {"hidden_states": SPLIT_TOKENS},
            "pos_embed": {0: SPLIT_ROWS_OUT},
            "proj_out": GATHER_TOKENS}
    for i, block in enumerate(model.transformer_blocks):
        if block.moe_enabled:
            plan[f"transformer_blocks.{i}.img_mlp"] = dict(_WHOLE_FOR_ROUTING)
    return plan


NUCLEUSMOE_IMAGE = FamilySpec(
    name="nucleusmoe_image", model_classes=("NucleusMoEImageTransformer2DModel",), is_video=False,
    sharding_plan=nucleusmoe_plan, attention_modules=("transformer_blocks.*.attn",), text_mask=True,
    attention_processor=SuffixKVAttnProcessor,
    # Its pipeline (Diffusers 0.42) makes the two CFG calls outside cache_context("cond"/"uncond"), by which
    # CFG parallelism pairs them.
    cfg_strategy=None,
    note="text as keys after the image (K/V-gather in every mode); expert-choice MoE layers run on every token")
