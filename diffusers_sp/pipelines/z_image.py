"""Z-Image (text-to-image, img2img, inpaint, ControlNet, Omni) for sequence parallelism.

``ZImageTransformer2DModel`` (Diffusers 0.42, ``transformer_z_image.py``) takes lists: one latent
``[C, F, H, W]`` per sample (Omni: a list of condition latents and the target per sample) and one
caption ``[T_i, C_cap]`` per sample. Inside its forward it patchifies each image and pads it to a
multiple of 32 tokens (``SEQ_MULTI_OF``; the padding tokens are a learned pad token and are attended
to), refines the image tokens (``noise_refiner``) and the caption (``context_refiner``) apart, then
joins them per sample into one sequence, ``[image; caption]`` (Omni: ``[captions; images;
SigLIP tokens]``), each part padded to a multiple of 32, and pads the batch to its longest sample
with a key padding mask ``[B, L]`` (``None`` when all samples have the same length). The main
``layers`` run over that unified sequence; the final layer and the unpatchify read it back.

What is split: the unified sequence of the main layers as a whole, caption and padding included.
Every token there is treated alike (one modulation for all, or per token from the Omni noise mask),
so no text needs to stay replicated, and its key padding mask is split with the tokens and gathered
by the processors like an image key mask (``processors/base.py``). The refiners before it run whole
on every rank: 2 image and 2 caption blocks beside the 30 main layers of the released model (and 2
SigLIP blocks in Omni); their image tokens are a sequence of another length, and the per-forward
check of :class:`~diffusers_sp.sharding.SequenceSplitHook` allows one length per forward. Z-Image's ControlNet
shares those refiner modules with the transformer (``ZImageControlNetModel.from_transformer``), and
runs whole on every rank too. Its residuals, ``{layer index: [B, L, C]}`` over the same unified
sequence, are split with it (:data:`~diffusers_sp.pipelines.CONTROLNET_RESIDUALS`).

Because every part is padded to a multiple of 32, the split length is a multiple of 32: it divides
evenly over 2 ranks (and any power of two up to 32), unevenly over 3.

Sharding plan (no Diffusers ``_cp_plan``): split ``x`` of ``layers.0`` (``[B, L, C]``, dim 1), and at
every layer its ``attn_mask`` (``[B, L]``), ``freqs_cis`` (``[B, L, D/2]`` complex) and the Omni
``noise_mask`` (``[B, L]``, which picks each token's modulation: the per-token timestep of Omni's
clean condition images and noisy target); the final layer's ``noise_mask``; gather the output of the
final layer's ``linear`` (``[B, L, p * p * C]``). Attention in dispatch mode: Diffusers'
``ZSingleStreamAttnProcessor`` passes its ``_parallel_config`` to ``dispatch_attention_fn`` for its one
attention call, and only the main layers' processors are wrapped.
"""

from __future__ import annotations

from diffusers.models._modeling_parallel import ContextParallelInput

from .spec import CONTROLNET_RESIDUALS, GATHER_TOKENS, SPLIT_TOKENS, FamilySpec

_PER_TOKEN = ContextParallelInput(split_dim=1, expected_dims=2, split_output=False)


def z_image_patch_size(model) -> tuple[int, ...]:
    """The spatial patch size of a ``ZImageTransformer2DModel``: the first of ``all_patch_size`` (the
    pipelines call the model with its default ``patch_size=2``, the released config's only entry)."""
    return (int(model.config.all_patch_size[0]),) * 2


def z_image_sharding_plan(model) -> dict:
    """The plan of the module docstring (one gather per final layer of ``all_final_layer``)."""
    plan = {
        "": {"controlnet_block_samples": CONTROLNET_RESIDUALS},
        "layers.0": {"x": SPLIT_TOKENS},
        "layers.*": {"attn_mask": _PER_TOKEN, "freqs_cis": SPLIT_TOKENS, "noise_mask": _PER_TOKEN},
        "all_final_layer.*": {"noise_mask": _PER_TOKEN},
    }
    for key in model.all_final_layer:
        plan[f"all_final_layer.{key}.linear"] = GATHER_TOKENS
    return plan


Z_IMAGE = FamilySpec(
    name="z_image", model_classes=("ZImageTransformer2DModel",), is_video=False,
    patch_size=z_image_patch_size, sharding_plan=z_image_sharding_plan, attention_modules=("layers.*.attention",),
    text_mask=True, attention_call="dispatch",
    note="the unified [image; caption] sequence split as a whole; refiners whole on every rank")
