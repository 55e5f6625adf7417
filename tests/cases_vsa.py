"""Cases for tests/test_vsa_parallel.py: video sparse attention under Ulysses and K/V-gather.

The tiny Wan latent 5 x 10 x 14 patchifies to a (5, 5, 7) grid: with (4, 4, 4) tiles that is
2 x 2 x 2 = 8 tiles, every one of them partial along at least one axis, and 175 tokens.
Single-process VSA is the same model with VSA enabled on a one-rank group.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from diffusers_sp import SequenceParallelConfigError, disable_sequence_parallel, enable_sequence_parallel
from diffusers_sp.tiny_models import tiny_wan_pipeline, tiny_wan_transformer

from cases_wan import _inputs
from distributed import compare

SPARSITY = 0.9


@functools.lru_cache(maxsize=None)
def _solo_group_name() -> str:
    """Name of a one-rank process group of this rank (every rank creates every group, as new_group
    requires). The name, not the group, is kept: a kept group would outlive the workers' teardown."""
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    return groups[dist.get_rank()].group_name


def _solo_group():
    return dist.distributed_c10d._resolve_process_group(_solo_group_name())


def _model_kwargs():
    x, t, e = _inputs()
    return dict(hidden_states=x, timestep=t, encoder_hidden_states=e)


def _vsa_run(model, kwargs, process_group=None, **opts):
    handle = enable_sequence_parallel(model, mode="vsa", process_group=process_group, **opts)
    try:
        with torch.no_grad():
            return model(**kwargs).sample
    finally:
        handle.disable()


def case_transformer_vsa_equals_single_process():
    model, kwargs = tiny_wan_transformer(), _model_kwargs()
    out = {}
    for sp_mode in ("ulysses", "kv_gather"):
        ref = _vsa_run(model, kwargs, _solo_group(), vsa_sparsity=SPARSITY, vsa_sp_mode=sp_mode)
        out[sp_mode] = compare(ref, _vsa_run(model, kwargs, vsa_sparsity=SPARSITY, vsa_sp_mode=sp_mode))
    with torch.no_grad():
        dense = model(**kwargs).sample
    out["differs_from_dense"] = compare(dense, ref)["max_abs"]
    return out


def case_transformer_vsa_sparsity0_equals_dense():
    model, kwargs = tiny_wan_transformer(), _model_kwargs()
    with torch.no_grad():
        dense = model(**kwargs).sample
    return {m: compare(dense, _vsa_run(model, kwargs, vsa_sparsity=0.0, vsa_sp_mode=m)) for m in ("ulysses", "kv_gather")}


def case_transformer_vsa_gate_and_small_tiles(tmp_dir=None):
    """A non-zero gate (loaded from safetensors) and (2, 2, 2) tiles (many partial tiles)."""
    import os
    import tempfile

    from safetensors.torch import save_file

    model, kwargs = tiny_wan_transformer(), _model_kwargs()
    dim = model.config.num_attention_heads * model.config.attention_head_dim
    path = os.path.join(tempfile.gettempdir(), f"vsa_gate_rank{dist.get_rank()}.safetensors")
    g = torch.Generator().manual_seed(5)
    save_file({f"blocks.{i}.to_gate_compress.{n}": torch.randn(*s, generator=g) * 0.1
               for i in range(len(model.blocks)) for n, s in (("weight", (dim, dim)), ("bias", (dim,)))}, path)
    opts = dict(vsa_sparsity=0.5, vsa_tile_size=(2, 2, 2), vsa_gate_weights=path)
    out = {}
    for sp_mode in ("ulysses", "kv_gather"):
        ref = _vsa_run(model, kwargs, _solo_group(), vsa_sp_mode=sp_mode, **opts)
        out[sp_mode] = compare(ref, _vsa_run(model, kwargs, vsa_sp_mode=sp_mode, **opts))
    no_gate = _vsa_run(model, kwargs, _solo_group(), vsa_sparsity=0.5, vsa_tile_size=(2, 2, 2))
    out["gate_changes_output"] = compare(no_gate, ref)["max_abs"]
    return out


@functools.lru_cache(maxsize=None)
def _pipe():
    return tiny_wan_pipeline("t2v")


def case_pipeline_vsa_equals_single_process():
    pipe = _pipe()
    call = dict(prompt="a cat runs on the grass", negative_prompt="rain", height=80, width=112, num_frames=17,
                num_inference_steps=3, guidance_scale=5.0, output_type="latent")
    out = {}
    for sp_mode in ("ulysses", "kv_gather"):
        frames = []
        for group in (_solo_group(), None):
            enable_sequence_parallel(pipe, mode="vsa", process_group=group, vsa_sparsity=SPARSITY, vsa_sp_mode=sp_mode)
            frames.append(pipe(**call, generator=torch.Generator().manual_seed(0)).frames)
            disable_sequence_parallel(pipe)
        out[sp_mode] = compare(frames[0], frames[1])
    return out


def case_error_vsa_too_few_tiles():
    """A (1, 1, 1) latent grid with (4, 4, 4) tiles has one tile for P > 1 ranks: refused in the forward."""
    model = tiny_wan_transformer()
    handle = enable_sequence_parallel(model, mode="vsa")
    try:
        with torch.no_grad():
            model(hidden_states=torch.randn(1, 16, 1, 2, 2), timestep=torch.tensor([1.0]),
                  encoder_hidden_states=torch.randn(1, 4, 32))
    except SequenceParallelConfigError as exc:
        return str(exc)
    finally:
        handle.disable()
    return "no error"


def case_vsa_plan_first_made_under_inference_mode():
    """The tile plan is cached per grid for the process; one first made under torch.inference_mode()
    held inference tensors, and every later forward of that grid with grad on raised "Inference tensors
    cannot be saved for backward". A grid no other case uses: 3 x 10 x 14."""
    x, t, e = _inputs()
    kwargs = dict(hidden_states=x[:, :, :3], timestep=t, encoder_hidden_states=e)
    model = tiny_wan_transformer()
    ref = _vsa_run(model, kwargs, _solo_group(), vsa_sparsity=0.5, vsa_sp_mode="kv_gather")
    handle = enable_sequence_parallel(model, mode="vsa", vsa_sparsity=0.5, vsa_sp_mode="kv_gather")
    try:
        with torch.inference_mode():
            first = model(**kwargs).sample.clone()
        grad_on = model(**kwargs).sample.detach()  # grad mode, parameters requiring grad
    finally:
        handle.disable()
    return {"inference_mode": compare(ref, first), "grad_mode": compare(ref, grad_on)}


def case_error_gate_file_on_one_rank_only():
    """A vsa_gate_weights file that only rank 0 can read (a path on one host's disk): whether each rank
    could read it is compared with the options, so every rank raises the same error instead of the
    others raising alone while rank 0 waits in the enable-time check."""
    import os
    import tempfile

    from safetensors.torch import save_file

    from distributed import error_of

    dim = 6 * 12
    path = os.path.join(tempfile.gettempdir(), f"diffusers_sp_gate_{os.getppid()}.safetensors")
    if dist.get_rank() == 0:
        save_file({f"blocks.{i}.to_gate_compress.{n}": torch.zeros(*shape) for i in range(2)
                   for n, shape in (("weight", (dim, dim)), ("bias", (dim,)))}, path)
    else:
        path += ".not_on_this_host"
    try:
        return error_of(lambda: enable_sequence_parallel(tiny_wan_transformer(), mode="vsa", vsa_gate_weights=path))
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            os.remove(path)
