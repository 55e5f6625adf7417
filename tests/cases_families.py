"""Cases run on every rank by tests/test_families.py (see tests/distributed.py).

Every forward and every pipeline of the tiny family configs in ``tests/families/`` is compared with
one process in both dense modes (a case each, made below from the configs); image/video token counts
are 35 (5 x 7) in the forwards, which divides neither 2 nor 3. Functional cases check the
joint-attention strategies directly (text prefix and suffix, boolean and additive key padding masks,
per-head masks); error cases check the refusals.
"""

from __future__ import annotations

import copy
import functools
import inspect

import torch

from diffusers_sp import disable_sequence_parallel, enable_sequence_parallel
from diffusers_sp import tiny_models as tm

import families
from distributed import compare, error_of

MODES = ("ulysses", "kv_gather")


def _gen(seed=1):
    return torch.Generator().manual_seed(seed)


def _ragged_mask(lengths, total):
    """``[B, total]`` int64 mask with the first ``lengths[b]`` tokens valid."""
    return (torch.arange(total)[None, :] < torch.tensor(lengths)[:, None]).long()


def _model_output(out) -> torch.Tensor:
    """A transformer's output to compare: ``sample``, followed by ``audio_sample`` where the model returns
    one (LTX-2's audio stream, computed whole on every rank), flattened and joined; a ``sample`` that is a
    list of per-sample tensors (Z-Image's) is stacked; a model that returns a tensor (aMUSEd's logits), that."""
    if torch.is_tensor(out):
        return out
    sample = out.sample
    if isinstance(sample, (list, tuple)):
        sample = torch.stack(list(sample))
    audio = getattr(out, "audio_sample", None)
    return sample if audio is None else torch.cat([sample.flatten(), audio.flatten()])


def _forward_all_modes(model, kwargs, modes=MODES) -> dict:
    """Results under :func:`families.result_keys` of ``modes``: dense modes against one process, VSA
    under each ``vsa_sp_mode`` against VSA on a one-rank group."""
    with torch.no_grad():
        ref = _model_output(model(**kwargs))
        results = {}
        for key in families.result_keys(modes):
            mode, _, sp_mode = key.partition("/")
            opts = dict(vsa_sp_mode=sp_mode) if sp_mode else {}
            want = ref
            if sp_mode:
                from cases_vsa import _solo_group

                handle = enable_sequence_parallel(model, mode=mode, process_group=_solo_group(), **opts)
                try:
                    want = _model_output(model(**kwargs))
                finally:
                    handle.disable()
            handle = enable_sequence_parallel(model, mode=mode, **opts)
            try:
                results[key] = compare(want, _model_output(model(**kwargs)))
                results[key]["resolved"] = handle.mode
                # Proof that the forward really ran split: the image length the hooks saw, the wrapped modules.
                results[key]["seq_len"] = handle._models[0].state.seq_len
                results[key]["wrapped"] = len(handle._models[0].processors)
            finally:
                handle.disable()
        results["restored_bitwise"] = torch.equal(_model_output(model(**kwargs)), ref)
    return results


# ------------------------------------------------------------------ functional joint attention


def _functional(text_len, layout, mask_kind, heads=5):
    from diffusers_sp.groups import resolve_group
    from diffusers_sp.processors.masks import gather_key_padding_mask, split_text_image
    from diffusers_sp.processors.kv_gather import finish_kv_gather, kv_gather_attention, start_kv_gather
    from diffusers_sp.processors.ulysses import finish_ulysses, start_ulysses, ulysses_attention
    from diffusers_sp.sharding import balanced_sizes, shard

    group = resolve_group()
    g = _gen(7)
    B, S, D = 2, 35, 8
    L = S + text_len
    q, k, v = (torch.randn(B, heads, L, D, generator=g) for _ in range(3))
    mask = None
    if mask_kind is not None:
        keep = torch.ones(B, heads if mask_kind == "per_head" else 1, 1, L, dtype=torch.bool)
        txt = keep[..., :text_len] if layout == "prefix" else keep[..., S:]
        txt[0, ..., max(text_len - 2, 0):] = False  # ragged text: sample 0 has 2 padding tokens
        if mask_kind == "float":
            mask = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
        else:
            mask = keep
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    sizes = balanced_sizes(S, group.world_size)

    def local(x, dim=2):
        t, i = split_text_image(x, text_len, layout, dim=dim)
        i = shard(i, dim, group.rank, group.world_size)
        return torch.cat([t, i] if layout == "prefix" else [i, t], dim=dim)

    lq, lk, lv = local(q), local(k), local(v)
    lmask = None if mask is None else gather_key_padding_mask(local(mask, 3), text_len, layout, sizes, group)
    ref_local = local(ref)
    out = {}
    for name, fn in (("ulysses", ulysses_attention), ("kv_gather", kv_gather_attention)):
        res = fn(lq, lk, lv, sizes, group, text_len=text_len, text_layout=layout, key_mask=lmask)
        out[name] = compare(ref_local, res)
    # The K/V-first halves (NCCL/gloo transport), with other work between them.
    for name, start, finish in (("ulysses start/finish", start_ulysses, finish_ulysses),
                                ("kv_gather start/finish", start_kv_gather, finish_kv_gather)):
        pending = start(lk, lv, sizes, group, text_len=text_len, text_layout=layout)
        torch.randn(64, 64) @ torch.randn(64, 64)
        out[name] = compare(ref_local, finish(pending, lq, key_mask=lmask))
    return out


