"""Model families: one module per family of transformers, with its traits and its sharding plan.

A family is keyed by the transformer classes it parallelizes, never by pipeline: any Diffusers
pipeline is accepted by what it holds (see :func:`transformers_of`), so FluxKontext, Flux Fill or
a ControlNet pipeline runs wherever its ``transformer`` does. A transformer class that has no
family module but ships a Diffusers ``_cp_plan`` runs through that plan
(:mod:`diffusers_sp.pipelines.cp_plan`).

:data:`FAMILIES` is the registry; :mod:`diffusers_sp.coverage` builds the README's table of every
Diffusers pipeline from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from diffusers.models._modeling_parallel import ContextParallelInput

from ..sharding import SplitEach
from ..traits import ModelTraits
from ..validation import SequenceParallelConfigError

#: Plan entry for ControlNet residuals: a list of ``[B, S, C]`` tensors, one per block, added to the
#: image tokens, so each is split like them (the ControlNet itself runs whole on every rank).
CONTROLNET_RESIDUALS = SplitEach(ContextParallelInput(split_dim=1, expected_dims=3, split_output=False))


@dataclass(frozen=True)
class FamilySpec:
    """How one family of transformers is parallelized.

    Attributes:
        name: Family name (module name in this package), e.g. ``"wan"``.
        model_classes: Transformer class names the family parallelizes.
        is_video: Whether the family's latents are videos.
        patch_size: ``model -> (p_t, p_h, p_w)`` (video) or ``(p_h, p_w)`` (image), read from the
            model's config; may raise SequenceParallelConfigError for a config the family cannot run.
        sharding_plan: ``model -> plan`` in ``_cp_plan`` format (see :mod:`diffusers_sp.sharding`).
        attention_modules: ``model -> [(qualified name, module)]``: the self-attention modules whose
            processors are wrapped (cross-attention over the replicated text is left alone).
        split_kv_attention_modules: ``None`` or ``model -> [(qualified name, module)]``: attention
            modules whose queries are whole on every rank while their keys and values are this rank's
            shard of the split sequence (LTX-2's video-to-audio attention: replicated audio queries
            over the split video). Their calls gather K and V in every mode
            (:class:`~diffusers_sp.processors.kv_gather.SplitKVAttnProcessor`); found like
            :attr:`attention_call` says.
        joint_text: Where text tokens sit in the family's self-attention sequence: ``None`` (text
            only in cross-attention, or no text), ``"prefix"`` or ``"suffix"`` (copied into every
            model's :class:`ModelTraits`).
        text_mask: Whether the family applies a text key padding mask (ragged prompts).
        modes: Sequence-parallel modes that run exactly for the family (README table, tests).
        latent_grid: ``(model, args, kwargs) -> (T, H, W)``: the patchified latent grid of a forward
            call, in patches (video families; needed by VSA). ``None``: the grid cannot be read.
        self_attention_kv_first: ``None`` or the family's self-attention processor rewritten to make
            K and V before Q, so that the K/V transfer of either dense mode overlaps the query's work
            (``overlap_query_projection``; see
            :class:`~diffusers_sp.processors.base.SequenceParallelAttnProcessor`, ``kv_first``).
        vsa_refusal: Why ``mode="vsa"`` cannot run on the family although its self-attention holds
            video tokens only and its latent grid could be read (``""``: no such reason).
        unsupported_inputs: ``{forward argument: what it is}``: arguments the family's plan does not
            split; a forward passing one that is not ``None`` raises SequenceParallelConfigError on
            every rank, before any collective.
        forward_hooks: ``None`` or ``(model, state) -> {submodule name: () -> ModelHook}``: the family's
            own hooks, for a rewrite that a plan cannot express (Lumina 2 turns its per-sample padded
            ``[caption; image; padding]`` sequence into one caption prefix for the whole batch); they
            may keep per-forward values in ``state.extra`` (:class:`~diffusers_sp.sharding.SequenceState`).
            Registered after the plan's hooks (see :func:`~diffusers_sp.sharding.apply_plan`).
        attention_call: How the processors' attention calls are found: ``"sdpa"`` (every
            ``F.scaled_dot_product_attention`` call inside a wrapped processor is the self-attention)
            or ``"dispatch"`` (the calls the model's processor marks for context parallelism through
            ``dispatch_attention_fn``; see :mod:`diffusers_sp.pipelines.cp_plan`).
        attention_processor: ``None`` (each dense mode's processor) or the processor class that wraps the
            family's attention modules in every dense mode, for attention whose exact parallel form is
            neither Ulysses nor plain K/V-gather: linear attention (Sana,
            :class:`~diffusers_sp.processors.linear.LinearAttnProcessor`), or calls that mix whole and
            split tokens (QwenImage 2.1, :class:`~diffusers_sp.processors.kv_gather.PrefixKVAttnProcessor`).
        cfg_strategy: How the family's pipelines run classifier-free guidance, for CFG parallelism
            (:mod:`diffusers_sp.cfg_parallel`): ``"two_call"`` (a conditional and an unconditional
            transformer call per step), ``"batch"`` (both folded into a batch of 2) or ``None`` (no
            CFG parallelism).
        cfg_by_default: Whether the family's default pipeline calls use CFG (``cfg_parallel="auto"``
            leaves CFG parallelism off when they do not, e.g. guidance-distilled Flux).
        swapped_processors: Class names of attention processors that the family's pipelines put on the
            wrapped attention modules for the length of a call and take off after it (Diffusers' PAG
            pipelines: ``PAGMixin._set_pag_attn_processor``). Found at the next forward, they are wrapped
            like the model's own processors; any other replacement is refused (see
            :func:`diffusers_sp.api.enable_sequence_parallel`).
        note: One line for the README's coverage table (what the family's plan splits, or a limit).
    """

    name: str
    model_classes: tuple[str, ...]
    is_video: bool
    patch_size: Callable[[torch.nn.Module], tuple[int, ...]]
    sharding_plan: Callable[[torch.nn.Module], dict]
    attention_modules: Callable[[torch.nn.Module], list]
    split_kv_attention_modules: Callable[[torch.nn.Module], list] | None = None
    joint_text: str | None = None
    text_mask: bool = False
    modes: tuple[str, ...] = ("ulysses", "kv_gather")
    latent_grid: Callable | None = None
    self_attention_kv_first: Callable | None = None
    vsa_refusal: str = ""
    unsupported_inputs: dict = field(default_factory=dict)
    forward_hooks: Callable | None = None
    attention_call: str = "sdpa"
    attention_processor: type | None = None
    cfg_strategy: str | None = None
    cfg_by_default: bool = True
    swapped_processors: tuple[str, ...] = ()
    note: str = ""

    def model_traits(self, model: torch.nn.Module, attribute: str) -> ModelTraits:
        """The :class:`~diffusers_sp.traits.ModelTraits` of ``model`` (held as ``attribute`` by its
        pipeline, ``""`` for a bare model): heads and head dim from the config (``num_attention_heads``
        / ``attention_head_dim``, or read from the first attention module), the rest from this spec.

        Raises:
            SequenceParallelConfigError: from :attr:`patch_size`, for a config the family cannot run,
                or a model without self-attention modules to split.
        """
        modules = self.attention_modules(model)
        if not modules:
            raise SequenceParallelConfigError(
                f"{type(model).__name__}: no self-attention module to split was found (family {self.name!r}).")
        cfg = model.config
        heads = getattr(cfg, "num_attention_heads", None) or _heads(modules[0][1])
        head_dim = getattr(cfg, "attention_head_dim", None) or _head_dim(modules[0][1])
        return ModelTraits(
            name=type(model).__name__, attribute=attribute, num_heads=int(heads), head_dim=int(head_dim),
            is_video=self.is_video, patch_size=self.patch_size(model), joint_text=self.joint_text,
            text_mask=self.text_mask, num_attention_layers=len(modules))


def _heads(module) -> int | None:
    """Heads of a Diffusers attention module: ``heads`` (``Attention`` and most others) or ``num_heads``
    (``Kandinsky5Attention``)."""
    return getattr(module, "heads", None) or getattr(module, "num_heads", None)


def _head_dim(module) -> int:
    """Head dimension of a Diffusers attention module: query width over heads (the query projection is
    ``to_q``, ``to_query`` in ``Kandinsky5Attention``, or the fused ``to_qkv``)."""
    to_q = getattr(module, "to_q", None) or getattr(module, "to_query", None) or getattr(module, "to_qkv", None)
    width = to_q.out_features // (3 if to_q is getattr(module, "to_qkv", None) else 1)
    return width // int(_heads(module))


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
    from .chroma import CHROMA
    from .cogvideox import COGVIDEOX
    from .cogview4 import COGVIEW4
    from .cosmos import COSMOS
    from .flux import FLUX
    from .flux2 import FLUX2
    from .helios import HELIOS
    from .hidream import HIDREAM
    from .hunyuan_image import HUNYUAN_IMAGE
    from .hunyuan_video import HUNYUAN_VIDEO
    from .hunyuan_video15 import HUNYUAN_VIDEO15
    from .hunyuan_video_framepack import HUNYUAN_VIDEO_FRAMEPACK
    from .kandinsky5 import KANDINSKY5
    from .ltx import LTX
    from .ltx2 import LTX2
    from .lumina2 import LUMINA2
    from .mochi import MOCHI
    from .qwenimage import QWENIMAGE
    from .qwenimage21 import QWENIMAGE21
    from .sana import SANA
    from .sana_video import SANA_VIDEO
    from .sd3 import SD3
    from .skyreels_v2 import SKYREELS_V2
    from .wan import WAN
    from .wan_animate import WAN_ANIMATE
    from .wan_vace import WAN_VACE
    from .z_image import Z_IMAGE

    return (WAN, HUNYUAN_VIDEO, COGVIDEOX, LTX, LTX2, MOCHI, FLUX, SD3, QWENIMAGE, FLUX2, HELIOS, LUMINA2, COGVIEW4,
            HUNYUAN_IMAGE, SKYREELS_V2, CHROMA, WAN_VACE, WAN_ANIMATE, HIDREAM, Z_IMAGE, SANA, QWENIMAGE21,
            HUNYUAN_VIDEO15, HUNYUAN_VIDEO_FRAMEPACK, COSMOS, KANDINSKY5, SANA_VIDEO)


FAMILIES: tuple[FamilySpec, ...] = _registry()
_BY_MODEL = {cls: fam for fam in FAMILIES for cls in fam.model_classes}


def supported_models() -> list[str]:
    """Names of every transformer class with a family module (models with a Diffusers ``_cp_plan``
    run too: see :func:`family_for_model`)."""
    return [m for f in FAMILIES for m in f.model_classes]


def family_for_model(model) -> FamilySpec | None:
    """The family that parallelizes ``model`` (a transformer), by its class; a family made from the
    class's Diffusers ``_cp_plan`` when no family module names it; ``None`` when neither exists."""
    spec = _BY_MODEL.get(type(model).__name__)
    if spec is None and getattr(type(model), "_cp_plan", None):
        from .cp_plan import cp_plan_family

        spec = cp_plan_family(type(model))
    return spec


