"""Helios (chunked text-to-video with a history of earlier chunks) for sequence parallelism.

``HeliosTransformer3DModel`` embeds the chunk being denoised and, before it, its history at three
scales (long, mid, short), so its blocks see one sequence ``[history; chunk]`` of ``L`` tokens with
one RoPE row ``[B, L, D]`` and one modulation row ``[B, L, 6, C]`` (``temb``, zero timestep for the
history) per token. Self-attention (``attn1``) runs over all of it; text enters through
cross-attention (``attn2``), which only the chunk's tokens make. The model's ``_cp_plan`` marks the
self-attention call (dispatch mode, see :mod:`diffusers_sp.pipelines.cp_plan`).

Sharding plan: Diffusers' ``_cp_plan`` (0.42) splits the inputs of every ``attn1``, ``attn2`` and
``ffn`` and gathers each of their outputs: three all-gathers of the hidden states per block, with
norms, modulation and residuals run on every token by every rank, for 40 blocks listed by index.
Here the sequence is split once, at the first block, with the same per-token split specs the plan
uses (``hidden_states`` and ``rotary_emb``, ``[B, L, C]``, dim 1), plus ``temb`` at every block, and
gathered once, at the last block's output (before ``norm_out``, which keeps the chunk's last
``original_context_length`` tokens of the full sequence). The blocks split their input into history
and chunk at ``original_context_length`` (cross-attention for the chunk only; with
``is_amplify_history``, the history keys scaled): it becomes this rank's share of the chunk
(:class:`~diffusers_sp.plan_entries.TailCount`). The split sequence is ``[history; chunk]``; every rank
holds a contiguous piece of it.
"""

from __future__ import annotations

from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

from ..plan_entries import TailCount
from ..errors import SequenceParallelConfigError
from .spec import FamilySpec
from .cp_plan import marked_attention_modules

# The per-token split specs of Diffusers' plan (its "blocks.*.attn1" entry), used when a model lacks one.
_TOKENS = ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)
_PLAN_ATTN1 = {"hidden_states": _TOKENS, "rotary_emb": _TOKENS}


def helios_patch_size(model) -> tuple[int, ...]:
    """Patch size of a ``HeliosTransformer3DModel`` from its config, frames first.

    Raises:
        SequenceParallelConfigError: a model with one block (the plan splits at the first block's input
            and gathers at the last block's output, which would be the same module).
    """
    if len(model.blocks) < 2:
        raise SequenceParallelConfigError(
            f"{type(model).__name__} with {len(model.blocks)} block: sequence parallelism splits the sequence at "
            f"the first block and gathers it after the last one, so it needs at least 2 blocks.")
    return tuple(int(p) for p in model.config.patch_size)


def helios_sharding_plan(model) -> dict:
    """Split ``hidden_states`` at ``blocks.0``; ``temb`` (``[B, L, 6, C]``), ``rotary_emb`` and
    ``original_context_length`` at every block; gather the last block's output (module docstring)."""
    attn1 = dict((getattr(model, "_cp_plan", None) or {}).get("blocks.*.attn1") or _PLAN_ATTN1)
    last = len(model.blocks) - 1
    return {
        "blocks.0": {"hidden_states": attn1["hidden_states"]},
        # rotary_emb first: its split gives the sequence length that original_context_length counts in.
        "blocks.*": {"rotary_emb": attn1["rotary_emb"],
                     "temb": ContextParallelInput(split_dim=1, expected_dims=4, split_output=False),
                     "original_context_length": TailCount()},
        f"blocks.{last}": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }


HELIOS = FamilySpec(
    name="helios", model_classes=("HeliosTransformer3DModel",), is_video=True, patch_size=helios_patch_size,
    sharding_plan=helios_sharding_plan, attention_modules=marked_attention_modules, attention_call="dispatch",
    note="history and chunk split as one sequence at the first block")
