"""PRX (text-to-image, latent and pixel space) for sequence parallelism.

``PRXTransformer2DModel``'s blocks attend with the image tokens as the only queries and ``[text; image]``
as keys and values (the text enters as keys only, with its key padding mask; the processor joins the
mask with ones over the image keys it holds). That is
:class:`~diffusers_sp.processors.kv_gather.PrefixKVAttnProcessor`'s split-query call: each rank's image
queries over the whole text keys and every rank's image keys, by K/V-gather in every dense mode (Ulysses
would exchange query rows that hold only part of the keys' tokens).

Sharding plan (Diffusers 0.42 ships no ``_cp_plan`` for it): split the output of ``img_in`` (``[B, S, C]``,
dim 1) and the RoPE table made from the image ids (``pe_embedder``'s output ``[B, 1, S, D/2, 2, 2]``,
dim 2); gather ``final_layer`` (the model unpatchifies after it). The text and timestep stay whole.
"""

from __future__ import annotations

from diffusers.models._modeling_parallel import ContextParallelInput

from ..processors.kv_gather import PrefixKVAttnProcessor
from .spec import GATHER_TOKENS, SPLIT_TOKENS_OUT, FamilySpec

PRX = FamilySpec(
    name="prx", model_classes=("PRXTransformer2DModel",), is_video=False,
    sharding_plan={"img_in": {0: SPLIT_TOKENS_OUT},
                   "pe_embedder": {0: ContextParallelInput(split_dim=2, expected_dims=6, split_output=True)},
                   "final_layer": GATHER_TOKENS},
    attention_modules=("blocks.*.attention",), text_mask=True, attention_processor=PrefixKVAttnProcessor,
    cfg_strategy="batch", note="text as keys only, with its key padding mask (K/V-gather in every mode)")
