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

import torch

from ..errors import SequenceParallelConfigError
from .refused import REFUSED_MODELS
from .spec import CONTROLNET_RESIDUALS, FamilySpec, _head_dim, _heads, plan_without

__all__ = ["CONTROLNET_RESIDUALS", "FAMILIES", "FamilySpec", "family_for_model", "is_modular", "is_pipeline",
           "plan_without", "resolve_target",
           "supported_models", "transformers_of", "_head_dim", "_heads"]


def _registry() -> tuple[FamilySpec, ...]:
    from .ace_step import ACE_STEP
    from .allegro import ALLEGRO
    from .amused import AMUSED
    from .anyflow import ANYFLOW
    from .auraflow import AURAFLOW
    from .bria import BRIA
    from .bria_fibo import BRIA_FIBO
    from .chroma import CHROMA
    from .cogvideox import COGVIDEOX
    from .cogview3plus import COGVIEW3PLUS
    from .cogview4 import COGVIEW4
    from .consisid import CONSISID
    from .cosmos import COSMOS
    from .dit import DIT
    from .easyanimate import EASYANIMATE
    from .ernie_image import ERNIE_IMAGE
    from .flux import FLUX
    from .flux2 import FLUX2
    from .flux3 import FLUX3
    from .helios import HELIOS
    from .hidream import HIDREAM
    from .hunyuan_dit import HUNYUAN_DIT
    from .hunyuan_image import HUNYUAN_IMAGE
    from .hunyuan_video import HUNYUAN_VIDEO
    from .hunyuan_video15 import HUNYUAN_VIDEO15
    from .hunyuan_video_framepack import HUNYUAN_VIDEO_FRAMEPACK
    from .ideogram4 import IDEOGRAM4
    from .joyimage import JOYIMAGE
    from .kandinsky5 import KANDINSKY5
    from .kandinsky6 import KANDINSKY6
    from .krea2 import KREA2
    from .latte import LATTE
    from .longcat_audio_dit import LONGCAT_AUDIO_DIT
    from .longcat_image import LONGCAT_IMAGE
    from .ltx import LTX
    from .ltx2 import LTX2
    from .lumina import LUMINA
    from .lumina2 import LUMINA2
    from .minimax_music3 import MINIMAX_MUSIC3
    from .mochi import MOCHI
    from .motif_video import MOTIF_VIDEO
    from .nucleusmoe_image import NUCLEUSMOE_IMAGE
    from .ovis_image import OVIS_IMAGE
    from .pixart import PIXART
    from .prx import PRX
    from .qwenimage import QWENIMAGE
    from .qwenimage21 import QWENIMAGE21
    from .sana import SANA
    from .sana_video import SANA_VIDEO
    from .sd3 import SD3
    from .skyreels_v2 import SKYREELS_V2
    from .stable_audio import STABLE_AUDIO
    from .stable_audio3 import STABLE_AUDIO3
    from .vq_diffusion import VQ_DIFFUSION
    from .wan import WAN
    from .wan_animate import WAN_ANIMATE
    from .wan_vace import WAN_VACE
    from .z_image import Z_IMAGE

    return (WAN, HUNYUAN_VIDEO, COGVIDEOX, LTX, LTX2, MOCHI, FLUX, SD3, QWENIMAGE, FLUX2, HELIOS, LUMINA2, COGVIEW4,
            HUNYUAN_IMAGE, SKYREELS_V2, CHROMA, WAN_VACE, WAN_ANIMATE, HIDREAM, Z_IMAGE, SANA, QWENIMAGE21,
            HUNYUAN_VIDEO15, HUNYUAN_VIDEO_FRAMEPACK, COSMOS, KANDINSKY5, SANA_VIDEO, LONGCAT_IMAGE, OVIS_IMAGE,
            BRIA, PIXART, HUNYUAN_DIT, DIT, COGVIEW3PLUS, EASYANIMATE, AURAFLOW, ALLEGRO, KREA2, BRIA_FIBO, PRX,
            STABLE_AUDIO, NUCLEUSMOE_IMAGE, STABLE_AUDIO3, AMUSED, VQ_DIFFUSION, LATTE, ANYFLOW, ERNIE_IMAGE,
            LUMINA, MOTIF_VIDEO, KANDINSKY6, JOYIMAGE, ACE_STEP,
            LONGCAT_AUDIO_DIT, IDEOGRAM4, FLUX3, MINIMAX_MUSIC3, CONSISID)


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
    for name, model in _components(pipeline):
        if "transformer" in name and id(model) not in seen:  # transformer_2 = transformer
            seen.add(id(model))
            found.append((name, model))
    return found


