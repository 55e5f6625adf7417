"""SkyReels-V2 (text-to-video, image-to-video, diffusion forcing) for sequence parallelism.

``SkyReelsV2Transformer3DModel`` is Wan 2.1 with diffusion forcing (Diffusers 0.42): the
self-attention (``blocks.*.attn1``) runs over the video tokens only, text and the CLIP image context
enter through cross-attention (``attn2``), which needs no communication and is left alone. Its
processor hands ``dispatch_attention_fn`` its ``_parallel_config`` for the self-attention call, so the
family runs in dispatch mode. Diffusers ships no ``_cp_plan`` for it; the plan is written out here.

Diffusion forcing (``enable_diffusion_forcing=True``, the ``SkyReelsV2DiffusionForcing*`` pipelines)
brings two things that depend on the token:

* per-frame timesteps (``timestep`` ``[B, F]``), which the model repeats to one modulation per token:
  the blocks get ``temb`` ``[B, 6, S, C]``, split along the tokens with them (``blocks.*``). The
  model's final modulation (``shift``, ``scale`` ``[B, S, C]``) is computed inline in its forward, not
  by a module, so it cannot be split: the hidden states are gathered after the last block instead
  (in the model's dtype, ``B x S x C`` once per forward), and the final norm, modulation and output
  projection (per token) run on the whole sequence on every rank.
* with ``causal_block_size > 1``, a block-causal frame mask ``[1, 1, S, S]`` (a query attends its own
  block of frames and the earlier ones) that the model builds over the full sequence before the
  split: applied exactly by the processors (K/V-gather takes the rows of its queries, Ulysses the
  whole mask; :mod:`diffusers_sp.processors.base`).

VSA runs on the latent grid read as in Wan; a forward with the block-causal mask is refused by VSA at
the call (VSA tiles cannot follow the mask).
"""

from __future__ import annotations

from diffusers.models._modeling_parallel import ContextParallelInput

from .spec import GATHER_TOKENS, SPLIT_TOKENS, FamilySpec
from .wan import WAN_ATTENTION, WAN_ROPE, wan_latent_grid

#: The blocks' modulation under diffusion forcing, ``[B, 6, S, C]``; the 3-D ``[B, 6, C]`` of one
#: timestep per sample passes whole.
_SPLIT_PER_TOKEN_TEMB = ContextParallelInput(split_dim=2, expected_dims=4, split_output=False)


def skyreels_v2_sharding_plan(model) -> dict:
    """Split the RoPE tables (outputs of ``rope``, ``[1, S, 1, D]``) and the first block's hidden states
    (``[B, S, C]``), the blocks' per-token modulation (``temb`` ``[B, 6, S, C]``, diffusion forcing), and
    gather the last block's output (see the module docstring); a one-block model gathers ``norm_out``'s
    (float32) instead, since ``blocks.0`` holds the split entry."""
    last = len(model.blocks) - 1
    gather_at = f"blocks.{last}" if last > 0 else "norm_out"
    return {
        "rope": {0: WAN_ROPE, 1: WAN_ROPE},
        "blocks.0": {"hidden_states": SPLIT_TOKENS},
        "blocks.*": {"temb": _SPLIT_PER_TOKEN_TEMB},
        gather_at: GATHER_TOKENS,
    }


SKYREELS_V2 = FamilySpec(
    name="skyreels_v2", model_classes=("SkyReelsV2Transformer3DModel",), is_video=True,
    sharding_plan=skyreels_v2_sharding_plan, attention_modules=WAN_ATTENTION, modes=("ulysses", "kv_gather", "vsa"),
    latent_grid=wan_latent_grid, attention_call="dispatch", cfg_strategy="two_call",
    note="diffusion forcing: per-frame modulation split with the tokens, block-causal frame mask applied exactly")