def case_functional_prefix_bool_mask():
    return _functional(6, "prefix", "bool")


def case_functional_suffix_float_mask():
    return _functional(5, "suffix", "float")


def case_functional_suffix_per_head_mask():
    return _functional(4, "suffix", "per_head")


def case_functional_one_text_token_no_mask():
    return _functional(1, "prefix", None, heads=3)


def case_functional_no_text():
    return _functional(0, None, None, heads=4)


def case_functional_grid_window():
    """A module mixing 3 x 3 neighbourhoods of the token grid (a 1 x 1, a depthwise 3 x 3 and a 1 x 1
    convolution, as Sana's GLUMBConv) run through GridSide / GridWindow hooks on each rank's shard,
    against the whole grid. Grids: 5 x 7 (shards end inside rows), 2 x 20 (a shard's neighbour rows lie
    on two other ranks), 3 x 1 (one column)."""
    from diffusers.models._modeling_parallel import ContextParallelInput

    from diffusers_sp.groups import resolve_group
    from diffusers_sp.sharding import GridSide, GridWindow, SequenceState, apply_plan, remove_hooks

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ff = torch.nn.Sequential(torch.nn.Conv2d(4, 6, 1), torch.nn.SiLU(),
                                          torch.nn.Conv2d(6, 6, 3, 1, 1, groups=6), torch.nn.Conv2d(6, 4, 1))

        def forward(self, tokens, height, width):  # tokens [B, S, C], as Sana's block reshapes them
            image = tokens.unflatten(1, (height, width)).permute(0, 3, 1, 2)
            return self.ff(image).flatten(2, 3).permute(0, 2, 1)

    group = resolve_group()
    torch.manual_seed(3)
    block = Block().eval()
    plan = {"": {"tokens": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False),
                 "height": GridSide("height"), "width": GridSide("width")}, "ff": GridWindow(halo=1)}
    out = {}
    for height, width in ((5, 7), (2, 20), (3, 1)):
        tokens = torch.randn(2, height * width, 4, generator=_gen(height))
        with torch.no_grad():
            ref = block(tokens, height, width)
            state = SequenceState(group)
            hooks = apply_plan(block, plan, state)
            try:
                local = block(tokens, height, width)
            finally:
                remove_hooks(hooks)
            sizes = state.shard_sizes()
            start = sum(sizes[:group.rank])
            out[f"{height}x{width}"] = compare(ref[:, start:start + sizes[group.rank]], local)
    return out


def case_functional_linear_attention():
    """Diffusers' SanaLinearAttnProcessor2_0 on this rank's shard of 35 tokens under LinearAttnProcessor
    (its sums over the keys all-reduced) against the whole sequence; a softmax processor is refused."""
    from diffusers.models.attention_processor import Attention, AttnProcessor2_0, SanaLinearAttnProcessor2_0

    from diffusers_sp.groups import resolve_group
    from diffusers_sp.processors.linear import LinearAttnProcessor
    from diffusers_sp.sharding import SequenceState, shard

    group = resolve_group()
    torch.manual_seed(4)
    attn = Attention(query_dim=16, heads=2, dim_head=8, bias=True, processor=SanaLinearAttnProcessor2_0()).eval()
    hidden = torch.randn(2, 35, 16, generator=_gen(5))
    state = SequenceState(group, seq_len=35)
    with torch.no_grad():
        ref = attn(hidden)
        local = shard(hidden, 1, group.rank, group.world_size)
        attn.set_processor(LinearAttnProcessor(attn.processor, state))
        out = compare(shard(ref, 1, group.rank, group.world_size), attn(local))
        attn.set_processor(LinearAttnProcessor(AttnProcessor2_0(), state))
        softmax = error_of(lambda: attn(local))
    return {"linear": out, "softmax_error": softmax}