def _components(pipeline) -> list[tuple[str, torch.nn.Module]]:
    """The ``(attribute, module)`` pairs of every module component in a pipeline's config."""
    config = getattr(pipeline, "config", {}) or {}
    return [(name, getattr(pipeline, name, None)) for name in config
            if not name.startswith("_") and isinstance(getattr(pipeline, name, None), torch.nn.Module)]


def is_pipeline(target) -> bool:
    """Whether ``target`` is a Diffusers pipeline: a classic ``DiffusionPipeline`` or a
    ``ModularPipeline`` (whose components a pipeline's blocks use; ``transformers_of`` reads both from
    the pipeline's config)."""
    from diffusers import DiffusionPipeline

    try:
        from diffusers.modular_pipelines import ModularPipeline
    except ImportError:  # a Diffusers without modular pipelines
        ModularPipeline = ()
    return isinstance(target, (DiffusionPipeline, ModularPipeline))


def is_modular(target) -> bool:
    """Whether ``target`` is a Diffusers ``ModularPipeline``."""
    try:
        from diffusers.modular_pipelines import ModularPipeline
    except ImportError:
        return False
    return isinstance(target, ModularPipeline)


def resolve_target(target) -> tuple[FamilySpec, list[tuple[str, torch.nn.Module]]]:
    """The family and the ``(attribute, model)`` pairs to parallelize for ``target``, a Diffusers
    pipeline, classic or modular (every transformer it holds), or a transformer model (``attribute``
    ``""``).

    Raises:
        SequenceParallelConfigError: ``target`` holds no transformer, a transformer of a class no
            family parallelizes (the message lists those that run), or transformers of two families.
    """
    name = type(target).__name__
    if family_for_model(target) is not None:
        return family_for_model(target), [("", target)]
    from diffusers import ModelMixin

    pipeline = is_pipeline(target)
    models = transformers_of(target) if pipeline else []
    if not models and name in REFUSED_MODELS:
        raise SequenceParallelConfigError(f"diffusers-sp does not parallelize {name}: {REFUSED_MODELS[name]}.")
    refused = [(a, m) for a, m in (_components(target) if pipeline and not models else ())
               if type(m).__name__ in REFUSED_MODELS]
    if refused:  # a denoiser of another name (LTX-2's diffusion_decoder)
        attribute, model = refused[0]
        raise SequenceParallelConfigError(
            f"{name}.{attribute} is a {type(model).__name__}, which diffusers-sp does not parallelize: "
            f"{REFUSED_MODELS[type(model).__name__]}.")
    if not models:
        what = ("a Diffusers pipeline without a transformer" if pipeline else
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
            reason = REFUSED_MODELS.get(type(model).__name__)
            raise SequenceParallelConfigError(
                f"{name}.{attribute} is a {type(model).__name__}, which diffusers-sp does not parallelize"
                + (f": {reason}. " if reason else " yet. ")
                + f"Transformers it runs: {', '.join(supported_models())}, and any transformer with a Diffusers "
                f"_cp_plan; see docs/pipelines.md.")
        families.append(spec)
    if len({f.name for f in families}) > 1:
        raise SequenceParallelConfigError(
            f"{name} holds transformers of different families ({', '.join(f'{a}: {type(m).__name__}' for a, m in models)}); "
            f"enable sequence parallelism on each transformer instead.")
    return families[0], models
