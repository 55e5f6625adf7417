"""Misuse: unusual combinations of options, launches and models. Each must fail clearly (or choose well),
and never leave the ranks out of step."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

from diffusers_sp import SequenceParallelConfigError, enable_sequence_parallel
from diffusers_sp.cfg_parallel import choose_cfg_parallel
from diffusers_sp.tiny_models import tiny_wan_transformer

ROOT = Path(__file__).resolve().parents[1]


def _kwargs():
    return dict(hidden_states=torch.randn(1, 16, 5, 10, 14), timestep=torch.tensor([500.0]),
                encoder_hidden_states=torch.randn(1, 7, 32))


@pytest.mark.parametrize("family,expected", [("wan", True), ("sd3", True), ("flux", False),
                                             ("qwenimage", False), ("hunyuan_video", False)])
def test_cfg_parallel_auto_stays_off_where_cfg_is_optional(family, expected):
    from diffusers_sp.pipelines import FAMILIES

    spec = next(f for f in FAMILIES if f.name == family)
    use, reason = choose_cfg_parallel(family, 2, None, cfg_capable=spec.cfg_strategy is not None,
                                      cfg_by_default=spec.cfg_by_default)
    assert use is expected, reason


def _example(name="generate_video"):
    spec = importlib.util.spec_from_file_location(name, ROOT / f"examples/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_output_suffix_checked_before_any_work():
    example = _example()
    assert example.checked_output("out/video") == "out/video.mp4"
    assert example.checked_output("a.GIF") == "a.GIF"
    with pytest.raises(example.FlagError, match="unknown format"):
        example.main(["--output", "video.txt"])


def test_example_output_paths(tmp_path):
    """--output as the user meant it, decided before any work: a directory gets video.mp4 inside it
    ("outputs/" once became "outputs/.mp4" and failed after the whole generation); ".webm" is refused,
    since the H.264 that export_to_video writes cannot go into WebM."""
    example = _example()
    checked = example.checked_output
    assert checked("outputs/") == os.path.join("outputs/", "video.mp4")
    assert checked(str(tmp_path)) == os.path.join(str(tmp_path), "video.mp4")  # an existing directory
    for bad in ("clip.webm", "clip.png"):
        with pytest.raises(example.FlagError, match="unknown format"):
            checked(bad)


def test_example_prompts_file_checked_before_loading(tmp_path):
    example = _example()
    with pytest.raises(example.FlagError, match="no such file"):
        example.main(["--prompts-file", str(tmp_path / "missing.txt")])
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    with pytest.raises(example.FlagError, match="no prompt in it"):
        example.main(["--prompts-file", str(empty)])


@pytest.mark.parametrize("flags,match", [
    (["--vsa-sparsity", "1.5"], "--vsa-sparsity 1.5: must be in"),
    (["--height", "100"], "--height 100: must be a positive multiple of 16"),
    (["--num-frames", "16"], "--num-frames 16: must be 4k\\+1"),
    (["--steps", "0"], "--steps 0: must be at least 1"),
    (["--sp-degree", "0"], "--sp-degree 0: must be at least 1"),
])
def test_example_flag_values_checked_before_loading(flags, match):
    example = _example()
    with pytest.raises(example.FlagError, match=match):
        example.main(flags)


def test_options_are_keyword_parameters():
    """Every option is a keyword parameter of enable_sequence_parallel (help() and IDEs show them);
    a misspelt one is Python's TypeError, raised alike on every rank before anything runs."""
    import inspect

    params = inspect.signature(enable_sequence_parallel).parameters
    for name in ("attention_kernel", "sp_transport", "overlap_head_groups", "overlap_query_projection",
                 "vsa_sparsity", "vsa_tile_size", "vsa_sp_mode", "vsa_gate_weights", "cfg_parallel", "sp_degree"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    with pytest.raises(TypeError, match="sparsity"):
        enable_sequence_parallel(tiny_wan_transformer(), mode="auto", sparsity=0.5)


@pytest.mark.parametrize("options,match", [
    (dict(sp_transport="nvlink"), "sp_transport='nvlink' is not one of"),
    (dict(overlap_head_groups=0), "overlap_head_groups must be 'auto' or a positive int, got 0"),
    (dict(overlap_head_groups="4"), "overlap_head_groups must be 'auto' or a positive int, got '4'"),
])
def test_transport_options_checked(options, match):
    with pytest.raises(SequenceParallelConfigError, match=match):
        enable_sequence_parallel(tiny_wan_transformer(), mode="kv_gather", **options)


@pytest.mark.parametrize("options,match", [
    # "no" turned the parallel VAE on; 123 raised a bare TypeError.
    (dict(mode="kv_gather", parallel_vae="no"), "parallel_vae must be True or False, got 'no'"),
    (dict(mode="vsa", vsa_gate_weights=123), "vsa_gate_weights must be a path .* got int"),
])
def test_option_types_checked(options, match):
    with pytest.raises(SequenceParallelConfigError, match=match):
        enable_sequence_parallel(tiny_wan_transformer(), **options)


def test_fingerprint_covers_the_patch_size():
    """Ranks whose models differ only in patch size must not pass the cross-rank check."""
    from diffusers_sp.api import read_traits

    a = read_traits(tiny_wan_transformer())
    b = read_traits(tiny_wan_transformer(patch_size=(1, 1, 1)))
    assert a.models[0].patch_size != b.models[0].patch_size
    assert a.fingerprint() != b.fingerprint()


def test_single_process_ignores_the_transport():
    # One process transfers nothing: a script written for several GPUs still runs alone.
    model = tiny_wan_transformer()
    kwargs = _kwargs()
    with torch.no_grad():
        ref = model(**kwargs).sample
        handle = enable_sequence_parallel(model, mode="kv_gather", sp_transport="copy_engine")
        assert handle.transport == "none"  # no distributed run: nothing moves
        assert torch.equal(model(**kwargs).sample, ref)
    handle.disable()


@pytest.mark.parametrize("heads,groups,expected", [(12, "auto", [6, 6]), (12, 5, [3, 3, 2, 2, 2]),
                                                   (3, 8, [1, 1, 1]), (40, 1, [40])])
def test_head_group_sizes(heads, groups, expected):
    from diffusers_sp.copy_engine import head_group_sizes

    assert head_group_sizes(heads, groups) == expected


def test_copy_engine_availability_reasons(monkeypatch):
    """The checks behind sp_transport: each missing requirement is named, from local facts only."""
    from diffusers_sp import copy_engine
    from diffusers_sp.groups import SPGroup

    group = SPGroup(None, 0, 2, "nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "CUDA is not available" in copy_engine.copy_engine_unavailable_reason(group)
    assert "gloo" in copy_engine.copy_engine_unavailable_reason(SPGroup(None, 0, 2, "gloo"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "not NCCL" in copy_engine.copy_engine_unavailable_reason(SPGroup(None, 0, 2, "gloo"))
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert "several hosts" in copy_engine.copy_engine_unavailable_reason(group)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert "sees one GPU" in copy_engine.copy_engine_unavailable_reason(group)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: {a, b} != {1, 2})
    assert "GPUs 1 and 2 have no peer access" in copy_engine.copy_engine_unavailable_reason(group)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    assert copy_engine.copy_engine_unavailable_reason(group) is None
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert "not set" in copy_engine.copy_engine_unavailable_reason(group)


def test_example_refuses_video_without_its_writer(monkeypatch):
    """Without imageio-ffmpeg an .mp4 failed only after the whole generation (seen on a GPU machine):
    refused up front; .gif needs no ffmpeg."""
    example = _example()
    cli = sys.modules[example.FlagError.__module__]
    real = cli.importlib.util.find_spec
    monkeypatch.setattr(cli.importlib.util, "find_spec",
                        lambda name, *a: None if name == "imageio_ffmpeg" else real(name, *a))
    for path in ("out/video.mp4", "out/", "clip"):  # the last two become .mp4 files too
        with pytest.raises(example.FlagError, match="needs imageio-ffmpeg"):
            example.checked_output(path)
    assert example.checked_output("out/video.gif") == "out/video.gif"


def test_one_rank_keeps_autograd():
    """At world size 1 nothing is exchanged, so gradients flow as without diffusers-sp (the grad-mode
    guard raised there too)."""
    model = tiny_wan_transformer(num_layers=1)
    kwargs = _kwargs()
    model(**kwargs).sample.sum().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    handle = enable_sequence_parallel(model, mode="kv_gather")
    model(**kwargs).sample.sum().backward()
    handle.disable()
    assert ref and all(torch.allclose(p.grad, ref[n], atol=1e-5) for n, p in model.named_parameters() if n in ref)


def test_failed_enable_leaves_nothing_behind(monkeypatch):
    """An error while installing left processors and hooks in place and the handle on the transformer
    only, so neither disable nor a new enable worked."""
    import diffusers_sp.install as install_module
    from diffusers_sp import disable_sequence_parallel
    from diffusers_sp.tiny_models import tiny_wan_pipeline

    pipe = tiny_wan_pipeline("t2v")
    processor = type(pipe.transformer.blocks[0].attn1.processor)
    monkeypatch.setattr(install_module, "_patch_prepare_latents", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        enable_sequence_parallel(pipe, mode="kv_gather")
    assert type(pipe.transformer.blocks[0].attn1.processor) is processor
    assert getattr(pipe.transformer, "_diffusers_hook", None) is None or not [
        n for n in pipe.transformer._diffusers_hook.hooks if n.startswith("diffusers_sp")]
    # The split and gather hooks run as torch module hooks: none is left either.
    assert not [m for m in pipe.transformer.modules() if m._forward_pre_hooks or m._forward_hooks]
    monkeypatch.undo()
    enable_sequence_parallel(pipe, mode="kv_gather")
    disable_sequence_parallel(pipe)


def test_one_transformer_under_two_names_is_wrapped_once():
    """A Wan 2.2 pipeline whose transformer_2 is its transformer got a raw "hook already exists" error,
    half-enabled."""
    from diffusers_sp.tiny_models import tiny_wan_pipeline

    pipe = tiny_wan_pipeline("t2v_moe")
    pipe.transformer_2 = pipe.transformer
    handle = enable_sequence_parallel(pipe, mode="kv_gather")
    assert len(handle._models) == 1 and len(handle.traits.models) == 1
    handle.disable()


def test_disable_restores_the_users_instance_attributes():
    """disable() deleted instance attributes it had shadowed, so a user's own pipe.prepare_latents (or
    encode_prompt, vae.tiled_decode) was lost."""
    from diffusers_sp.tiny_models import tiny_wan_pipeline

    pipe = tiny_wan_pipeline("t2v")
    mine = lambda *a, **k: "mine"  # noqa: E731
    pipe.prepare_latents = mine
    handle = enable_sequence_parallel(pipe, mode="kv_gather")
    handle.patch_attribute(pipe, "prepare_latents", lambda *a, **k: "ours")
    handle.patch_attribute(pipe, "encode_prompt", lambda *a, **k: "ours")
    handle.disable()
    assert pipe.prepare_latents is mine
    assert "encode_prompt" not in vars(pipe)  # the class method shows again


def test_example_output_under_a_file_refused(tmp_path):
    """An --output inside a path that is a file, or under a broken link, failed only after the whole
    generation: refused before any work."""
    example = _example()
    (tmp_path / "afile").write_text("")
    with pytest.raises(example.FlagError, match="is not a directory"):
        example.checked_output(str(tmp_path / "afile" / "video.gif"))
    assert example.checked_output(str(tmp_path / "new" / "deeper" / "v.gif")).endswith("v.gif")
    (tmp_path / "broken").symlink_to(tmp_path / "missing")
    with pytest.raises(example.FlagError, match="broken symbolic link"):
        example.checked_output(str(tmp_path / "broken" / "v.gif"))
