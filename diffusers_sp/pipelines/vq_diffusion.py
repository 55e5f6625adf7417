"""VQ-Diffusion (discrete diffusion over VQ token ids; Diffusers' deprecated pipeline) for sequence
parallelism.

Its transformer is Diffusers' generic ``Transformer2DModel`` with *vectorized* inputs: token ids embedded
with learned height and width positions (``latent_image_embedding``), ``BasicTransformerBlock`` layers
(self-attention over the image tokens, ``attn1``; cross-attention to the CLIP text, left whole; a per-token
MLP), and per-token logits over the codebook (``out``, then a log-softmax over the classes). The other
input kinds of ``Transformer2DModel`` (continuous or patched latents) are not covered: the family refuses
them in one line.

Sharding plan: split the output of ``latent_image_embedding`` (``[B, S, C]``, dim 1), gather ``out``.
"""

from __future__ import annotations

from ..errors import SequenceParallelConfigError
from .spec import GATHER_TOKENS, SPLIT_TOKENS_OUT, FamilySpec


def vq_diffusion_patch_size(model) -> tuple[int, int]:
    """``(1, 1)``: one token per VQ code.

    Raises:
        SequenceParallelConfigError: a ``Transformer2DModel`` of continuous or patched inputs.
    """
    if not getattr(model, "is_input_vectorized", False):
        raise SequenceParallelConfigError(
            f"{type(model).__name__} with continuous or patched inputs is not parallelized (diffusers-sp runs this "
            f"class with VQ-Diffusion's token-id inputs only); pass the pipeline's transformer of another family.")
    return (1, 1)


VQ_DIFFUSION = FamilySpec(
    name="vq_diffusion", model_classes=("Transformer2DModel",), is_video=False,
    sharding_plan={"latent_image_embedding": {0: SPLIT_TOKENS_OUT},
                   "out": GATHER_TOKENS},
    attention_modules=("transformer_blocks.*.attn1",), patch_size=vq_diffusion_patch_size, cfg_strategy="batch",
    note="token-id inputs only; text in cross-attention only")