def transformers_of(pipeline) -> list[tuple[str, torch.nn.Module]]:
    """The ``(attribute, model)`` pairs of a Diffusers pipeline's transformers: the components whose
    name contains ``"transformer"`` (``transformer``, ``transformer_2``, ...), each module once."""
    found, seen = [], set()
    config = getattr(pipeline, "config", {}) or {}
    for name in config:
        if name.startswith("_") or "transformer" not in name:
            continue
        model = getattr(pipeline, name, None)
        if isinstance(model, torch.nn.Module) and id(model) not in seen:  # transformer_2 = transformer
            seen.add(id(model))
            found.append((name, model))
    return found


def resolve_target(target) -> tuple[FamilySpec, list[tuple[str, torch.nn.Module]]]:
    """The family and the ``(attribute, model)`` pairs to parallelize for ``target``, a Diffusers
    pipeline (every transformer it holds) or a transformer model (``attribute`` ``""``).

    Raises:
        SequenceParallelConfigError: ``target`` holds no transformer, a transformer of a class no
            family parallelizes (the message lists those that run), or transformers of two families.
    """
    name = type(target).__name__
    if family_for_model(target) is not None:
        return family_for_model(target), [("", target)]
    from diffusers import DiffusionPipeline, ModelMixin

    models = transformers_of(target) if isinstance(target, DiffusionPipeline) else []
    if not models:
        what = ("a Diffusers pipeline without a transformer" if isinstance(target, DiffusionPipeline) else
                "a model that is not a transformer diffusers-sp parallelizes" if isinstance(target, ModelMixin) else
                "not a Diffusers pipeline or model")
        raise SequenceParallelConfigError(
            f"{name} is {what}: diffusers-sp splits the token sequence of a diffusion transformer (DiT); pass "
            f"a pipeline or its transformer. Transformers it runs: {', '.join(supported_models())}, and any "
            f"transformer with a Diffusers _cp_plan.")
    families = []
    for attribute, model in models:
        spec = family_for_model(model)
        if spec is None:
            raise SequenceParallelConfigError(
                f"{name}.{attribute} is a {type(model).__name__}, which diffusers-sp does not parallelize yet. "
                f"Transformers it runs: {', '.join(supported_models())}, and any transformer with a Diffusers "
                f"_cp_plan; see the coverage table in the README.")
        families.append(spec)
    if len({f.name for f in families}) > 1:
        raise SequenceParallelConfigError(
            f"{name} holds transformers of different families ({', '.join(f'{a}: {type(m).__name__}' for a, m in models)}); "
            f"enable sequence parallelism on each transformer instead.")
    return families[0], models
