"""Kandinsky 5 (text-to-video, image-to-video, text-to-image, image-to-image) for sequence parallelism.

``Kandinsky5Transformer3DModel`` first runs its text blocks (``text_transformer_blocks``: self-attention
over the text only, on every rank whole), then its visual blocks, whose self-attention
(``visual_transformer_blocks.*.self_attention``) holds only the video tokens; the text enters through
cross-attention, which needs no communication. There is no text mask (the text is cut to the batch's
longest prompt). ``Kandinsky5AttnProcessor`` passes its parallel config to every attention call it
makes, cross-attention and the text blocks included; only the visual self-attention modules are
wrapped, and each makes one call, so dispatch mode finds exactly the calls to split.

Sharding plan (explicit; Diffusers 0.42 ships no ``_cp_plan`` for this model): the visual tokens
exist as one sequence only inside the model's forward, after ``fractal_flatten`` (``[B, T, H, W, C]``
to ``[B, S, C]``) and before ``fractal_unflatten``, so the sequence is split at the first visual
block's ``visual_embed`` (``[B, S, C]``, dim 1) and every visual block's ``rope`` (``[B, S, 1, D/2,
2, 2]``, dim 1), and gathered at the last visual block's output; the output layer then runs whole.
The time embedding modulates per sample. The image-to-video and image-to-image pipelines join their
image latents and a mask along the channels.

Refused: NABLA sparse attention (``attention_type="nabla"``, Kandinsky 5 Pro): its block mask is
computed from pooled queries and keys of the whole sequence in its fractal order, which no rank
holds. VSA runs: the self-attention holds only video tokens and the latent grid is the input's
``[B, T, H, W, C]`` over the patch size (raster order, frames first).
"""

from __future__ import annotations

from diffusers.models._modeling_parallel import ContextParallelInput

from ..errors import SequenceParallelConfigError
from .spec import GATHER_TOKENS, SPLIT_TOKENS, FamilySpec, latent_grid_of

_NABLA = "NABLA sparse attention, whose block mask is computed from queries and keys of the whole sequence"


def kandinsky5_patch_size(model) -> tuple[int, ...]:
    """Patch size of a ``Kandinsky5Transformer3DModel`` from its config, frames first.

    Raises:
        SequenceParallelConfigError: NABLA attention (see the module docstring), or fewer than 2 visual
            blocks (the sequence is split at the first and gathered after the last).
    """
    cfg = model.config
    if cfg.attention_type == "nabla":
        raise SequenceParallelConfigError(
            f"{type(model).__name__} with attention_type='nabla' runs {_NABLA} (in its fractal token order), which "
            f"no rank holds under sequence parallelism. Kandinsky 5 models with attention_type='regular' run in "
            f"modes 'ulysses', 'kv_gather' and 'vsa'.")
    if len(model.visual_transformer_blocks) < 2:
        raise SequenceParallelConfigError(
            f"{type(model).__name__} with {len(model.visual_transformer_blocks)} visual block: sequence parallelism "
            f"splits the video tokens at the first visual block and gathers them after the last one, so it needs at "
            f"least 2.")
    return tuple(int(p) for p in cfg.patch_size)


def kandinsky5_sharding_plan(model) -> dict:
    """The explicit plan of the module docstring."""
    last = len(model.visual_transformer_blocks) - 1
    return {
        "visual_transformer_blocks.0": {"visual_embed": SPLIT_TOKENS},
        "visual_transformer_blocks.*": {"rope": ContextParallelInput(split_dim=1, expected_dims=6, split_output=False)},
        f"visual_transformer_blocks.{last}": GATHER_TOKENS,
    }


KANDINSKY5 = FamilySpec(
    name="kandinsky5", model_classes=("Kandinsky5Transformer3DModel",), is_video=True,
    patch_size=kandinsky5_patch_size, sharding_plan=kandinsky5_sharding_plan,
    attention_modules=("visual_transformer_blocks.*.self_attention",), modes=("ulysses", "kv_gather", "vsa"),
    latent_grid=latent_grid_of("BFHWC"), unsupported_inputs={"sparse_params": _NABLA}, attention_call="dispatch",
    note="video self-attention split between the first and the last visual block; NABLA attention refused")
