"""Wan 2.1 / 2.2 (text-to-video, image-to-video, two-transformer MoE, TI2V) for sequence parallelism.

Wan's self-attention (``blocks.*.attn1``) runs over the video tokens only; text and the CLIP image
context enter through cross-attention (``attn2``), which needs no communication and is left alone.
The sharding plan is the model's own Diffusers ``_cp_plan``: split the RoPE tables and the first
block's hidden states along the tokens, split per-token timesteps (Wan 2.2 TI2V, ``timestep`` of
shape ``[B, S]``) at the model input, gather the output projection.
"""

from __future__ import annotations

import inspect

from diffusers.models._modeling_parallel import ContextParallelInput

from ..kernels.rope import rope_adjacent_pairs
from .spec import GATHER_TOKENS, SPLIT_TOKENS, FamilySpec, latent_grid_of

# ((WanAttnProcessor and its copies), the signature of its __call__): what the K/V-first hook mirrors
# and how it binds the processor's arguments. Wan Animate's module holds a copy of the class, kept
# equal to Wan's by Diffusers' "Copied from" check. Filled on first use, since importing Diffusers' Wan
# modules costs seconds (a plain global, not functools.lru_cache, which torch.compile warns about when
# tracing through it).
_WAN_PROCESSOR: tuple = ()


def _wan_processor() -> tuple:
    global _WAN_PROCESSOR
    if not _WAN_PROCESSOR:
        from diffusers.models.transformers import transformer_wan

        classes = (transformer_wan.WanAttnProcessor,)
        try:
            from diffusers.models.transformers import transformer_wan_animate
        except ImportError:  # a Diffusers release without Wan Animate
            pass
        else:
            classes += (transformer_wan_animate.WanAttnProcessor,)
        _WAN_PROCESSOR = (classes, inspect.signature(transformer_wan.WanAttnProcessor.__call__))
    return _WAN_PROCESSOR

# The plan Diffusers 0.42 ships as WanTransformer3DModel._cp_plan; used when a model lacks one.
#: Wan's RoPE tables ``[1, S, 1, D]`` (outputs of its ``rope``), split like the tokens.
WAN_ROPE = ContextParallelInput(split_dim=1, expected_dims=4, split_output=True)
_WAN_PLAN = {"rope": {0: WAN_ROPE, 1: WAN_ROPE}, "blocks.0": {"hidden_states": SPLIT_TOKENS}, "proj_out": GATHER_TOKENS,
             "": {"timestep": ContextParallelInput(split_dim=1, expected_dims=2, split_output=False)}}


#: Wan's patchified latent grid: ``hidden_states`` ``[B, C, F, H, W]`` over the config's patch size.
wan_latent_grid = latent_grid_of("BCFHW")
#: The video self-attention of every Wan block (Wan Animate's and SkyReels-V2's too).
WAN_ATTENTION = ("blocks.*.attn1",)


def wan_self_attention_kv_first(inner, attn, args: tuple, kwargs: dict, start_kv, finish_kv):
    """Wan's video self-attention (``attn1``) with K and V made, and their transfer started, before Q.

    Diffusers' ``WanAttnProcessor`` projects Q, K and V, normalizes and rotates Q then K, and only
    then calls the attention, so a sequence-parallel strategy that catches that call can move K and V
    only once all of it is done. This runs the same operations (projections, ``norm_k``/``norm_q``,
    RoPE, output projection: the model's own modules) in another order: K and V first, then
    ``start_kv``, then Q, whose projection, QK-norm and RoPE run on the GPU while K and V are in
    flight ("overlapping the K/V all-gather with the query projection"; with fused QKV projections,
    ``fuse_projections()``, the one GEMM makes Q too, and only Q's norm and RoPE overlap). The RoPE is
    :func:`~diffusers_sp.kernels.rope.rope_adjacent_pairs`: on CUDA one Triton kernel where the
    processor runs eight operations, the same bits. The output is bit-identical to the model's processor
    (``tests/test_wan_parallel.py`` compares them; ``tests/test_rope_kernel.py`` the RoPE kernel).
    Strategies without a transfer to start early (VSA) run it too, for the RoPE: their ``start_kv``
    holds K and V until the queries come.

    Args:
        inner: The model's processor; anything but a plain ``WanAttnProcessor`` (Wan's, or Wan
            Animate's copy of it) is declined.
        attn: The ``WanAttention`` module.
        args, kwargs: The processor call's arguments (``hidden_states`` ``[B, S_r, C]``,
            ``rotary_emb`` ``(cos, sin)`` of ``[1, S_r, 1, D]``).
        start_kv: ``(key, value) -> started``, both ``[B, H, S_r, D]``.
        finish_kv: ``(started, query, scale=None) -> [B, H, S_r, D]``.

    Returns:
        ``[B, S_r, C]``, the attention block's output; or ``NotImplemented`` for another processor
        class (a subclass included), cross-attention (encoder states given, or a module built as
        cross-attention), image-context (I2V) projections or an attention mask, which the model's
        processor then runs.
    """
    processor_classes, signature = _wan_processor()
    if (type(inner) not in processor_classes or getattr(attn, "add_k_proj", None) is not None
            or getattr(attn, "is_cross_attention", False)):
        return NotImplemented
    call = signature.bind(inner, attn, *args, **kwargs).arguments
    if call.get("encoder_hidden_states") is not None or call.get("attention_mask") is not None:
        return NotImplemented
    hidden_states, rotary_emb = call["hidden_states"], call.get("rotary_emb")
    if attn.fused_projections:
        query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
    else:
        query, key, value = None, attn.to_k(hidden_states), attn.to_v(hidden_states)
    key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
    value = value.unflatten(2, (attn.heads, -1))
    if rotary_emb is not None:
        key = rope_adjacent_pairs(key, *rotary_emb)
    started = start_kv(key.transpose(1, 2), value.transpose(1, 2))  # SDPA layout [B, H, S_r, D]
    if query is None:
        query = attn.to_q(hidden_states)
    query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
    if rotary_emb is not None:
        query = rope_adjacent_pairs(query, *rotary_emb)
    out = finish_kv(started, query.transpose(1, 2)).transpose(1, 2)  # [B, S_r, H, D]
    out = out.flatten(2, 3).type_as(query)
    return attn.to_out[1](attn.to_out[0](out))


WAN = FamilySpec(
    name="wan", model_classes=("WanTransformer3DModel",), is_video=True,
    # The model's Diffusers _cp_plan (or the 0.42 plan when absent), whose splits are made uneven-aware.
    sharding_plan=lambda model: dict(getattr(model, "_cp_plan", None) or _WAN_PLAN), attention_modules=WAN_ATTENTION,
    modes=("ulysses", "kv_gather", "vsa"), latent_grid=wan_latent_grid, self_attention_kv_first=wan_self_attention_kv_first,
    cfg_strategy="two_call",
    note="text in cross-attention; Wan 2.2's two transformers; TI2V per-token timesteps split; K and V made before Q")
