"""Cases run on every rank by tests/test_hybrid.py: hybrid sequence parallelism (Ulysses inside groups
of U ranks, K/V-gather across them) against one process, float32, CPU/gloo.

World sizes 4 (2 x 2; inside the spawn of tests/cases_cfg.py) and 6 (2 x 3 and 3 x 2; 6 x 1 and 1 x 6
too), and 8 for CFG parallelism and replicas around a 2 x 2 mesh. Token counts: 175 (Wan, 5 x 5 x 7)
and 35 (the family configs), which divide none of 2, 3, 4, 6, 8. Every case compares with the same
process's own single-process output on the same inputs.
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch
import torch.distributed as dist

from diffusers_sp import enable_sequence_parallel
from diffusers_sp.tiny_models import tiny_wan_pipeline, tiny_wan_transformer

import families
from cases_wan import CALL, _count_kv_first, _inputs
from distributed import compare, error_of


#: Cases that need CFG groups or replicas of at least 2 x 2 ranks (1 x 2 at world 4, 2 x 2 at world 8).
LAYOUT_CASES = ("cfg_hybrid", "replicas_hybrid")


def cases_at(world_size: int) -> list[str]:
    """The cases that run at ``world_size`` (4 and 6; 8 runs only :data:`LAYOUT_CASES`). World 4 runs
    inside the spawn of tests/cases_cfg.py (``cases_cfg.results``)."""
    import sys

    from distributed import case_names

    names = case_names(sys.modules[__name__])
    if world_size == 8:
        return list(LAYOUT_CASES)
    return [n for n in names if n not in LAYOUT_CASES or world_size == 4]


def _world() -> int:
    return dist.get_world_size()


def _degrees(heads: int, world: int | None = None) -> list[int]:
    """Every Ulysses degree U of a ``world``-rank group (default: the launch) that ``heads`` allow."""
    world = world or _world()
    return [u for u in range(1, world + 1) if world % u == 0 and u <= heads]


def _wan_kwargs():
    x, t, e = _inputs()
    return dict(hidden_states=x, timestep=t, encoder_hidden_states=e)


def _forward_degrees(model, kwargs, degrees, output=lambda out: out.sample, **opts) -> dict:
    """``mode="hybrid"`` at each Ulysses degree against the model's own output."""
    with torch.no_grad():
        ref = output(model(**kwargs))
        results = {}
        for u in degrees:
            handle = enable_sequence_parallel(model, mode="hybrid", ulysses_degree=u, **opts)
            try:
                calls = _count_kv_first(model) if hasattr(model, "blocks") else []
                results[u] = compare(ref, output(model(**kwargs)))
                results[u].update(mode=handle.mode, ulysses=handle.ulysses_degree, kv_gather=handle.kv_gather_degree,
                                  kv_first_calls=len(calls), seq_len=handle._models[0].state.seq_len)
            finally:
                handle.disable()
        results["restored_bitwise"] = torch.equal(output(model(**kwargs)), ref)
    return results


def case_wan_forward():
    """Tiny Wan (6 heads) at every factorisation of the world size."""
    return _forward_degrees(tiny_wan_transformer(), _wan_kwargs(), _degrees(6))


def case_wan_forward_uneven_heads():
    """5 heads: uneven over every Ulysses degree above 1 (3 + 2 at 2, 2 + 2 + 1 at 3)."""
    return _forward_degrees(tiny_wan_transformer(num_attention_heads=5), _wan_kwargs(), _degrees(5))


def case_wan_forward_generic_path():
    """Without Wan's K/V-first path (the model's processor with its attention call taken over)."""
    return _forward_degrees(tiny_wan_transformer(), _wan_kwargs(), [u for u in _degrees(6) if 1 < u < _world()],
                            overlap_query_projection=False)


def case_wan_forward_fewer_heads_than_ranks():
    """2 heads on 4 or 6 ranks: Ulysses alone cannot run; hybrid 2 x P/2 can, and auto picks it."""
    model = tiny_wan_transformer(num_attention_heads=2)
    kwargs = _wan_kwargs()
    out = _forward_degrees(model, kwargs, [2])
    with torch.no_grad():
        ref = model(**kwargs).sample
        handle = enable_sequence_parallel(model, mode="auto")
        try:
            out["auto"] = compare(ref, model(**kwargs).sample)
            out["auto"].update(mode=handle.mode, ulysses=handle.ulysses_degree)
        finally:
            handle.disable()
    out["ulysses_error"] = error_of(lambda: enable_sequence_parallel(model, mode="ulysses"))
    return out


