"""CFG parallelism: the conditional and unconditional passes of classifier-free guidance on two rank groups.

Source: xDiT's "CFG parallel" (PipeFusion, arXiv 2405.14430, and the xDiT paper, arXiv 2411.01738),
also used by sglang's diffusion runtime. The ranks of a replica form a ``cfg x sp`` mesh (see
:func:`diffusers_sp.groups.build_parallel_groups`): CFG group 0 computes the conditional pass, CFG
group 1 the unconditional one, each with sequence parallelism inside; the outputs are then exchanged
(one all-gather of the transformer output over the 2-rank CFG group), so that every rank returns
to the pipeline exactly what it would have computed alone, and the pipeline's own guidance formula
(``uncond + s * (cond - uncond)``) runs unchanged on every rank. No pipeline code is edited: a
:class:`CFGParallelHook` (a Diffusers ``ModelHook``) wraps each transformer's forward.

Two kinds of pipelines:

* **Two calls per step** (Wan 2.1 / 2.2 T2V and I2V; Flux, QwenImage, HunyuanVideo with true CFG):
  the pipeline calls the transformer inside ``cache_context("cond")`` and then ``cache_context("uncond")``
  with the same latents and timestep. The hook must start the unconditional pass *during* the first
  call, so it predicts the second call's arguments:

  - for Wan, from the ``negative_prompt_embeds`` that ``pipe.encode_prompt`` returned (the second call
    differs from the first only in ``encoder_hidden_states``);
  - for any pipeline, from the previous step: the arguments that differed between the two calls of
    step ``i - 1`` (the negative prompt embeddings, masks, pooled embeddings, ...) replace the first
    call's in step ``i``. Step 0 then runs both passes on every group (exact, no speed-up), later
    steps in parallel.

  At the second call the prediction is *verified*: every argument must be the same object or equal
  (``torch.equal``) to what was predicted; otherwise the call is computed as usual (exact, just not
  faster). So the result is always what the pipeline asked for. Each group runs the model's own forward
  on exactly one pass's inputs, so with ``sp_degree = 1`` the outputs are bit for bit those of one
  process; with ``sp_degree > 1`` they carry sequence parallelism's float differences (the same
  tolerance as without CFG parallelism).

* **CFG folded into a batch of 2** (CogVideoX, LTX, Mochi, SD3: ``torch.cat([uncond, cond])``): each
  CFG group runs half of the batch (every tensor argument whose first dim is the batch) and the
  halves are all-gathered. A batch of 1 and a batch of 2 go through different matrix-multiplication
  kernels (blocking and reduction order), so this path is exact to float rounding only:
  :data:`BATCHED_TOLERANCE`.

A call without CFG (guidance off, guidance-distilled models, a batch of 1, a pipeline without
``cache_context``) is computed by both CFG groups (each with SP inside): the right answer, but no
speed is gained over ``cfg_degree = 1``; with CFG off, launch sequence parallelism only.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass, field

import torch
from diffusers.hooks import ModelHook
from diffusers.hooks.hooks import StateManager, _set_cache_context

from .comm import all_gather_dim0
from .forward_chain import register_innermost
from .groups import ParallelGroups, SPGroup

#: Max abs difference relative to the output's scale for the batched path (float32, CPU): a batch of
#: 1 and a batch of 2 differ by matmul rounding only (measured ~1e-7 on the tiny models).
BATCHED_TOLERANCE = 1e-5

#: Measurements behind ``cfg_parallel="auto"``: seconds per pipeline call, CFG on. To be confirmed
#: on our own H200s (benchmarks/); the rule below uses the first entry whose world size matches.
AUTO_MEASUREMENTS = (
    dict(world_size=2, model="Wan-AI/Wan2.1-T2V-1.3B-Diffusers", resolution="480p", hardware="2x H200",
         cfg_parallel_s=4.77, sequence_parallel_s=5.95,
         source="sglang diffusion benchmark (CFG parallel vs Ulysses SP, 2 GPUs)"),
)

#: Forward arguments that never carry a batch dimension (rotary tables, position ids).
_NON_BATCH_ARGS = frozenset({"image_rotary_emb", "rotary_emb", "img_ids", "txt_ids", "freqs_cis", "video_coords",
                             "img_shapes", "txt_seq_lens"})

_HOOK_NAME = "diffusers_sp_cfg_parallel"


def choose_cfg_parallel(family: str | None, world_size: int, sp_degree: int | None,
                        cfg_capable: bool, cfg_by_default: bool = True) -> tuple[bool, str]:
    """The rule of ``cfg_parallel="auto"``: ``(use CFG parallelism, reason)``.

    CFG parallelism needs an even world size (and ``sp_degree`` dividing half of it) and a target with
    CFG. At a world size with a measurement in :data:`AUTO_MEASUREMENTS` the faster of the two wins
    (2 ranks: CFG parallel, 4.77 s against 5.95 s for sequence parallelism on Wan2.1-1.3B 480p).
    At other even world sizes CFG parallelism is also chosen: it exchanges one output per step
    instead of collectives in every layer, while SP's efficiency falls as its degree grows (xDiT,
    arXiv 2411.01738, finds the same). The rule assumes CFG is on in the calls; with CFG off a call
    gains nothing from it (see the module docstring), so families whose default calls run without CFG
    (``cfg_by_default=False``: guidance-distilled Flux and HunyuanVideo, QwenImage without a negative
    prompt) keep it off.
    """
    if not cfg_capable:
        return False, "no CFG strategy is declared for this model family"
    if not cfg_by_default:
        return False, (f"{family} pipelines run without classifier-free guidance by default; pass "
                       f"cfg_parallel=True for calls with true CFG")
    if world_size % 2 or world_size < 2:
        return False, f"odd world size {world_size}"
    if sp_degree is not None and world_size % (2 * sp_degree):
        return False, f"world size {world_size} is not a multiple of 2 x sp_degree {sp_degree}"
    for m in AUTO_MEASUREMENTS:
        if m["world_size"] == world_size and (sp_degree in (None, world_size // 2)):
            faster = m["cfg_parallel_s"] < m["sequence_parallel_s"]
            return faster, (f"measured on {m['hardware']} ({m['model']} {m['resolution']}): cfg parallel "
                            f"{m['cfg_parallel_s']} s vs sequence parallel {m['sequence_parallel_s']} s ({m['source']})")
    return True, "no measurement at this world size; CFG parallelism exchanges one output per step"


def _same(a, b) -> bool:
    """Whether two forward arguments are the same (identical object, or equal tensors / values)."""
    if a is b:
        return True
    if torch.is_tensor(a) or torch.is_tensor(b):
        return (torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and a.dtype == b.dtype
                and a.device == b.device and torch.equal(a, b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - objects without a usable ==
        return False


def _map_output(out, fn):
    """Applies ``fn`` to every tensor of a model output (tensor, tuple/list, or ``BaseOutput``)."""
    if torch.is_tensor(out):
        return fn(out)
    if isinstance(out, (tuple, list)):
        return type(out)(_map_output(o, fn) for o in out)
    if isinstance(out, dict):  # diffusers BaseOutput is an OrderedDict
        return type(out)(**{k: _map_output(v, fn) for k, v in out.items()})
    return out


def exchange_pair(out, cfg: SPGroup):
    """All-gathers a model output over the 2-rank CFG group: ``(output of CFG rank 0, output of CFG rank 1)``.

    Every tensor of ``out`` must have the same shape and dtype on both ranks. One all-gather per tensor
    (a copy: bit exact).
    """
    gathered = _map_output(out, lambda t: all_gather_dim0(t.unsqueeze(0).contiguous(), [1, 1], cfg))
    return _map_output(gathered, lambda t: t[0]), _map_output(gathered, lambda t: t[1])


@dataclass
class CFGShared:
    """Pipeline-level state: the negative prompt embeddings of the current call (Wan), for step 0."""

    negative_embeds: torch.Tensor | None = None
    cast_cache: dict = field(default_factory=dict)


@dataclass
class _Pending:
    name: str | None
    call: dict
    output: object


class _NoState:  # StateManager needs a state class; the hook only reads the context.
    def reset(self, *args, **kwargs):
        pass


class CFGParallelHook(ModelHook):
    """Runs one transformer forward per CFG group and exchanges the outputs (see the module docstring).

    Registered innermost in the transformer's ``forward`` chain
    (:func:`diffusers_sp.forward_chain.register_innermost`): inside the sequence-parallel split,
    which runs in the model's ``__call__`` (:mod:`diffusers_sp.sharding`), so each group's forward is
    itself split over its ``sp`` group; inside Accelerate's offload wrapper, which is re-made after
    every pipeline call; and inside any Diffusers cache hook on the model itself, which thus sees the
    pipeline's call (FasterCache's denoiser hook needs the whole CFG batch). Stateful: Diffusers
    passes it the pipeline's ``cache_context`` ("cond" / "uncond", step index) through
    :class:`StateManager`. A CFG group that computes the other pass during the first call does so
    under that pass's cache context, so that a Diffusers cache keeps one state per pass
    ("cond", "uncond") on every rank as it does in one process.

    Args:
        groups: The :class:`~diffusers_sp.groups.ParallelGroups` (its ``cfg`` group has 2 ranks).
        strategy: ``"two_call"`` or ``"batch"``.
        shared: Pipeline-level :class:`CFGShared` (may be ``None`` for a bare transformer).
    """

    _is_stateful = True

    def __init__(self, groups: ParallelGroups, strategy: str, shared: CFGShared | None = None):
        super().__init__()
        if strategy not in ("two_call", "batch"):
            raise ValueError(f"unknown CFG strategy {strategy!r}")
        self.groups = groups
        self.strategy = strategy
        self.shared = shared
        self.context = StateManager(_NoState)
        self._params: list[str] | None = None
        self.stats = {"parallel": 0, "redundant": 0, "missed": 0, "batch_split": 0}
        self.reset_state(None)

    def reset_state(self, module):
        self.pending: _Pending | None = None
        self.last_first: tuple | None = None
        self.learned: dict = {}
        return module

    # -- helpers -------------------------------------------------------------------------------
    def _bind(self, module, args, kwargs) -> dict:
        if self._params is None:
            sig = inspect.signature(type(module).forward)
            self._params = [p.name for p in list(sig.parameters.values())[1:]
                            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        call = dict(zip(self._params, args))
        call.update(kwargs)
        return call

    def _hidden_key(self) -> str:
        return "hidden_states" if "hidden_states" in (self._params or ()) else (self._params or ["hidden_states"])[0]

    def new_forward(self, module, *args, **kwargs):
        forward = self.fn_ref.original_forward
        call = self._bind(module, args, kwargs)
        if self.strategy == "batch":
            return self._batch_split(forward, call)
        return self._two_call(module, forward, call)

    # -- CFG folded into the batch ---------------------------------------------------------------
    def _batch_split(self, forward, call):
        hs = call.get(self._hidden_key())
        batch = hs.shape[0] if torch.is_tensor(hs) else 0
        if batch < 2 or batch % 2:
            self.stats["redundant"] += 1
            return forward(**call)
        half = batch // 2
        lo = self.groups.cfg_rank * half
        mine = {k: (v.narrow(0, lo, half) if torch.is_tensor(v) and v.ndim >= 1 and v.shape[0] == batch
                    and k not in _NON_BATCH_ARGS else v) for k, v in call.items()}
        out = forward(**mine)
        self.stats["batch_split"] += 1
        return _map_output(out, lambda t: all_gather_dim0(t.contiguous(), [half, half], self.groups.cfg)
                           if t.ndim >= 1 and t.shape[0] == half else t)

    # -- two calls per step ----------------------------------------------------------------------
    def _predict(self, name, call):
        """``(partner name, partner call)`` predicted for the call after this one, or ``None``."""
        neg = self.shared.negative_embeds if self.shared is not None else None
        ehs = call.get("encoder_hidden_states")
        if (name == "cond" and torch.is_tensor(neg) and torch.is_tensor(ehs) and neg.shape == ehs.shape):
            key = (ehs.dtype, ehs.device)
            cached = self.shared.cast_cache.get(key)
            if cached is None or cached[0] is not neg:
                cached = (neg, neg.to(device=ehs.device, dtype=ehs.dtype))
                self.shared.cast_cache = {key: cached}
            return "uncond", {**call, "encoder_hidden_states": cached[1]}
        if name in self.learned:
            partner_name, diff = self.learned[name]
            return partner_name, {**call, **diff}
        return None

    def _two_call(self, module, forward, call):
        ctx = self.context._context
        name = ctx.name if ctx is not None else None
        if self.pending is not None:
            pending, self.pending = self.pending, None
            if name == pending.name and pending.call.keys() == call.keys() and all(
                    _same(call[k], pending.call[k]) for k in call):
                return pending.output  # computed by the other CFG group from exactly these inputs
            self.stats["missed"] += 1
        if name is None:
            self.stats["redundant"] += 1
            return forward(**call)
        if self.last_first is not None and self.last_first[0] != name:
            # Second call of a pair that ran without prediction: learn what differs, for the next step.
            first_name, first = self.last_first
            self.last_first = None
            hk = self._hidden_key()
            if first.keys() == call.keys() and _same(first.get(hk), call.get(hk)):
                diff = {k: v for k, v in call.items() if not _same(v, first[k])}
                if diff:
                    self.learned[first_name] = (name, diff)
            self.stats["redundant"] += 1
            return forward(**call)
        self.last_first = None
        predicted = self._predict(name, call)
        if predicted is None:
            self.last_first = (name, call)
            self.stats["redundant"] += 1
            return forward(**call)
        partner_name, partner = predicted
        if self.groups.cfg_rank == 0:
            out = forward(**call)
        else:
            # The other pass, computed now under its own cache context: a cache's per-context state
            # ("uncond") then follows the same trajectory as in one process.
            _set_cache_context(module, dataclasses.replace(ctx, name=partner_name))
            try:
                out = forward(**partner)
            finally:
                _set_cache_context(module, ctx)
        mine, theirs = exchange_pair(out, self.groups.cfg)
        self.pending = _Pending(partner_name, partner, theirs)
        self.stats["parallel"] += 1
        return mine


def install(target, family_name: str, models: list, groups: ParallelGroups, handle, strategy: str) -> list:
    """Installs CFG parallelism on ``models`` (after their sequence-parallel hooks).

    Args:
        target: The pipeline (or the model itself).
        family_name: The family (Wan's negative prompt embeddings are read from ``encode_prompt``).
        models: ``[(attribute, transformer)]``.
        groups: The launch's :class:`ParallelGroups` with ``cfg_degree == 2``.
        handle: The :class:`~diffusers_sp.api.SequenceParallelHandle`; the hooks are appended to its
            models' ``chain_hooks`` and the pipeline patch to its patches, so ``disable()`` removes them.
        strategy: ``"two_call"`` or ``"batch"`` (the family's ``cfg_strategy``).

    Returns:
        The installed hooks (one per transformer; their ``stats`` count parallel / redundant calls).
    """
    shared = CFGShared()
    hooks = []
    for (_, model), installed in zip(models, handle._models):
        hook = CFGParallelHook(groups, strategy, shared)
        wrapped = register_innermost(model, hook, _HOOK_NAME)
        installed.chain_hooks.append((model, _HOOK_NAME, wrapped))
        hooks.append(hook)
    encode = getattr(target, "encode_prompt", None)
    if family_name == "wan" and encode is not None and target is not models[0][1]:

        @functools.wraps(encode)
        def encode_prompt(*args, **kwargs):
            out = encode(*args, **kwargs)
            neg = out[1] if isinstance(out, tuple) and len(out) > 1 else None
            shared.negative_embeds = neg if torch.is_tensor(neg) else None
            return out

        handle.patch_attribute(target, "encode_prompt", encode_prompt)
    return hooks
