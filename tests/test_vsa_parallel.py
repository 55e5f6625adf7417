"""VSA under Ulysses and K/V-gather equals single-process VSA (float32, CPU/gloo, P = 2, 3); its
validation errors; gate weights loading. See tests/cases_vsa.py."""

from __future__ import annotations

import pytest
import torch

from diffusers_sp import SequenceParallelConfigError, enable_sequence_parallel
from diffusers_sp.kernels.tiles import packed_offsets
from diffusers_sp.processors.vsa import load_gate_weights, tile_plan
from diffusers_sp.tiny_models import tiny_wan_transformer
from distributed import FLOAT32_TOL as TOL, assert_close, run_cases, values



@pytest.fixture(scope="module", params=(2, 3), ids=lambda p: f"P{p}")
def results(request):
    return request.param, run_cases("cases_vsa", request.param)


@pytest.mark.parametrize("case", ["transformer_vsa_equals_single_process", "transformer_vsa_sparsity0_equals_dense",
                                  "transformer_vsa_gate_and_small_tiles", "pipeline_vsa_equals_single_process"])
def test_vsa_parallel_equals_single_process(results, case):
    P, res = results
    for rank, v in enumerate(values(res, case)):
        for sp_mode in ("ulysses", "kv_gather"):
            assert_close(v[sp_mode], f"P={P} rank {rank} {case} {sp_mode}")
        if "differs_from_dense" in v:  # sparsity 0.9 really is sparse
            assert v["differs_from_dense"] > 1e-4
        if "gate_changes_output" in v:  # the loaded gate is really applied
            assert v["gate_changes_output"] > 1e-4


def test_vsa_too_few_tiles_refused_on_every_rank(results):
    P, res = results
    msgs = values(res, "error_vsa_too_few_tiles")
    assert len(set(msgs)) == 1 and "1 tiles" in msgs[0] and "vsa_tile_size" in msgs[0], msgs


def test_vsa_plan_first_made_under_inference_mode_serves_grad_mode(results):
    P, res = results
    for rank, v in enumerate(values(res, "vsa_plan_first_made_under_inference_mode")):
        assert_close(v["inference_mode"], f"P={P} rank {rank} inference_mode")
        assert_close(v["grad_mode"], f"P={P} rank {rank} grad mode after inference_mode")


def test_gate_file_readable_on_one_rank_only_refused_on_every_rank(results):
    P, res = results
    msgs = values(res, "error_gate_file_on_one_rank_only")
    assert len(set(msgs)) == 1, msgs
    assert "vsa_gate_weights (read)" in msgs[0] and "rank 0 'ok'" in msgs[0] and "no .safetensors file" in msgs[0]


def test_vsa_sparsity0_single_process_equals_dense():
    model = tiny_wan_transformer()
    x = torch.randn(1, 16, 5, 10, 14)
    kw = dict(hidden_states=x, timestep=torch.tensor([10.0]), encoder_hidden_states=torch.randn(1, 7, 32))
    with torch.no_grad():
        dense = model(**kw).sample
        h = enable_sequence_parallel(model, mode="vsa", vsa_sparsity=0.0)
        out = model(**kw).sample
        h.disable()
        back = model(**kw).sample
    assert (out - dense).abs().max() <= TOL * dense.abs().max()
    assert torch.equal(back, dense)


@pytest.mark.parametrize("opts,needles", [
    (dict(vsa_sparsity=1.0), ["vsa_sparsity", "[0, 1)"]),
    (dict(vsa_sparsity=-0.1), ["vsa_sparsity"]),
    (dict(vsa_tile_size=(4, 4)), ["vsa_tile_size", "three positive ints"]),
    (dict(vsa_tile_size=(4, 0, 4)), ["vsa_tile_size"]),
    (dict(vsa_sp_mode="ring"), ["vsa_sp_mode"]),
    (dict(vsa_gate_weights="/nonexistent/gates"), ["vsa_gate_weights", "no .safetensors"]),
])
def test_vsa_option_errors(opts, needles):
    with pytest.raises(SequenceParallelConfigError) as err:
        enable_sequence_parallel(tiny_wan_transformer(), mode="vsa", **opts)
    for n in needles:
        assert n in str(err.value)


def test_vsa_refused_for_image_and_joint_text_and_unreadable_grid():
    from diffusers_sp.tiny_models import tiny_cogvideox_transformer, tiny_flux_transformer, tiny_ltx_transformer

    cases = [(tiny_flux_transformer(), "image pipeline"), (tiny_cogvideox_transformer(), "joint attention"),
             (tiny_ltx_transformer(), "latent grid")]
    for model, needle in cases:
        with pytest.raises(SequenceParallelConfigError) as err:
            enable_sequence_parallel(model, mode="vsa")
        assert needle in str(err.value) and "'kv_gather'" in str(err.value), str(err.value)