def _family_forward(name: str) -> dict:
    model, kwargs = families.forward_cases()[name]()
    heads = model.config.num_attention_heads
    return _forward_degrees(model, kwargs, _degrees(heads))


def case_hunyuan_video_ragged_text():
    """HunyuanVideo: joint attention, text last, a batch of two prompts of 7 and 4 tokens (key padding mask)."""
    return _family_forward("hunyuan_video_ragged_prompts")


def case_qwenimage_ragged_text():
    """QwenImage: joint attention, text first, a ragged text mask (8 and 3 tokens); 5 heads, uneven."""
    return _family_forward("qwenimage_ragged_prompts")


def case_wan_pipeline():
    """A whole Wan T2V call (3 steps, CFG) on a nontrivial factorisation."""
    pipe = tiny_wan_pipeline("t2v")
    pipe.set_progress_bar_config(disable=True)
    call = dict(CALL, prompt="a cat runs on the grass", negative_prompt="rain", num_inference_steps=3,
                output_type="latent")
    ref = torch.as_tensor(pipe(**call, generator=torch.Generator().manual_seed(0)).frames)
    out = {}
    for u in [u for u in _degrees(6) if 1 < u < _world()][:1]:
        handle = enable_sequence_parallel(pipe, mode="hybrid", ulysses_degree=u)
        try:
            out[u] = compare(ref, torch.as_tensor(pipe(**call, generator=torch.Generator().manual_seed(0)).frames))
        finally:
            handle.disable()
    return out


# ------------------------------------------------------------------ functional: masks on raw tensors


def _mesh(u: int):
    from diffusers_sp.groups import build_parallel_groups

    return build_parallel_groups(1, 1, _world(), u).hybrid


def _functional(u: int, text_len: int, layout, mask_kind: str | None, heads: int = 5):
    """A hybrid processor's attention call on raw ``[B, H, T + S_r, D]`` tensors against SDPA on the whole
    sequence: key padding masks (ragged text, boolean or additive, per head), a block-causal mask over
    the full sequence, a padding mask over queries and keys."""
    from cases_families import _ModelProcessor, _full_mask
    from diffusers_sp.processors import HybridAttnProcessor
    from diffusers_sp.processors.masks import split_text_image
    from diffusers_sp.sharding import SequenceState, shard

    mesh = _mesh(u)
    group = _sp_group()
    g = torch.Generator().manual_seed(7)
    B, S, D = 2, 35, 8
    L = S + text_len
    q, k, v = (torch.randn(B, heads, L, D, generator=g) for _ in range(3))

    def local(x, dim=2):
        t, i = split_text_image(x, text_len, layout, dim=dim)
        i = shard(i, dim, group.rank, group.world_size)
        return torch.cat([t, i] if layout == "prefix" else [i, t], dim=dim)

    if mask_kind in ("bool", "float", "key_per_head"):
        keep = torch.ones(B, heads if mask_kind == "key_per_head" else 1, 1, L, dtype=torch.bool)
        txt, _ = split_text_image(keep, text_len, layout, dim=3)
        txt[0, ..., max(text_len - 2, 0):] = False  # ragged text: sample 0 has 2 padding tokens
        if mask_kind == "key_per_head":
            keep[1, 1, ..., :3] = False
        full = keep if mask_kind != "float" else torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
        mask = local(full, 3)  # this call's keys, as the model builds it locally
    elif mask_kind == "both_sides":
        m = torch.ones(B, L, dtype=torch.bool)
        txt, img = split_text_image(m, text_len, layout, dim=1)
        txt[0, -2:] = False
        img[1, -2:] = False
        full = (m[:, :, None] & m[:, None, :])[:, None]
        mask = local(local(full, 2), 3)
    elif mask_kind is not None:  # a mask over the full sequence, made before the split (cases_families)
        full = mask = _full_mask(mask_kind, B, heads, text_len, layout, S)
    else:
        full = mask = None
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=full)
    state = SequenceState(group, extra={"joint_text": layout}, mesh=mesh)
    state.seq_len = S
    processor = HybridAttnProcessor(_ModelProcessor(), state)
    return compare(local(ref), processor._attend(local(q), local(k), local(v), attn_mask=mask))


