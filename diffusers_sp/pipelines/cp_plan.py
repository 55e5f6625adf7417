"""Transformers without a family module that ship a Diffusers ``_cp_plan``: parallelized through it.

Diffusers' context parallelism describes, per model, what to split (``_cp_plan``) and lets each
attention processor say which of its attention calls are context-parallel: it passes its
``_parallel_config`` to ``dispatch_attention_fn`` for those calls and ``None`` for the others
(cross-attention over the text in Wan-like models). A family made here keeps both:

* the plan, without its text entries (arguments named like text: ``encoder_*``, ``txt_*``,
  ``text_*``), since diffusers-sp keeps the text replicated on every rank;
* every attention module whose processor takes a ``_parallel_config``, in *dispatch mode* (see
  :class:`~diffusers_sp.processors.base.SequenceParallelAttnProcessor`): the calls the model marks run
  in parallel, the others run as they are.

Such a model runs exactly when its marked calls hold only this rank's tokens of the split sequence,
or come before the plan splits any forward argument: Diffusers hands its config to every attention
processor of the model, also to those over tokens every rank holds in full (MiniMax-H3's text
refiner, which runs before its plan splits the packed sequence at the first block), and such a call
runs as it is. Anything else is refused at the call, on every rank alike, with a
SequenceParallelConfigError that says what the plan lacks: text tokens inside a marked call (where
they sit is not in the plan), tensors of different lengths split by the plan (text the plan splits
under a name not recognized as text), or a processor that does not call ``dispatch_attention_fn``.
A model with such needs gets a short family module instead (Flux.2, LTX-2), as does one whose plan
does not fit its model (Helios: its plan names 40 blocks and gathers after every sub-module).
"""

from __future__ import annotations

import re

from .spec import FamilySpec

#: Forward arguments of a plan that carry text (kept replicated, so their plan entries are dropped).
TEXT_ARGUMENT = re.compile(r"^(encoder_|txt_|text_|prompt_|context)|_(text|txt|context)(_|$)")


def text_free_plan(plan: dict) -> dict:
    """``plan`` without the entries of text arguments (:data:`TEXT_ARGUMENT`); a module whose entry
    becomes empty is dropped. Output entries (integer keys) and gathers are kept."""
    out = {}
    for name, entry in plan.items():
        if isinstance(entry, dict):
            entry = {k: v for k, v in entry.items() if not (isinstance(k, str) and TEXT_ARGUMENT.search(k))}
            if not entry:
                continue
        out[name] = entry
    return out


def marked_attention_modules(model) -> list:
    """``(name, module)`` of every attention module whose processor takes a ``_parallel_config``:
    those Diffusers' own context parallelism hands its config to."""
    found = []
    for name, module in model.named_modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_parallel_config") and callable(processor):
            found.append((name, module))
    return found


def cp_plan_family(cls) -> FamilySpec:
    """The family of a transformer class that has no family module but ships a ``_cp_plan``."""
    plan = text_free_plan(dict(cls._cp_plan))
    return FamilySpec(
        name=f"cp_plan:{cls.__name__}",
        model_classes=(cls.__name__,),
        is_video="3D" in cls.__name__ or "Video" in cls.__name__,
        sharding_plan=plan,
        attention_modules=marked_attention_modules,
        attention_call="dispatch",
        note="through the model's Diffusers _cp_plan (text entries dropped)",
    )