def case_functional_split_kv():
    """Whole queries over keys and values split along the sequence (LTX-2's video-to-audio attention) through
    SplitKVAttnProcessor: no mask, a boolean key padding mask, an additive mask that varies with the query
    (exact here: every rank holds every query row), a per-head one; and a call whose keys are not this rank's
    shard, refused alike on every rank."""
    from diffusers.models.transformers.transformer_ltx2 import LTX2AudioVideoAttnProcessor

    from diffusers_sp.groups import resolve_group
    from diffusers_sp.processors import SplitKVAttnProcessor
    from diffusers_sp.sharding import SequenceState, shard

    group = resolve_group()
    g = _gen(9)
    B, H, Lq, S, D = 2, 3, 9, 35, 8
    q = torch.randn(B, H, Lq, D, generator=g)
    k, v = (torch.randn(B, H, S, D, generator=g) for _ in range(2))
    keep = torch.rand(B, 1, 1, S, generator=g) > 0.3
    masks = {"none": None, "bool_key_padding": keep,
             "float_per_query": torch.randn(B, 1, Lq, S, generator=g),
             "bool_per_head": torch.rand(B, H, 1, S, generator=g) > 0.3}
    processor = SplitKVAttnProcessor(LTX2AudioVideoAttnProcessor(), SequenceState(group, seq_len=S))
    lk, lv = (shard(t, 2, group.rank, group.world_size) for t in (k, v))
    out = {}
    for name, mask in masks.items():
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        local_mask = None if mask is None else shard(mask, 3, group.rank, group.world_size)
        out[name] = compare(ref, processor._attend(q, lk, lv, attn_mask=local_mask))
    out["wrong_length"] = error_of(lambda: processor._attend(q, k, v))
    return out


def _functional_padding_both_sides(layout, kind):
    """A padding mask over queries and keys, ``M[q, k] = m[q] and m[k]``, through the processors'
    attention call (both dense strategies): boolean (padding queries fully masked) or CogView4's float
    form ``m[q] * m[k]`` (an additive 1.0 on valid pairs, padding queries unbiased). Sample 0 pads two
    text tokens, sample 1 two image tokens (the last ones: on the last rank only)."""
    from diffusers_sp.groups import resolve_group
    from diffusers_sp.processors import KVGatherAttnProcessor, UlyssesAttnProcessor
    from diffusers_sp.processors.masks import split_text_image
    from diffusers_sp.sharding import SequenceState, shard

    class Inner:  # the model's processor: never called here, only its signature is read
        def __call__(self, attn, hidden_states):
            raise AssertionError

    group = resolve_group()
    g = _gen(11)
    B, H, S, T, D = 2, 5, 35, 6, 8
    L = T + S
    q, k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(3))
    keep = torch.ones(B, L, dtype=torch.bool)
    text, image = split_text_image(keep, T, layout, dim=1)
    text[0, -2:] = False
    image[1, -2:] = False
    m = keep if kind == "bool" else keep.float()
    full = (m[:, :, None] & m[:, None, :]) if kind == "bool" else m[:, :, None] * m[:, None, :]
    full = full[:, None]  # [B, 1, L, L]
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=full)

    def local(x, dim=2):
        t, i = split_text_image(x, T, layout, dim=dim)
        i = shard(i, dim, group.rank, group.world_size)
        return torch.cat([t, i] if layout == "prefix" else [i, t], dim=dim)

    mask = local(local(full, 2), 3)  # this rank's queries and keys, as the model builds it locally
    out = {}
    for cls in (UlyssesAttnProcessor, KVGatherAttnProcessor):
        state = SequenceState(group, extra={"joint_text": layout})
        state.seq_len = S
        proc = cls(Inner(), state)
        out[cls.strategy] = compare(local(ref), proc._attend(local(q), local(k), local(v), attn_mask=mask))
    return out


def case_functional_padding_both_sides_bool_prefix():
    return _functional_padding_both_sides("prefix", "bool")


def case_functional_padding_both_sides_float_suffix():
    return _functional_padding_both_sides("suffix", "float")


