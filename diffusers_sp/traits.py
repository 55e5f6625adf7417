"""Traits of a pipeline or model: what sequence parallelism needs to know before it installs anything.

Traits are read from the model's config and classes (never guessed from a name alone) by the
family module in :mod:`diffusers_sp.pipelines` that claims the pipeline or model.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelTraits:
    """What one transformer looks like to the sequence-parallel planner.

    Attributes:
        name: The model's class name, e.g. ``"WanTransformer3DModel"``.
        attribute: Where the pipeline holds it (``"transformer"``, ``"transformer_2"``), or ``""``
            for a bare model.
        num_heads: Attention heads H of the split self-attention.
        head_dim: Head dimension D.
        is_video: True when the token sequence is a patchified video latent (T, H, W) grid.
        patch_size: Patch size of the patch embedding, frames first for video: ``(p_t, p_h, p_w)``
            for video, ``(p_h, p_w)`` for images.
        joint_text: Where text tokens sit inside the self-attention sequence: ``None`` (text only
            in cross-attention), ``"prefix"`` or ``"suffix"``.
        text_mask: True when the model takes a key padding mask for the text tokens.
        num_attention_layers: Number of self-attention modules that get a sequence-parallel processor.
    """

    name: str
    attribute: str
    num_heads: int
    head_dim: int
    is_video: bool
    patch_size: tuple[int, ...]
    joint_text: str | None
    text_mask: bool
    num_attention_layers: int


@dataclass(frozen=True)
class PipelineTraits:
    """Traits of a whole pipeline (or of one bare model, then ``models`` has one entry).

    Attributes:
        name: The pipeline's class name, or the model's for a bare model.
        family: Family module name, e.g. ``"wan"``.
        is_video: True for video pipelines.
        models: Traits of every transformer that will be parallelized (Wan 2.2 has two).
    """

    name: str
    family: str
    is_video: bool
    models: tuple[ModelTraits, ...]

    def fingerprint(self) -> tuple:
        """A hashable summary compared across ranks to catch ranks that loaded different models."""
        return (self.name, self.family, tuple((m.attribute, m.name, m.num_heads, m.head_dim, m.patch_size,
                                               m.joint_text, m.text_mask, m.num_attention_layers)
                                              for m in self.models))
