"""Diffusers' caches under sequence parallelism: which decisions need the whole sequence, and how they get it.

Diffusers 0.42.1's caches (``transformer.enable_cache(config)`` or the ``apply_*`` functions of
``diffusers.hooks``) are ``ModelHook``\\ s on the transformer's blocks, attention modules or the model
itself. Under sequence parallelism they run on every rank, on that rank's shard of the image tokens:
diffusers-sp's split and gather run in the modules' ``__call__`` (:mod:`diffusers_sp.sharding`),
around anything in their ``forward`` chain, so a cache sees shards whether it was enabled before or
after :func:`~diffusers_sp.enable_sequence_parallel`. What each cache does with them:

* **First Block Cache** (``FBCHeadBlockHook``; ParaAttention's First Block Cache, after TeaCache,
  arXiv 2411.19108). It skips the remaining blocks when the first block's residual r changed little:
  ``mean|r_t - r_{t-1}| / mean|r_{t-1}| <= threshold``, means over every element (batch, tokens,
  channels). On a shard each rank would get its own ratio, take its own decision, and the ranks'
  collectives in the blocks would no longer match. Here the statistic covers the whole sequence:
  each rank sums ``|r_t - r_{t-1}|`` and ``|r_{t-1}|`` over its shard (float64), one all-gather of
  those two numbers (16 bytes per rank), and every rank adds the P pairs itself, correctly rounded
  (``math.fsum``), into the same two Python floats: the same bits on every rank, hence one decision,
  with no second collective to broadcast it (an all-reduced float can differ in its last bit
  between ranks on some backends, and one flipped decision hangs the next collective; xDiT
  broadcasts rank 0's decision for that reason). The token count cancels in the ratio, which equals
  the one-process ratio up to rounding (one process takes the means in the tensors' dtype), so the
  decision is the one-process decision except for a ratio within rounding of the threshold. Peers
  (cache-dit, xDiT, ParaAttention) all-reduce the two means; Diffusers' own hook has no
  synchronisation. Installed as an instance attribute ``_should_compute_remaining_blocks`` on the
  hook, removed by ``disable()``.
* **MagCache** (``MagCacheHeadHook``; Ma et al., github.com/Zehong-Ma/MagCache). Its decision reads
  only the precomputed magnitude ratios and the step index: the same on every rank, nothing to
  reduce; its cached residual is the rank's shard. Calibration (``calibrate=True``, which never
  skips) averages ``|r_t| / |r_{t-1}|`` over the tokens: reduced like First Block Cache (the sum of the
  ratios and their count, one all-gather per step), so the ratios it prints are one process's
  (instance attribute ``_perform_calibration_step`` on the tail hook).
* **SeaCache** (``SeaCacheRootHook``; arXiv 2602.18993). Its indicator is a spectral filter (an FFT
  over frames, height and width: it mixes tokens) of the raw latents that a callback reads from the
  transformer's arguments. The callback is given the call as the pipeline made it, before any
  split (``SequenceState.call``): Wan's latents are never split at the model input anyway, but a
  callback on a family whose ``hidden_states`` are split there (Flux, LTX) would otherwise see a
  shard. The indicator, and thus the decision, is then the same on every rank; rank 0's decision
  and accumulated distance are still broadcast (one 16-byte collective per decision, instance
  attribute ``resolve_gate`` on its shared state), so that no rank can flip a decision on its own.
* **Pyramid Attention Broadcast**, **TaylorSeer**: decide by schedule (timestep callback, step
  counters): the same on every rank; they cache or extrapolate the rank's shards, element-wise.
* **FasterCache** (arXiv 2410.19355): its blocks decide by schedule and approximate attention
  outputs element-wise. Its frequency split (``_split_low_high_freq``: an FFT over the last two
  dims) transforms the transformer's *output*, which is gathered to the full sequence before the
  model returns, so it runs on the whole sequence and is exact. Its unconditional-branch skipping
  needs CFG folded into the batch, whole: see the CFG rules below.
* **Text K/V cache**: caches the projections of the replicated text: exact.

With CFG parallelism (:mod:`diffusers_sp.cfg_parallel`) the statistic is reduced over the ranks that
share one decision in one process: the sequence-parallel group when each CFG group computes its own
pass (two calls per step: one process keeps one cache state per pass, and so does each CFG group),
and the replica (both CFG groups) when CFG is folded into a batch that the groups split (one
process decides once for the whole batch). Caches whose state is shared between the two passes of a
step (Pyramid Attention Broadcast, FasterCache: one process serves the second call from what the
first cached) cannot be split between two groups and are refused with two-call CFG parallelism;
FasterCache's unconditional-branch skipping (``is_guidance_distilled=False``), which needs the whole
CFG batch inside every block, is refused with batched CFG parallelism. Caches enabled after enabling
are found and adapted when the model's next forward begins (one scan of the model's modules,
about 0.1 ms for a thousand modules). Every rank must enable the same caches: those present at
enable time are compared across the launch; one added later on some ranks only cannot be detected
without a collective per forward.
"""