def _joint_sequence_plan(text_side: str) -> dict:
    """A toy model that joins replicated text to its tokens inside its forward, as Lumina 2 does:
    ``embed`` (output split: sets S) and ``refine`` (output gathered) run on the tokens alone, then
    ``[text; tokens]`` (or ``[tokens; text]``) and a per-token table pass through ``block`` (both
    split as :class:`~diffusers_sp.sharding.JointSequence` inputs) and ``out`` (gathered as one). The
    text rows must stay whole and in place; the output must equal the unsplit forward bit for bit.
    A family hook (``apply_plan(..., hooks=...)``) on ``block`` fills in an argument before the plan
    splits it."""
    from diffusers.hooks import ModelHook
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    from diffusers_sp.groups import resolve_group
    from diffusers_sp.sharding import JointSequence, SequenceState, apply_plan, remove_hooks

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mix = torch.nn.Linear(8, 8)

        def forward(self, hidden_states, table):  # [B, T + S, 8], [B, T + S]
            return self.mix(hidden_states) * table[..., None]

    class Joint(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.refine = torch.nn.Linear(4, 8), torch.nn.Linear(8, 8)
            self.block, self.out = Block(), torch.nn.Linear(8, 8)

        def forward(self, tokens, text, table):  # [B, S, 4], [B, T, 8], [B, T + S]
            x = self.refine(self.embed(tokens))
            x = torch.cat([text, x] if text_side == "prefix" else [x, text], dim=1)
            return self.out(self.block(x, table))

    torch.manual_seed(0)
    model = Joint()
    g = _gen(3)
    kwargs = dict(tokens=torch.randn(2, 35, 4, generator=g), text=torch.randn(2, 6, 8, generator=g),
                  table=torch.rand(2, 41, generator=g))
    split = lambda dims: JointSequence(ContextParallelInput(split_dim=1, expected_dims=dims), text_side)  # noqa: E731
    plan = {"embed": {0: ContextParallelInput(split_dim=1, expected_dims=3, split_output=True)},
            "refine": ContextParallelOutput(gather_dim=1, expected_dims=3),
            "block": {"hidden_states": split(3), "table": split(2)},
            "out": JointSequence(ContextParallelOutput(gather_dim=1, expected_dims=3), text_side)}
    with torch.no_grad():
        ref = model(**kwargs)
        state = SequenceState(resolve_group())
        hooks = apply_plan(model, plan, state)
        try:
            result = compare(ref, model(**kwargs))
            result["seq_len"] = state.seq_len
        finally:
            remove_hooks(hooks)
        # A family hook on the same module runs its pre_forward before the plan's splits: here it passes
        # the table that the model's caller left out (as Lumina 2's hook passes the mask its blocks lack).
        class FillTable(ModelHook):
            def pre_forward(self, module, hidden_states, table):
                return (hidden_states, kwargs["table"] if table is None else table), {}

        hooks = apply_plan(model, plan, SequenceState(resolve_group()), hooks={"block": FillTable})
        try:
            result["family_hook"] = compare(ref, model(**{**kwargs, "table": None}))
        finally:
            remove_hooks(hooks)
        # The text part is defined by the sequence length of an earlier split: without one, it raises.
        early = {"block": {"hidden_states": split(3)}}
        hooks = apply_plan(model, early, SequenceState(resolve_group()))
        try:
            result["no_earlier_split"] = error_of(lambda: model(**kwargs))
        finally:
            remove_hooks(hooks)
    return result


def case_joint_sequence_plan_prefix():
    return _joint_sequence_plan("prefix")


def case_joint_sequence_plan_suffix():
    return _joint_sequence_plan("suffix")


# ------------------------------------------------------------------ functional full-sequence masks


class _ModelProcessor:
    """Stands in for a model's attention processor: the wrappers read only its class and signature."""

    def __call__(self, attn, hidden_states):
        raise NotImplementedError


def _full_mask(kind: str, B: int, heads: int, text_len: int, layout, S: int):
    """A mask over the whole joint sequence (``L = text_len + S``), as a model makes it before its split.

    ``block_causal``: SkyReels-V2's diffusion-forcing mask, ``[1, 1, L, L]`` bool, frames of 7 tokens in
    causal blocks of 2 frames (a query attends its own block and the earlier ones; text rows and columns
    attend everything). ``outer_float``: Chroma's, ``[B, 1, L, L]`` float, the outer product of a 0/1
    token mask (sample 0 with 2 padded text tokens) added to the scores as it is. ``per_head``: a
    random ``[B, H, L, L]`` bool mask (the diagonal kept). ``key_padding``: ``[B, 1, 1, L]`` bool over
    the full sequence.
    """
    L = text_len + S
    image = slice(text_len, L) if layout == "prefix" else slice(0, S)
    text = slice(0, text_len) if layout == "prefix" else slice(S, L)
    if kind == "block_causal":
        block = torch.arange(S) // 7 // 2
        mask = torch.ones(L, L, dtype=torch.bool)
        mask[image, image] = block[None, :] <= block[:, None]
        return mask[None, None]
    if kind == "outer_float":
        tokens = torch.ones(B, L)
        tokens[0, torch.arange(L)[text][max(text_len - 2, 0):]] = 0.0
        return tokens[:, None, None, :] * tokens[:, None, :, None]
    if kind == "per_head":
        mask = torch.rand(B, heads, L, L, generator=_gen(3)) < 0.7
        return mask | torch.eye(L, dtype=torch.bool)
    keep = torch.ones(B, 1, 1, L, dtype=torch.bool)
    keep[0, ..., torch.arange(L)[text][max(text_len - 2, 0):]] = False
    return keep


def _functional_full_mask(text_len, layout, kind, heads=5):
    """A mask over the full sequence reaching the processors' attention call on raw tensors, in both
    dense modes: K/V-gather takes its queries' rows, Ulysses the whole mask; nothing is exchanged."""
    from diffusers_sp.groups import resolve_group
    from diffusers_sp.processors import PROCESSORS
    from diffusers_sp.processors.masks import split_text_image
    from diffusers_sp.sharding import SequenceState, shard

    group = resolve_group()
    g = _gen(11)
    B, S, D = 2, 35, 8
    L = S + text_len
    q, k, v = (torch.randn(B, heads, L, D, generator=g) for _ in range(3))
    mask = _full_mask(kind, B, heads, text_len, layout, S)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def local(x, dim=2):
        t, i = split_text_image(x, text_len, layout, dim=dim)
        i = shard(i, dim, group.rank, group.world_size)
        return torch.cat([t, i] if layout == "prefix" else [i, t], dim=dim)

    state = SequenceState(group, extra={"joint_text": layout})
    state.seq_len = S
    out = {}
    for mode in MODES:
        processor = PROCESSORS[mode](_ModelProcessor(), state)
        out[mode] = compare(local(ref), processor._attend(local(q), local(k), local(v), attn_mask=mask))
    return out


def case_functional_full_block_causal_mask_no_text():
    return _functional_full_mask(0, None, "block_causal")


def case_functional_full_block_causal_mask_prefix():
    return _functional_full_mask(6, "prefix", "block_causal")


def case_functional_full_outer_float_mask_prefix():
    return _functional_full_mask(6, "prefix", "outer_float", heads=3)


def case_functional_full_per_head_mask_suffix():
    return _functional_full_mask(4, "suffix", "per_head")


def case_functional_full_key_padding_mask_suffix():
    return _functional_full_mask(5, "suffix", "key_padding")


# ------------------------------------------------------------------ functional: a submodule that needs every token


class _FrameCentering(torch.nn.Module):
    """Groups the tokens by frame, as Wan Animate's face adapter does (``[B, S, C] -> [B, F, S / F, C]``):
    a shard cut inside a frame cannot run it."""

    def forward(self, hidden_states, frames: int):
        x = hidden_states.unflatten(1, (frames, -1))
        return (x - x.mean(2, keepdim=True)).flatten(1, 2)


class _FrameModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj_in, self.frames, self.proj_out = torch.nn.Linear(4, 4), _FrameCentering(), torch.nn.Linear(4, 4)

    def forward(self, hidden_states, frames: int):
        x = self.proj_in(hidden_states)
        return self.proj_out(x + self.frames(x, frames))


def case_functional_gather_input():
    """A plan that splits the tokens at the input, gathers them whole for a submodule that groups them
    by frame (GatherInput), splits its output again and gathers the model's output: equal to one
    process, in the tokens' order and in a permuted order (as VSA's tile order permutes them)."""
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    from diffusers_sp.groups import resolve_group
    from diffusers_sp.sharding import GatherInput, SequenceState, TokenOrder, apply_plan, balanced_sizes, remove_hooks

    group = resolve_group()
    split = ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)
    plan = {"": {"hidden_states": split},
            "frames": {"hidden_states": GatherInput(gather_dim=1, expected_dims=3),
                       0: ContextParallelInput(split_dim=1, expected_dims=3, split_output=True)},
            "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3)}
    model = _FrameModel()
    x = torch.randn(2, 35, 4, generator=_gen(5))  # 5 frames of 7 tokens
    with torch.no_grad():
        ref = model(x, 5)
        out = {}
        perm = torch.randperm(35, generator=_gen(6))
        orders = {"token order": None, "permuted": TokenOrder(perm, torch.argsort(perm),
                                                              tuple(balanced_sizes(35, group.world_size)))}
        for name, order in orders.items():
            state = SequenceState(group)
            hooks = apply_plan(model, plan, state)
            try:
                state.order = order
                out[name] = compare(ref, model(x, 5))
            finally:
                remove_hooks(hooks)
    return out


# ------------------------------------------------------------------ every family's forwards and pipelines
# (the tiny configs of tests/families/; one case per forward and per pipeline, defined below)


def _forward_case(name: str) -> dict:
    model, kwargs = families.forward_cases()[name]()
    return _forward_all_modes(model, kwargs, families.forward_specs()[name].modes)


_PIPES: dict = {}


def _pipe_spec(name: str):
    """The :class:`families.Pipe` of pipeline case ``name``: a classic pipeline or a modular one."""
    return families.pipeline_cases().get(name) or families.modular_cases()[name]


def _pipe(name: str):
    if name not in _PIPES:
        _PIPES.clear()  # one tiny pipeline alive at a time
        _PIPES[name] = _pipe_spec(name).build()
        _PIPES[name].set_progress_bar_config(disable=True)
    return _PIPES[name]


def _first_tensor(out):
    """The latents of a pipeline output (``frames``, ``images`` or the first tensor it holds); a list of
    tensors of different shapes (HunyuanVideo Framepack's latents: one per section) flattened and joined."""
    for key in ("frames", "images", "latents"):
        value = getattr(out, key, None)
        if isinstance(value, (list, tuple)) and value and all(torch.is_tensor(v) for v in value):
            return torch.cat([v.flatten() for v in value])
        if value is not None:
            return torch.as_tensor(value)
    values = out.values() if isinstance(out, dict) else out
    return next(torch.as_tensor(v) for v in values if torch.is_tensor(v))


def _output_tensors(out) -> torch.Tensor:
    """A pipeline output to compare: its latents (:func:`_first_tensor`; a modular pipeline's ``output="latents"``
    is the tensor itself), followed by every other tensor it holds (LTX-2's audio latents, computed whole on
    every rank; DFR's keyframe latents), flattened and joined."""
    if torch.is_tensor(out):
        return out
    first = _first_tensor(out)
    rest = [v for v in (out.values() if isinstance(out, dict) else ()) if torch.is_tensor(v) and v is not first]
    return torch.cat([first.flatten()] + [v.flatten() for v in rest]) if rest else first


def _call_kwargs(pipe, spec) -> dict:
    """The kwargs of a case's pipeline call: ``prompt``, ``num_inference_steps=2`` and ``output_type="latent"``
    where the pipeline's ``__call__`` takes them (LTX-2's DFR pipelines take ``sigmas`` instead of a step
    count), then the case's own."""
    takes = inspect.signature(type(pipe).__call__).parameters
    call = {k: v for k, v in dict(prompt=list(families.PROMPTS), num_inference_steps=2, output_type="latent").items()
            if k in takes}
    call.update(spec.call())
    return call


def _pipeline_case(name: str) -> dict:
    spec = _pipe_spec(name)
    pipe = _pipe(name)
    call = _call_kwargs(pipe, spec)

    def run():
        # The same global RNG state in the reference and in each parallel run: a draw that takes no
        # generator (SD3's ControlNet pipelines encode the control image with ``latent_dist.sample()``;
        # CogView4ControlPipeline's VAE posterior sample) then gives the same numbers in all of them, as
        # in two runs of one process from one seed.
        # A fresh copy of the arguments per call, too: a pipeline may change them in place (Z-Image's
        # _encode_prompt replaces each prompt of the list by its chat-templated text), and the next call
        # (or the next case, for families.PROMPTS) would then get other prompts.
        torch.manual_seed(0)
        return _output_tensors(pipe(**copy.deepcopy(call), generator=torch.Generator().manual_seed(0)))

    ref = run()
    results = {}
    for mode in spec.modes:
        handle = enable_sequence_parallel(pipe, mode=mode)
        try:
            results[mode] = compare(ref, run())
            results[mode]["seq_len"] = handle._models[0].state.seq_len
        finally:
            disable_sequence_parallel(pipe)
    return results


def _refusal_case(name: str) -> str:
    """The error refusing pipeline ``name`` (at enable, or at the refused call), on this rank."""
    spec = families.refusal_cases()[name]
    pipe = spec.build()
    pipe.set_progress_bar_config(disable=True)
    if spec.call is None:
        return error_of(lambda: enable_sequence_parallel(pipe, mode="kv_gather"))
    enable_sequence_parallel(pipe, mode="kv_gather")
    call = _call_kwargs(pipe, spec)
    try:
        return error_of(lambda: pipe(**call, generator=torch.Generator().manual_seed(0)))
    finally:
        disable_sequence_parallel(pipe)


def _refused_forward_case(name: str) -> str:
    """The error refusing forward case ``name`` (at its call, in K/V-gather mode), on this rank."""
    model, kwargs = families.refused_forwards()[name].build()
    enable_sequence_parallel(model, mode="kv_gather")
    try:
        with torch.no_grad():
            return error_of(lambda: model(**kwargs))
    finally:
        disable_sequence_parallel(model)


for _name in families.refused_forwards():
    globals()[f"case_refused_forward_{_name}"] = functools.partial(_refused_forward_case, _name)
for _name in families.refusal_cases():
    globals()[f"case_refusal_{_name}"] = functools.partial(_refusal_case, _name)
for _name in families.forward_cases():
    globals()[f"case_transformer_{_name}"] = functools.partial(_forward_case, _name)
for _name in families.pipeline_cases():
    globals()[f"case_pipeline_{_name}"] = functools.partial(_pipeline_case, _name)
for _name in families.modular_cases():
    globals()[f"case_modular_{_name}"] = functools.partial(_pipeline_case, _name)


def case_rng_drift_inner_pipelines():
    """VisualClozePipeline makes its latents in the pipelines it holds (``generation_pipe``, then
    ``upsampling_pipe``). With a scheduler that draws noise from the global RNG in its steps and ranks
    whose RNGs drifted apart after enable (here on purpose), each rank denoised its tokens with its
    own noise: up to 1.2 off one process, silently. The RNG is re-synchronised at those pipelines'
    ``prepare_latents`` too."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    spec = families.pipeline_cases()["VisualClozePipeline"]
    pipe = spec.build()
    stochastic = FlowMatchEulerDiscreteScheduler(stochastic_sampling=True)
    for p in (pipe, pipe.generation_pipe, pipe.upsampling_pipe):
        p.scheduler = stochastic
        p.set_progress_bar_config(disable=True)
    call = dict(output_type="latent", **spec.call())

    def run():
        return _first_tensor(pipe(**call, generator=torch.Generator().manual_seed(0)))

    torch.manual_seed(5)
    torch.rand(1)  # what rank 0 draws below, so that the reference starts from rank 0's state
    ref = run()
    handle = enable_sequence_parallel(pipe, mode="kv_gather")
    try:
        torch.manual_seed(5)
        torch.rand(handle.rank + 1)
        return compare(ref, run())
    finally:
        handle.disable()


# ------------------------------------------------------------------ errors and mode choice


def case_error_query_dependent_mask():
    """A [B, 1, Lq, Lk] mask that is not a padding mask over queries and keys (here causal) reaching a
    wrapped processor raises on every rank, in both modes."""
    g = _gen()
    model = tm.tiny_flux_transformer()
    ids = torch.zeros(35, 3)
    out = {}
    for mode in MODES:
        handle = enable_sequence_parallel(model, mode=mode)
        try:
            def call():
                # Local joint length on this rank: 7 text tokens + this rank's image shard.
                L = 7 + handle._models[0].state.shard_sizes()[handle.rank]
                mask = torch.ones(2, 1, L, L, dtype=torch.bool).tril()
                with torch.no_grad():
                    model(hidden_states=torch.randn(2, 35, 4, generator=g), encoder_hidden_states=torch.randn(2, 7, 32),
                          pooled_projections=torch.randn(2, 32), timestep=torch.tensor([0.5, 0.5]), img_ids=ids,
                          txt_ids=torch.zeros(7, 3), joint_attention_kwargs={"attention_mask": mask})
            handle._models[0].state.seq_len = 35  # shard sizes are known before the first forward here
            out[mode] = error_of(call)
        finally:
            handle.disable()
    return out


def case_error_cp_plan_text_in_marked_call():
    """A transformer without a family module runs through its Diffusers _cp_plan, which does not say where
    text joined inside an attention call sits: Flux.2 (text first in every attention call), as a
    subclass no family names. The forward is refused on every rank alike (the message holds the text
    length, not the rank's shard), in both modes; ChronoEdit and MiniMax-H3 run that path exactly."""
    from diffusers import Flux2Transformer2DModel

    from diffusers_sp.pipelines import family_for_model

    class Flux2WithoutFamily(Flux2Transformer2DModel):
        pass

    model, kwargs = families.forward_cases()["flux2"]()
    model.__class__ = Flux2WithoutFamily
    out = {"family": family_for_model(model).name}
    for mode in MODES:
        handle = enable_sequence_parallel(model, mode=mode)
        try:
            with torch.no_grad():
                out[mode] = error_of(lambda: model(**kwargs))
        finally:
            handle.disable()
    return out


def case_error_vsa_with_block_causal_mask():
    """VSA on SkyReels-V2 diffusion forcing with causal blocks: its block-causal frame mask cannot
    follow VSA's tiles, so the call is refused on every rank, naming the dense modes (which run it)."""
    model, kwargs = families.forward_cases()["skyreels_v2_diffusion_forcing"]()
    handle = enable_sequence_parallel(model, mode="vsa")
    try:
        with torch.no_grad():
            return error_of(lambda: model(**kwargs))
    finally:
        handle.disable()


def case_error_ulysses_fewer_heads_than_ranks():
    """CogVideoX with 1 head: Ulysses raises recommending kv_gather; auto picks kv_gather, which runs exactly."""
    g = _gen()
    model = tm.tiny_cogvideox_transformer(num_attention_heads=1, attention_head_dim=16)
    msg = error_of(lambda: enable_sequence_parallel(model, mode="ulysses"))
    kwargs = dict(hidden_states=torch.randn(2, 1, 4, 10, 14, generator=g),
                  encoder_hidden_states=torch.randn(2, 8, 32, generator=g), timestep=torch.tensor([500, 250]))
    with torch.no_grad():
        ref = model(**kwargs).sample
        handle = enable_sequence_parallel(model, mode="auto")
        try:
            auto = compare(ref, model(**kwargs).sample)
            auto["resolved"] = handle.mode
        finally:
            handle.disable()
    return {"ulysses_error": msg, "auto": auto}


def case_error_copy_engine_on_gloo():
    """sp_transport='copy_engine' needs CUDA ranks of one host: on gloo it raises on every rank, before
    any collective; 'auto' falls back to NCCL's (here gloo's) all-gather and runs exactly. Ulysses on a
    joint-text model (CogVideoX) refuses 'copy_engine' whatever the backend (its text rows need NCCL)."""
    g = _gen()
    model = tm.tiny_cogvideox_transformer()
    msg = error_of(lambda: enable_sequence_parallel(model, mode="kv_gather", sp_transport="copy_engine"))
    joint = error_of(lambda: enable_sequence_parallel(model, mode="ulysses", sp_transport="copy_engine"))
    kwargs = dict(hidden_states=torch.randn(2, 1, 4, 10, 14, generator=g),
                  encoder_hidden_states=torch.randn(2, 8, 32, generator=g), timestep=torch.tensor([500, 250]))
    with torch.no_grad():
        ref = model(**kwargs).sample
        handle = enable_sequence_parallel(model, mode="kv_gather", sp_transport="auto", overlap_head_groups=3)
        try:
            auto = compare(ref, model(**kwargs).sample)
            auto["transport"] = handle.transport
        finally:
            handle.disable()
    return {"error": msg, "joint_text_error": joint, "auto": auto}


def case_error_head_groups_disagree():
    """Ranks passing different overlap_head_groups would lay out the copy-engine buffer differently
    (or run different barrier counts): refused on every rank at enable time."""
    from diffusers_sp.groups import resolve_group

    rank = resolve_group().rank
    return error_of(lambda: enable_sequence_parallel(tm.tiny_cogvideox_transformer(), mode="kv_gather",
                                                     overlap_head_groups=rank + 1))


def case_error_not_a_group_member():
    """Every rank passes a process_group of rank 0 alone (``new_group([0])``): rank 0 runs at world size
    1; the others, which torch hands ``NON_GROUP_MEMBER``, get an error saying they are not members
    (it said "process_group must be a ProcessGroup, got int")."""
    import torch.distributed as dist

    only_rank0 = dist.new_group([0])
    model = tm.tiny_cogvideox_transformer()
    if dist.get_rank() == 0:
        handle = enable_sequence_parallel(model, mode="kv_gather", process_group=only_rank0)
        world = handle.world_size
        handle.disable()
        return {"world_size": world}
    return {"error": error_of(lambda: enable_sequence_parallel(model, mode="kv_gather", process_group=only_rank0))}


def case_error_processor_replaced():
    """``fuse_qkv_projections()`` after enabling replaces CogVideoX's attention processors (Diffusers'
    ``set_attn_processor``), which dropped the sequence-parallel wrappers: each rank then attended to
    its own tokens only, silently. The next forward must raise on every rank;
    fusing before enabling stays exact."""
    g = _gen()
    kwargs = dict(hidden_states=torch.randn(1, 1, 4, 10, 14, generator=g),
                  encoder_hidden_states=torch.randn(1, 8, 32, generator=g), timestep=torch.tensor([500]))
    model = tm.tiny_cogvideox_transformer()
    with torch.no_grad():
        ref = model(**kwargs).sample
        handle = enable_sequence_parallel(model, mode="kv_gather")
        model.fuse_qkv_projections()
        try:
            msg = error_of(lambda: model(**kwargs))
        finally:
            handle.disable()
        # disable() keeps the user's fused processors and hands Diffusers the original ones for
        # unfuse_qkv_projections() (it restored our wrappers, which then failed every forward).
        after_disable = compare(ref, model(**kwargs).sample)
        model.unfuse_qkv_projections()
        after_unfuse = compare(ref, model(**kwargs).sample)
        leftover = sorted({type(p).__name__ for p in model.attn_processors.values()
                           if type(p).__module__.startswith("diffusers_sp")})
        fused_first = tm.tiny_cogvideox_transformer()
        fused_first.fuse_qkv_projections()
        handle = enable_sequence_parallel(fused_first, mode="kv_gather")
        try:
            before = compare(ref, fused_first(**kwargs).sample)
        finally:
            handle.disable()
    return {"error": msg, "fused_before_enable": before, "after_disable": after_disable,
            "after_unfuse": after_unfuse, "leftover": leftover}