def test_vsa_options_need_mode_vsa_and_handle_reports_sp_mode():
    model = tiny_wan_transformer()
    with pytest.raises(SequenceParallelConfigError, match="apply to mode='vsa' only"):
        enable_sequence_parallel(model, mode="ulysses", vsa_sparsity=0.5)
    handle = enable_sequence_parallel(model, mode="vsa", vsa_sp_mode="ulysses")
    assert (handle.mode, handle.sp_mode) == ("vsa", "ulysses")
    handle.disable()


@pytest.mark.parametrize("world_size,ulysses_degree", [(3, 1), (4, 2), (1, 1)])
def test_tile_plan_holds_the_int32_tiles_of_every_range_a_call_runs_on(world_size, ulysses_degree):
    """The tile plan holds int32 sizes and offsets for every rank's range, every Ulysses chunk and all tiles (the
    ranges the processor's calls run on), equal to the layout's sizes and their exclusive running sum; another
    range is computed on demand."""
    plan = tile_plan((5, 6, 7), (2, 2, 2), world_size, ulysses_degree=ulysses_degree)
    num_tiles = plan.layout.num_tiles
    wanted = set(plan.ranges) | set(plan.chunk_ranges) | {(0, num_tiles)}
    assert set(plan.packed) == wanted and len(plan.ranges) == world_size
    for start, end in wanted | {(1, 5)}:
        sizes, offsets = plan.packed_tiles(start, end)
        assert sizes.dtype == offsets.dtype == torch.int32
        assert torch.equal(sizes, plan.layout.block_sizes[start:end].to(torch.int32))
        assert torch.equal(offsets, packed_offsets(plan.layout.block_sizes[start:end]))
        assert int(offsets[0]) == 0


def test_handle_reports_the_vsa_backend():
    """The handle says which VSA backend runs: the reference one on CPU, the Triton kernels where they apply
    (stood in for on CPU), none in a dense mode."""
    from kernel_stand_ins import stand_in_kernels

    model = tiny_wan_transformer()
    handle = enable_sequence_parallel(model, mode="vsa", vsa_tile_size=(2, 2, 4))
    try:
        assert handle.vsa_tile == (2, 2, 4) and handle.vsa_backend() == "reference"
        with stand_in_kernels():
            assert handle.vsa_backend() == "triton"
    finally:
        handle.disable()
    handle = enable_sequence_parallel(model, mode="ulysses")
    assert handle.vsa_backend() is None
    handle.disable()


def test_gate_weights_loading(tmp_path):
    from safetensors.torch import save_file

    dim = 8
    full = {f"blocks.{i}.to_gate_compress.{n}": torch.randn(*s) for i in range(2)
            for n, s in (("weight", (dim, dim)), ("bias", (dim,)))}
    # a folder of two shards
    shard_dir = tmp_path / "ckpt"
    shard_dir.mkdir()
    keys = sorted(full)
    save_file({k: full[k] for k in keys[:2]}, str(shard_dir / "model-00001-of-00002.safetensors"))
    save_file({k: full[k] for k in keys[2:]}, str(shard_dir / "model-00002-of-00002.safetensors"))
    gates = load_gate_weights(shard_dir, num_layers=2, dim=dim)
    assert torch.equal(gates[1][0], full["blocks.1.to_gate_compress.weight"])
    assert torch.equal(gates[0][1], full["blocks.0.to_gate_compress.bias"])

    missing = dict(full)
    del missing["blocks.1.to_gate_compress.bias"]
    save_file(missing, str(tmp_path / "missing.safetensors"))
    with pytest.raises(SequenceParallelConfigError, match=r"'blocks.1.to_gate_compress.bias' is missing"):
        load_gate_weights(tmp_path / "missing.safetensors", num_layers=2, dim=dim)

    bad = dict(full)
    bad["blocks.0.to_gate_compress.weight"] = torch.randn(dim, dim + 1)
    save_file(bad, str(tmp_path / "bad.safetensors"))
    with pytest.raises(SequenceParallelConfigError, match=r"'blocks.0.to_gate_compress.weight' has shape \(8, 9\)"):
        load_gate_weights(tmp_path / "bad.safetensors", num_layers=2, dim=dim)


def test_gate_weights_for_two_transformers_need_a_dict(tmp_path):
    from diffusers_sp.tiny_models import tiny_wan_pipeline

    pipe = tiny_wan_pipeline("t2v_moe")
    with pytest.raises(SequenceParallelConfigError, match="dict"):
        enable_sequence_parallel(pipe, mode="vsa", vsa_gate_weights=str(tmp_path))