from __future__ import annotations

import math

import torch
from diffusers.hooks.faster_cache import FasterCacheBlockHook, FasterCacheDenoiserHook
from diffusers.hooks.first_block_cache import FBCHeadBlockHook
from diffusers.hooks.layer_skip import AttentionProcessorSkipHook
from diffusers.hooks.mag_cache import MagCacheBlockHook
from diffusers.hooks.pyramid_attention_broadcast import PyramidAttentionBroadcastHook
from diffusers.hooks.sea_cache import SeaCacheLeaderBlockHook, SeaCacheRootHook

from .comm import all_gather_dim0, broadcast_tensor
from .groups import SPGroup
from .errors import SequenceParallelConfigError

_MISSING = object()

#: Modules of ``diffusers.hooks`` whose hooks run unchanged under sequence parallelism (or are
#: adapted here): the caches, offloading and casting, and layer skipping.
_KNOWN_MODULES = frozenset({
    "first_block_cache", "mag_cache", "sea_cache", "pyramid_attention_broadcast", "taylorseer_cache",
    "faster_cache", "text_kv_cache", "group_offloading", "layerwise_casting", "layer_skip"})
#: Modules of ``diffusers.hooks`` of Diffusers' own parallelism (refused: :func:`check_no_diffusers_parallelism`).
_PARALLEL_MODULES = frozenset({"context_parallel", "tensor_parallel", "tensor_parallel_neuron"})
#: Hooks refused whatever the layout: ``{module: why}``.
_REFUSED_MODULES = {
    "smoothed_energy_guidance_utils": (
        "it blurs the attention queries over the image grid (Smoothed Energy Guidance), which mixes "
        "neighbouring tokens across the shards' boundaries"),
}


def _hook_module(hook) -> str:
    """The ``diffusers.hooks`` submodule a hook comes from (``""`` for any other hook)."""
    module = type(hook).__module__
    return module.rsplit(".", 1)[-1] if module.startswith("diffusers.hooks.") else ""


def _registries(modules):
    """``(module, registry)`` of the modules that carry a Diffusers ``HookRegistry``. Reads each
    module's ``__dict__`` directly (``nn.Module.__getattr__`` on a missing attribute raises and catches
    an AttributeError, ~1.7 us a module)."""
    for module in modules:
        registry = module.__dict__.get("_diffusers_hook")
        if registry is not None and registry.hooks:
            yield module, registry


def describe(modules) -> tuple:
    """What every rank must agree on at enable time: ``(hook class, registered name)`` of each
    Diffusers hook (caches and the rest) on ``modules``, in module order."""
    return tuple((type(hook).__name__, name) for _, registry in _registries(modules)
                 for name, hook in registry.hooks.items())


def _parallelism_error(name: str) -> SequenceParallelConfigError:
    return SequenceParallelConfigError(
        f"{name} runs Diffusers' own parallelism (enable_parallelism(), apply_context_parallel() or "
        f"from_pretrained(parallel_config=...)): its hooks split the sequence (or the weights) themselves, and "
        f"diffusers-sp would split it again. Use one of the two: load the model without Diffusers' parallelism "
        f"to use diffusers-sp, or call disable_sequence_parallel() to use Diffusers'.")


def check_no_diffusers_parallelism(model: torch.nn.Module, modules=None) -> None:
    """Raises SequenceParallelConfigError when Diffusers' own parallelism is on ``model``:
    ``enable_parallelism`` (or ``from_pretrained(parallel_config=...)``), which records
    ``model._parallel_config``, or hooks of ``apply_context_parallel`` / tensor parallelism on
    ``modules`` (default: all of ``model``'s; ``()``: the attribute only). Reads only the model, so
    every rank raises alike."""
    if getattr(model, "_parallel_config", None) is not None or any(
            _hook_module(hook) in _PARALLEL_MODULES
            for _, registry in _registries(model.modules() if modules is None else modules)
            for hook in registry.hooks.values()):
        raise _parallelism_error(type(model).__name__)


