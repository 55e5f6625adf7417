"""What a model family is: :class:`FamilySpec`, the declaration each family module makes, and the
helpers family modules share (ControlNet residual entries, dropping text entries of a ``_cp_plan``).

The package ``diffusers_sp.pipelines`` collects the families; this module imports none of them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import torch
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

from ..errors import SequenceParallelConfigError
from ..plan_entries import SplitEach
from ..traits import ModelTraits


#: Plan entry for the ``[B, S, C]`` token states of most models: split along the sequence (dim 1).
SPLIT_TOKENS = ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)
#: Plan entry for a module whose ``[B, S, C]`` token output is split along the sequence (dim 1): a patch
#: embedding's, when the model patchifies inside its forward.
SPLIT_TOKENS_OUT = ContextParallelInput(split_dim=1, expected_dims=3, split_output=True)
#: Plan entries for a ``[S, D]`` table with one row per token (RoPE tables, position ids), split by rows:
#: as an argument, and as a module's output.
SPLIT_ROWS = ContextParallelInput(split_dim=0, expected_dims=2, split_output=False)
SPLIT_ROWS_OUT = ContextParallelInput(split_dim=0, expected_dims=2, split_output=True)
#: Plan entry for a module whose ``[B, S_r, C]`` output is gathered back to the full sequence.
GATHER_TOKENS = ContextParallelOutput(gather_dim=1, expected_dims=3)

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
        sharding_plan: The plan in ``_cp_plan`` format (see :mod:`diffusers_sp.sharding`): a dict, the
            same for every model of the family (each model gets a copy), or ``model -> plan``.
        attention_modules: The self-attention modules whose processors are wrapped (cross-attention over
            the replicated text is left alone): patterns such as ``("transformer_blocks.*.attn",)``
            (:func:`modules_matching`), or ``model -> [(qualified name, module)]``. After construction
            the attribute is always the function.
        patch_size: ``model -> (p_t, p_h, p_w)`` (video) or ``(p_h, p_w)`` (image); may raise
            SequenceParallelConfigError for a config the family cannot run. ``None``: read from the
            config's ``patch_size`` (and ``patch_size_t``) by :func:`config_patch_size`.
        split_kv_attention_modules: ``None``, patterns or ``model -> [(qualified name, module)]`` (as
            :attr:`attention_modules`): attention
            modules whose queries are whole on every rank while their keys and values are this rank's
            shard of the split sequence (LTX-2's video-to-audio attention: replicated audio queries
            over the split video). Their calls gather K and V in every mode
            (:class:`~diffusers_sp.processors.kv_gather.SplitKVAttnProcessor`); found like
            :attr:`attention_call` says.
        two_stream_attention_modules: ``None``, patterns or ``model -> [(qualified name, module)]``:
            self-attention modules whose calls join two streams of the split tokens, this rank's shard
            of each (MotifVideo's decoder layers: ``[decoder tokens; encoder output]``), run by the dense
            mode's processor with ``streams=2`` (see
            :class:`~diffusers_sp.processors.base.SequenceParallelAttnProcessor`).
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
            :class:`~diffusers_sp.processors.base.SequenceParallelAttnProcessor`, ``kv_first``). VSA
            runs it too, without the overlap, where it uses faster kernels of the same bits (Wan's RoPE).
        vsa_refusal: Why ``mode="vsa"`` cannot run on the family although its self-attention holds
            video tokens only and its latent grid could be read (``""``: no such reason).
        unsupported_inputs: ``{forward argument: what it is}``: arguments the family's plan does not
            split; a forward passing one that is not ``None`` raises SequenceParallelConfigError on
            every rank, before any collective.
        forward_hooks: ``None`` or ``(model, state) -> {submodule name: () -> ModelHook}``: the family's
            own hooks, for a rewrite that a plan cannot express (Lumina 2 turns its per-sample padded
            ``[caption; image; padding]`` sequence into one caption prefix for the whole batch); they
            may keep per-forward values in ``state.extra`` (:class:`~diffusers_sp.plan_entries.SequenceState`).
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
        attention_scale: ``None`` or ``(attention module, {argument: value} of its processor's call,
            sequence length S) -> softmax scale or None``: for a processor that derives its scale from the
            length of the sequence it sees (Lumina-Next's proportional attention,
            ``sqrt(log_base(S)) / sqrt(D)``), the scale it computes over the full sequence; it replaces
            the scale of the wrapped call (``None``: the call's own).
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
    sharding_plan: Callable[[torch.nn.Module], dict] | dict
    attention_modules: Callable[[torch.nn.Module], list] | tuple[str, ...]
    patch_size: Callable[[torch.nn.Module], tuple[int, ...]] | None = None
    split_kv_attention_modules: Callable[[torch.nn.Module], list] | tuple[str, ...] | None = None
    two_stream_attention_modules: Callable[[torch.nn.Module], list] | tuple[str, ...] | None = None
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
    attention_scale: Callable | None = None
    cfg_strategy: str | None = None
    cfg_by_default: bool = True
    swapped_processors: tuple[str, ...] = ()
    note: str = ""

    def __post_init__(self):
        # The declarative forms become the functions every caller uses (frozen: set through object).
        if isinstance(self.sharding_plan, dict):
            object.__setattr__(self, "sharding_plan", _fixed_plan(self.sharding_plan))
        for attribute in ("attention_modules", "split_kv_attention_modules", "two_stream_attention_modules"):
            if isinstance(getattr(self, attribute), (tuple, list)):
                object.__setattr__(self, attribute, _matching(tuple(getattr(self, attribute))))
        if self.patch_size is None:
            object.__setattr__(self, "patch_size", functools.partial(config_patch_size, video=self.is_video))

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
    """Head dimension of a Diffusers attention module: its ``head_dim`` or ``dim_heads`` where it keeps one
    (PRX's fused ``img_qkv_proj``; Stable Audio 3's differential ``to_qkv`` of five parts), else query width
    over heads (the query projection is ``to_q``, ``to_query`` in ``Kandinsky5Attention``, or the fused
    ``to_qkv``)."""
    for attribute in ("head_dim", "dim_heads"):
        if isinstance(getattr(module, attribute, None), int):
            return getattr(module, attribute)
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


def modules_matching(model: torch.nn.Module, patterns: tuple[str, ...]) -> list[tuple[str, torch.nn.Module]]:
    """``(qualified name, module)`` of the submodules ``patterns`` name, in pattern order.

    A pattern is a dotted path with at most one ``*``, standing for every child of the module before
    it, in order: ``"transformer_blocks.*.attn"`` is the ``attn`` of every block. A child that lacks
    the rest of the path, or holds ``None`` there, is skipped (e.g. an optional second attention).
    """
    found = []
    for pattern in patterns:
        head, star, tail = pattern.partition(".*")
        parent = model.get_submodule(head) if head else model
        children = parent.named_children() if star else [("", parent)]
        for child_name, child in children:
            module = child
            for part in tail.lstrip(".").split(".") if tail else ():
                module = getattr(module, part, None)
            if module is not None:
                name = ".".join(p for p in (head, child_name, tail.lstrip(".")) if p)
                found.append((name, module))
    return found


def config_patch_size(model: torch.nn.Module, video: bool = False) -> tuple[int, ...]:
    """The config's ``patch_size`` as a tuple: a list or tuple as it is (frames first for video), an int
    ``p`` as ``(patch_size_t, p, p)`` when the config has a ``patch_size_t`` (``(1, p, p)`` for a
    ``video`` model without one), else ``(p, p)`` (``p = 1`` without a ``patch_size``)."""
    cfg = model.config
    patch = getattr(cfg, "patch_size", None) or 1
    if isinstance(patch, (list, tuple)):
        return tuple(int(p) for p in patch)
    t = getattr(cfg, "patch_size_t", None) or (1 if video else None)
    return (int(t), int(patch), int(patch)) if t else (int(patch), int(patch))


def model_plan(model: torch.nn.Module, fallback: dict, text_entries: dict, root: dict | None = None) -> dict:
    """The model's Diffusers ``_cp_plan`` without the entries in ``text_entries`` (:func:`plan_without`),
    or ``fallback`` (the same plan, for a model without one), with ``root`` added to the model's own
    (``""``) entry: the plan of a family whose model ships a ``_cp_plan``."""
    plan = getattr(model, "_cp_plan", None)
    plan = plan_without(plan, text_entries) if plan else dict(fallback)
    if root:
        plan[""] = {**plan.get("", {}), **root}
    return plan


def latent_grid_of(layout: str) -> Callable:
    """``(model, args, kwargs) -> (frames, height, width)``: the patchified latent grid of a forward
    call, from ``hidden_states`` (keyword or first argument) of ``layout`` ``"BCFHW"`` or ``"BFHWC"``,
    divided by the config's ``patch_size`` ``(p_t, p_h, p_w)`` (for VSA)."""
    axes = tuple(layout.index(a) for a in "FHW")

    def latent_grid(model, args, kwargs) -> tuple[int, int, int]:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        return tuple(hidden.shape[a] // int(p) for a, p in zip(axes, model.config.patch_size))

    return latent_grid


def _fixed_plan(plan: dict) -> Callable[[torch.nn.Module], dict]:
    def sharding_plan(model) -> dict:
        return dict(plan)  # a copy: callers may add entries

    return sharding_plan


def _matching(patterns: tuple[str, ...]) -> Callable[[torch.nn.Module], list]:
    def attention_modules(model) -> list:
        return modules_matching(model, patterns)

    attention_modules.patterns = patterns
    return attention_modules