def _sp_group():
    from diffusers_sp.groups import resolve_group

    return resolve_group()


def case_functional_masks():
    out = {}
    for u in [u for u in _degrees(5) if 1 < u < _world()]:
        out[f"{u} prefix bool"] = _functional(u, 6, "prefix", "bool")
        out[f"{u} suffix float"] = _functional(u, 5, "suffix", "float")
        out[f"{u} suffix per_head"] = _functional(u, 4, "suffix", "key_per_head")
        out[f"{u} no text"] = _functional(u, 0, None, None, heads=4)
        out[f"{u} full block_causal prefix"] = _functional(u, 6, "prefix", "block_causal")
        out[f"{u} full per_head suffix"] = _functional(u, 4, "suffix", "per_head")
        out[f"{u} both sides prefix"] = _functional(u, 6, "prefix", "both_sides")
    return out


# ------------------------------------------------------------------ VSA over the hybrid mesh


def case_vsa_hybrid():
    """VSA with vsa_sp_mode='hybrid' against VSA on a one-rank group (8 tiles of the tiny Wan grid)."""
    from cases_vsa import SPARSITY, _solo_group, _vsa_run

    model, kwargs = tiny_wan_transformer(), _wan_kwargs()
    ref = _vsa_run(model, kwargs, _solo_group(), vsa_sparsity=SPARSITY)
    out = {}
    for u in [u for u in _degrees(6) if 1 < u < _world()]:
        handle = enable_sequence_parallel(model, mode="vsa", vsa_sp_mode="hybrid", ulysses_degree=u,
                                          vsa_sparsity=SPARSITY)
        try:
            with torch.no_grad():
                out[u] = compare(ref, model(**kwargs).sample)
            out[u].update(sp_mode=handle.sp_mode, ulysses=handle.ulysses_degree)
        finally:
            handle.disable()
    with torch.no_grad():
        out["differs_from_dense"] = compare(model(**kwargs).sample, ref)["max_abs"]
    return out


# ------------------------------------------------------------------ auto on emulated topologies


@contextlib.contextmanager
def _ranks_per_host(n: int):
    """Emulates hosts of ``n`` ranks each: ``LOCAL_WORLD_SIZE``, as torchrun sets it on a multi-host launch."""
    before = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(n)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LOCAL_WORLD_SIZE", None)
        else:
            os.environ["LOCAL_WORLD_SIZE"] = before


def case_auto_emulated_hosts():
    """``mode="auto"`` with every host size that divides the world (tiny Wan, 6 heads): the choice, and
    the output against one process."""
    model, kwargs = tiny_wan_transformer(), _wan_kwargs()
    world = _world()
    out = {}
    with torch.no_grad():
        ref = model(**kwargs).sample
        for host in [h for h in range(1, world + 1) if world % h == 0]:
            with _ranks_per_host(host):
                handle = enable_sequence_parallel(model, mode="auto")
            try:
                out[host] = compare(ref, model(**kwargs).sample)
                out[host].update(mode=handle.mode, ulysses=handle.ulysses_degree, kv_gather=handle.kv_gather_degree)
            finally:
                handle.disable()
    return out


def case_log_line():
    """The enable log line names the factorisation (rank 0 logs it)."""
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("diffusers_sp")
    keep, level = Keep(), logger.level
    logger.addHandler(keep)
    logger.setLevel(logging.INFO)
    try:
        handle = enable_sequence_parallel(tiny_wan_transformer(), mode="hybrid", ulysses_degree=2)
        handle.disable()
    finally:
        logger.removeHandler(keep)
        logger.setLevel(level)
    return records


# ------------------------------------------------------------------ errors