def _sum_over(group: SPGroup, values: list[torch.Tensor]) -> list[float]:
    """Totals over ``group`` of each rank's partial sums ``values`` (0-d tensors, any device the
    group's backend takes), as Python floats with the same bits on every rank: one all-gather of the
    ``len(values)`` float64 numbers, then every rank adds the P rows itself (``math.fsum``,
    correctly rounded, so the order of the ranks does not matter either)."""
    local = torch.stack([v.to(torch.float64) for v in values]).reshape(1, -1)
    rows = all_gather_dim0(local, [1] * group.world_size, group).cpu().tolist()
    return [math.fsum(row[i] for row in rows) for i in range(len(values))]


def _ratio(numerator: float, denominator: float) -> float:
    """``numerator / denominator`` as one process's tensor division gives it: inf or nan over zero."""
    if denominator:
        return numerator / denominator
    return math.nan if numerator == 0 else math.copysign(math.inf, numerator)


def _group_device(group: SPGroup, like: torch.Tensor | None = None) -> torch.device:
    """A device for a small tensor sent over ``group``: ``like``'s, else CUDA for NCCL, else CPU."""
    if like is not None:
        return like.device
    if group.backend is not None and "nccl" in group.backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _fbc_should_compute(hook: FBCHeadBlockHook, group: SPGroup):
    """``FBCHeadBlockHook._should_compute_remaining_blocks`` with the residual statistic over the whole
    sequence (see the module docstring)."""

    @torch.compiler.disable
    def _should_compute_remaining_blocks(hidden_states_residual: torch.Tensor) -> bool:
        # hidden_states_residual: [B, S_r, C] (the image tokens of this rank's shard; for joint
        # families the block's image output), any dtype; the previous step's residual alike.
        previous = hook.state_manager.get_state().head_block_residual
        if previous is None:
            return True
        changed, before = _sum_over(group, [(hidden_states_residual - previous).abs().sum(dtype=torch.float64),
                                            previous.abs().sum(dtype=torch.float64)])
        return _ratio(changed, before) > hook.threshold

    return _should_compute_remaining_blocks


def _mag_calibration_step(hook: MagCacheBlockHook, group: SPGroup):
    """``MagCacheBlockHook._perform_calibration_step`` with the mean norm ratio over the whole sequence."""

    def _perform_calibration_step(state, current_residual: torch.Tensor) -> None:
        # current_residual: [B, S_r, C]; the ratio of per-token norms, averaged over batch and tokens.
        if state.previous_residual is None:
            ratio = 1.0  # Diffusers' neutral first entry
        else:
            per_token = (torch.linalg.norm(current_residual.float(), dim=-1)
                         / (torch.linalg.norm(state.previous_residual.float(), dim=-1) + 1e-8))
            total, count = _sum_over(group, [per_token.sum(dtype=torch.float64),
                                             torch.tensor(float(per_token.numel()), device=per_token.device)])
            ratio = _ratio(total, count)
        state.calibration_ratios.append(ratio)

    return _perform_calibration_step


def _sea_raw_vision(hook: SeaCacheRootHook, original, state):
    """SeaCache's ``raw_vision_callback`` given the transformer's call before any split."""

    def raw_vision_callback(module, args, kwargs):
        call = state.call
        if call is not None:
            args, kwargs = call
        return original(module, args, kwargs)

    return raw_vision_callback


def _sea_resolve_gate(shared_state, group: SPGroup):
    """``SeaCacheSharedState.resolve_gate`` whose decision and accumulated distance are rank 0's."""
    original = type(shared_state).resolve_gate.__get__(shared_state)

    def resolve_gate(state, metadata, indicator, config):
        if state.gate_key == (metadata.step_index, metadata.sigma):
            return original(state, metadata, indicator, config)  # taken already for this step
        should_compute = original(state, metadata, indicator, config)
        like = indicator[0] if indicator else None
        decided = torch.tensor([float(should_compute), state.accumulated_distance], dtype=torch.float64,
                               device=_group_device(group, like))
        flag, distance = broadcast_tensor(decided, group).cpu().tolist()
        state.gate_should_compute = should_compute = bool(flag)
        state.accumulated_distance = distance
        return should_compute

    return resolve_gate


