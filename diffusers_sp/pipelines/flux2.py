"""Flux.2 (dev, Klein) for sequence parallelism.

``Flux2Transformer2DModel``'s attention is joint, text first: the dual-stream blocks concatenate
``[text; image]`` inside ``Flux2AttnProcessor`` and the single-stream blocks get the concatenation as
one sequence, so the text is a *prefix* of every self-attention sequence. The pipelines pad the
prompts to ``max_sequence_length`` and pass no text mask (the padding is attended to, as in one
process). The RoPE table is computed from ``cat(txt_ids, img_ids)``; splitting ``img_ids`` at the model
input makes it cover exactly ``[text; this rank's image tokens]``. Reference images (Flux2Pipeline,
Klein, Klein inpainting) are appended to the image tokens and split with them. The processors mark
their attention call for context parallelism (dispatch mode, see :mod:`diffusers_sp.pipelines.cp_plan`).

Sharding plan: the model's Diffusers ``_cp_plan`` without its text entries (``encoder_hidden_states``,
``txt_ids``): split ``hidden_states`` (``[B, S, C]``, dim 1) and ``img_ids`` (the pipelines'
``[B, S, 4]``, dim 1, or ``[S, 4]``, dim 0, which the forward also takes) at the model input, gather
``proj_out``.

Refused: the reference-image K/V cache of ``Flux2KleinKVPipeline`` (``kv_cache_mode``). Its first
step runs ``[text; reference; image]`` with the reference queries attending only to the reference keys
(a mask that depends on the query) and stores the reference K and V; later steps put the stored K/V
between the text and the image keys (more keys than queries). Both attention calls are made by a
Diffusers helper outside the processor's marked call, so each rank would attend to its own tokens
only. A forward with ``kv_cache_mode`` is refused on every rank before any collective in it (the
pipeline without reference images makes ordinary calls, which run).
"""

from __future__ import annotations

from diffusers.models._modeling_parallel import ContextParallelInput

from ..plan_entries import SplitByDims
from .spec import GATHER_TOKENS, SPLIT_ROWS, SPLIT_TOKENS, FamilySpec, model_plan
from .cp_plan import marked_attention_modules

_TEXT_ENTRIES = {"": ("encoder_hidden_states", "txt_ids")}
_IMG_IDS = SplitByDims((ContextParallelInput(split_dim=1, expected_dims=3, split_output=False),
                        SPLIT_ROWS))
# The 0.42 plan minus its text entries, used when a model lacks ``_cp_plan``.
_FLUX2_PLAN = {"": {"hidden_states": SPLIT_TOKENS, "img_ids": _IMG_IDS}, "proj_out": GATHER_TOKENS}


def flux2_sharding_plan(model) -> dict:
    """The model's ``_cp_plan`` without its text entries; ``img_ids`` split in either layout."""
    return model_plan(model, _FLUX2_PLAN, _TEXT_ENTRIES, {"img_ids": _IMG_IDS})


FLUX2 = FamilySpec(
    name="flux2", model_classes=("Flux2Transformer2DModel",), is_video=False,
    sharding_plan=flux2_sharding_plan, attention_modules=marked_attention_modules,
    joint_text="prefix", attention_call="dispatch",
    unsupported_inputs={
        "kv_cache_mode": "Flux2KleinKVPipeline's reference-image K/V cache: its reference tokens attend only to "
                         "themselves, and their cached K and V join the keys outside the split attention call; the "
                         "pipeline runs without reference images, run it without sequence parallelism for them"},
    note="text first; reference-image tokens split with the image")
