"""Model families: one module per family with its traits and its sharding plan.

:data:`FAMILIES` is the registry that :func:`diffusers_sp.enable_sequence_parallel` looks pipelines
and models up in; the README's table of supported pipelines is checked against it by a test.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..traits import ModelTraits
from ..validation import SequenceParallelConfigError


@dataclass(frozen=True)
class FamilySpec:
    """How one model family is parallelized.

    Attributes:
        name: Family name (module name in this package), e.g. ``"wan"``.
        pipeline_classes: Diffusers pipeline class names the family supports.
        model_classes: Transformer class names the family supports.
        is_video: Whether the family's latents are videos.
        patch_size: ``model -> (p_t, p_h, p_w)`` (video) or ``(p_h, p_w)`` (image), read from the
            model's config; may raise SequenceParallelConfigError for a config the family cannot run.
        sharding_plan: ``model -> plan`` in ``_cp_plan`` format (see :mod:`diffusers_sp.sharding`).
        attention_modules: ``model -> [(qualified name, module)]``: the self-attention modules whose
            processors are wrapped (cross-attention is left alone).
        transformer_attributes: Pipeline attributes that may hold a transformer to parallelize.
        joint_text: Where text tokens sit in the family's self-attention sequence: ``None`` (text
            only in cross-attention, or no text), ``"prefix"`` or ``"suffix"`` (for the README table;
            copied into every model's :class:`ModelTraits`).
        text_mask: Whether the family applies a text key padding mask (ragged prompts).
        modes: Sequence-parallel modes that run exactly for the family (README table, tests).
        latent_grid: ``(model, args, kwargs) -> (T, H, W)``: the patchified latent grid of a forward
            call, in patches (video families; needed by VSA). ``None``: the grid cannot be read.
        self_attention_kv_first: ``None`` or the family's self-attention processor rewritten to make
            K and V before Q, so that the K/V transfer of either dense mode overlaps the query's work
            (``overlap_query_projection``; see
            :class:`~diffusers_sp.processors.base.SequenceParallelAttnProcessor`, ``kv_first``).
        unsupported_inputs: ``{forward argument: what it is}``: arguments the family's plan does not
            split (e.g. ControlNet residuals over every image token); a forward passing one that is
            not ``None`` raises SequenceParallelConfigError on every rank, before any collective.
    """

    name: str
    pipeline_classes: tuple[str, ...]
    model_classes: tuple[str, ...]
    is_video: bool
    patch_size: Callable[[torch.nn.Module], tuple[int, ...]]
    sharding_plan: Callable[[torch.nn.Module], dict]
    attention_modules: Callable[[torch.nn.Module], list]
    transformer_attributes: tuple[str, ...] = ("transformer",)
    joint_text: str | None = None
    text_mask: bool = False
    modes: tuple[str, ...] = ("ulysses", "kv_gather")
    latent_grid: Callable | None = None
    self_attention_kv_first: Callable | None = None
    unsupported_inputs: dict = field(default_factory=dict)

    def model_traits(self, model: torch.nn.Module, attribute: str) -> ModelTraits:
        """The :class:`~diffusers_sp.traits.ModelTraits` of ``model`` (held as ``attribute`` by its
        pipeline, ``""`` for a bare model): heads and head dim from the config (every supported
        family names them ``num_attention_heads`` / ``attention_head_dim``), the rest from this spec.

        Raises:
            SequenceParallelConfigError: from :attr:`patch_size`, for a config the family cannot run.
        """
        cfg = model.config
        return ModelTraits(
            name=type(model).__name__, attribute=attribute, num_heads=int(cfg.num_attention_heads),
            head_dim=int(cfg.attention_head_dim), is_video=self.is_video, patch_size=self.patch_size(model),
            joint_text=self.joint_text, text_mask=self.text_mask,
            num_attention_layers=len(self.attention_modules(model)))


def plan_without(plan: dict, drop: dict) -> dict:
    """A copy of a ``_cp_plan`` without the entries that split text tokens.

    Diffusers' context-parallel plans shard the text as well; diffusers-sp keeps the text replicated
    on every rank and shards only image/video tokens, so the text entries are dropped.

    Args:
        plan: A plan in ``_cp_plan`` format (see :mod:`diffusers_sp.sharding`).
        drop: ``{submodule name: [argument names or output indices to remove]}``; a submodule whose
            entry becomes empty is removed.

    Returns:
        The filtered plan (the input is not modified).
    """
    out = {}
    for name, entry in plan.items():
        if isinstance(entry, dict):
            entry = {k: v for k, v in entry.items() if k not in drop.get(name, ())}
            if not entry:
                continue
        out[name] = entry
    return out


def _registry() -> tuple[FamilySpec, ...]:
    from .cogvideox import COGVIDEOX
    from .flux import FLUX
    from .hunyuan_video import HUNYUAN_VIDEO
    from .ltx import LTX
    from .mochi import MOCHI
    from .qwenimage import QWENIMAGE
    from .sd3 import SD3
    from .wan import WAN

    return (WAN, HUNYUAN_VIDEO, COGVIDEOX, LTX, MOCHI, FLUX, SD3, QWENIMAGE)


FAMILIES: tuple[FamilySpec, ...] = _registry()


def supported_pipelines() -> list[str]:
    """Names of every supported pipeline class."""
    return [p for f in FAMILIES for p in f.pipeline_classes]


def supported_models() -> list[str]:
    """Names of every supported transformer class."""
    return [m for f in FAMILIES for m in f.model_classes]


def family_for(target) -> FamilySpec:
    """The family that supports ``target`` (a pipeline or a transformer), by its class.

    Raises:
        SequenceParallelConfigError: no family supports the class; the message lists those that do.
    """
    cls_name = type(target).__name__
    for fam in FAMILIES:
        if cls_name in fam.pipeline_classes or cls_name in fam.model_classes:
            return fam
    raise SequenceParallelConfigError(
        f"{cls_name} is not supported by diffusers-sp. Supported pipelines: {', '.join(supported_pipelines())}; "
        f"supported transformers (pass pipe.transformer): {', '.join(supported_models())}.")