class CacheSupport:
    """The caches of one model under sequence parallelism: refusals and adaptations (module docstring).

    Args:
        owner: Name of the model, for messages.
        group: The ranks that take one decision together (the sequence-parallel group, or the
            replica with batched CFG parallelism). At one rank nothing is adapted: the caches run
            exactly as Diffusers wrote them.
        state: The model's :class:`~diffusers_sp.plan_entries.SequenceState` (its ``call``).
        cfg_strategy: ``None`` (no CFG parallelism), ``"two_call"`` or ``"batch"``.
    """

    def __init__(self, owner: str, group: SPGroup | None, state=None, cfg_strategy: str | None = None):
        self.owner = owner
        self.group = group
        self.state = state
        self.cfg_strategy = cfg_strategy
        self._seen: dict[int, object] = {}  # id -> hook (kept alive, so ids are not reused)
        self._undo: list = []  # (object, attribute, value before, ours)

    def _set(self, obj, name: str, value) -> None:
        self._undo.append((obj, name, vars(obj).get(name, _MISSING), value))
        setattr(obj, name, value)

    def check(self, modules) -> None:
        """Refuses, as :meth:`scan` does, but adapts nothing (at enable time, before any collective)."""
        for _, registry in _registries(modules):
            for hook in registry.hooks.values():
                self._check(hook)

    def scan(self, modules) -> None:
        """Refuses (SequenceParallelConfigError, from the model's structure only, so on every rank
        alike) or adapts each Diffusers hook on ``modules`` not seen before."""
        for _, registry in _registries(modules):
            for hook in registry.hooks.values():
                if id(hook) not in self._seen:
                    self._check(hook)
                    self._adapt(hook)
                    self._seen[id(hook)] = hook

    def _refuse(self, hook, why: str, remedy: str):
        raise SequenceParallelConfigError(
            f"{self.owner}: {type(hook).__name__} cannot run under sequence parallelism here: {why}. {remedy}.")

    def _check(self, hook) -> None:
        where = _hook_module(hook)
        if where in _PARALLEL_MODULES:
            raise _parallelism_error(self.owner)
        if where in _REFUSED_MODULES:
            self._refuse(hook, _REFUSED_MODULES[where], "Remove it, or run without sequence parallelism")
        if where and where not in _KNOWN_MODULES and hook._is_stateful:
            self._refuse(hook, f"it comes from diffusers.hooks.{where}, which diffusers-sp has not been checked "
                               f"against (a stateful hook may decide from this rank's shard alone)",
                         "Remove it, or run without sequence parallelism")
        if isinstance(hook, AttentionProcessorSkipHook) and hook.skip_attention_scores:
            self._refuse(hook, "it replaces the attention scores inside the processor (LayerSkipConfig("
                               "skip_attention_scores=True)), where the sequence-parallel attention runs instead",
                         "Skip the whole attention instead (skip_attention=True), or run without sequence parallelism")
        if self.cfg_strategy == "two_call" and isinstance(
                hook, (PyramidAttentionBroadcastHook, FasterCacheBlockHook, FasterCacheDenoiserHook)):
            self._refuse(hook, "with CFG parallelism each CFG group runs one of the two transformer calls of a "
                               "step, while this cache keeps one state for both calls (one process serves the "
                               "second call from what the first cached)",
                         "Enable sequence parallelism with cfg_parallel=False, or use a cache that keeps one state "
                         "per call (First Block Cache, MagCache, SeaCache, TaylorSeer)")
        if (self.cfg_strategy == "batch" and isinstance(hook, (FasterCacheBlockHook, FasterCacheDenoiserHook))
                and not hook.is_guidance_distilled):
            self._refuse(hook, "its unconditional-branch skipping needs the whole CFG batch in every block, "
                               "which CFG parallelism splits between the two CFG groups",
                         "Enable sequence parallelism with cfg_parallel=False, or FasterCache with "
                         "is_guidance_distilled=True")

    def _adapt(self, hook) -> None:
        if isinstance(hook, SeaCacheRootHook) and hook.raw_vision_callback is not None:
            # Also at one rank: the callback must see the whole input wherever the split sits.
            self._set(hook, "raw_vision_callback", _sea_raw_vision(hook, hook.raw_vision_callback, self.state))
        if self.group.world_size == 1:
            return
        if isinstance(hook, FBCHeadBlockHook):
            self._set(hook, "_should_compute_remaining_blocks", _fbc_should_compute(hook, self.group))
        elif isinstance(hook, MagCacheBlockHook) and hook.is_tail and hook.config is not None and hook.config.calibrate:
            self._set(hook, "_perform_calibration_step", _mag_calibration_step(hook, self.group))
        elif isinstance(hook, SeaCacheLeaderBlockHook):
            shared = hook.shared_state
            if "resolve_gate" not in vars(shared):  # one shared state serves the leader and the root
                self._set(shared, "resolve_gate", _sea_resolve_gate(shared, self.group))

    def undo(self) -> None:
        """Puts back every attribute :meth:`scan` set (where it is still ours), newest first."""
        for obj, name, before, ours in reversed(self._undo):
            if vars(obj).get(name, _MISSING) is not ours:
                continue  # replaced since by someone else: theirs stays
            if before is _MISSING:
                vars(obj).pop(name, None)
            else:
                setattr(obj, name, before)
        self._undo.clear()
        self._seen.clear()