def case_errors():
    model = tiny_wan_transformer()
    world = _world()
    return {
        "not_a_divisor": error_of(lambda: enable_sequence_parallel(model, mode="hybrid", ulysses_degree=5)),
        "too_few_heads": error_of(lambda: enable_sequence_parallel(
            tiny_wan_transformer(num_attention_heads=2), mode="hybrid", ulysses_degree=world // 2 if world > 4 else 4)),
        "ulysses_contradicts": error_of(lambda: enable_sequence_parallel(model, mode="ulysses", ulysses_degree=2)),
        "kv_gather_contradicts": error_of(lambda: enable_sequence_parallel(model, mode="kv_gather", ulysses_degree=2)),
        "copy_engine": error_of(lambda: enable_sequence_parallel(model, mode="hybrid", ulysses_degree=2,
                                                                 sp_transport="copy_engine")),
        "process_group": error_of(lambda: enable_sequence_parallel(model, mode="hybrid", ulysses_degree=2,
                                                                   process_group=dist.group.WORLD)),
        "vsa_sp_mode_contradicts": error_of(lambda: enable_sequence_parallel(
            model, mode="vsa", vsa_sp_mode="kv_gather", ulysses_degree=2)),
    }


def case_auto_falls_back_where_hybrid_cannot_run():
    """Fewer heads than ranks makes "auto" choose hybrid, which builds its groups from the whole launch and
    uses the collectives: with a process_group of the user's or the copy engines asked for, "auto" (and
    VSA's vsa_sp_mode="auto") runs K/V-gather instead of choosing a mode it then refuses."""
    model = tiny_wan_transformer(num_attention_heads=2)
    kwargs = _wan_kwargs()
    out = {}
    with torch.no_grad():
        ref = model(**kwargs).sample
        for name, opts in (("process_group", dict(mode="auto", process_group=dist.group.WORLD)),
                           ("vsa_process_group", dict(mode="vsa", vsa_tile_size=(1, 2, 2), vsa_sparsity=0.0,
                                                      process_group=dist.group.WORLD))):
            handle = enable_sequence_parallel(model, **opts)
            try:
                out[name] = dict(sp_mode=handle.sp_mode, ulysses=handle.ulysses_degree)
                if name == "process_group":
                    out[name].update(compare(ref, model(**kwargs).sample))
            finally:
                handle.disable()
        out["copy_engine"] = error_of(lambda: enable_sequence_parallel(model, sp_transport="copy_engine").disable())
    return out


def case_refused_on_one_rank_alike_everywhere():
    """A setting refused on one rank only (rank 0 passes ulysses_degree=5, which divides neither 4 nor 6;
    the others a valid 2) gives every rank the same error, instead of leaving the others waiting."""
    model = tiny_wan_transformer()
    bad = 5 if dist.get_rank() == 0 else 2
    msg = error_of(lambda: enable_sequence_parallel(model, mode="hybrid", ulysses_degree=bad))
    group_ok = torch.ones(1)
    dist.all_reduce(group_ok)  # the group is still usable afterwards
    return {"error": msg, "sum": group_ok.item()}


# ------------------------------------------------------------------ CFG parallelism and replicas (world 8)


def _pipeline_layout(**opts) -> dict:
    from cases_cfg import PROMPTS, _pipe, _run
    from diffusers_sp.replicas import split_for_replica

    pipe = _pipe("t2v")
    pipe.set_progress_bar_config(disable=True)
    refs = {i: _run(pipe, prompt=p) for i, p in enumerate(PROMPTS[:2])}
    handle = enable_sequence_parallel(pipe, mode="hybrid", ulysses_degree=2, **opts)
    try:
        out = {"layout": dict(replicas=handle.num_replicas, cfg=handle.cfg_degree, kv_gather=handle.kv_gather_degree,
                              ulysses=handle.ulysses_degree, replica=handle.replica_index, cfg_rank=handle.cfg_rank)}
        for index, prompt in split_for_replica(list(PROMPTS[:2]), handle.replica_index, handle.num_replicas):
            out[index] = compare(refs[index], _run(pipe, prompt=prompt))
        out["parallel_steps"] = sum(h.stats["parallel"] for h in handle._cfg_hooks)
    finally:
        handle.disable()
    return out


def case_cfg_hybrid():
    """world = cfg 2 x kv_gather 2 x ulysses 2 (at 8 ranks)."""
    return _pipeline_layout(cfg_parallel=True)


def case_replicas_hybrid():
    """world = 2 replicas x kv_gather 2 x ulysses 2 (at 8 ranks): each replica one prompt."""
    return _pipeline_layout(sp_degree=_world() // 2)
