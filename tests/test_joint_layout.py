"""Single-process unit tests: joint text/image layout helpers, key padding masks, plans, registry, auto mode."""

from __future__ import annotations

import pytest
import torch

from diffusers_sp import SequenceParallelConfigError, enable_sequence_parallel
from diffusers_sp.pipelines import FAMILIES, family_for_model, plan_without, supported_models
from diffusers_sp.processors.base import (full_sequence_mask, join_text_image, normalize_key_padding_mask, query_rows,
                                          split_text_image)
from diffusers_sp.traits import ModelTraits, PipelineTraits
from diffusers_sp.validation import choose_auto_mode, validate_mode


@pytest.mark.parametrize("layout", ["prefix", "suffix"])
def test_split_join_roundtrip(layout):
    x = torch.arange(2 * 3 * 9 * 4).reshape(2, 3, 9, 4)
    text, image = split_text_image(x, 4, layout)
    assert text.shape[2] == 4 and image.shape[2] == 5
    assert torch.equal(text, x[:, :, :4] if layout == "prefix" else x[:, :, 5:])
    assert torch.equal(join_text_image(text, image, layout), x)


def test_no_text_is_identity():
    x = torch.randn(1, 2, 5, 3)
    text, image = split_text_image(x, 0, None)
    assert text.shape[2] == 0 and image is x
    assert join_text_image(text, image, None) is x


def test_key_padding_mask_shapes():
    assert normalize_key_padding_mask(None, 2, 3, 9, "p") is None
    assert normalize_key_padding_mask(torch.ones(2, 9, dtype=torch.bool)[:, None, None], 2, 3, 9, "p").shape == (2, 1, 1, 9)
    assert normalize_key_padding_mask(torch.zeros(2, 3, 1, 9), 2, 3, 9, "p").shape == (2, 3, 1, 9)
    assert normalize_key_padding_mask(torch.zeros(9), 2, 3, 9, "p").shape == (1, 1, 1, 9)
    with pytest.raises(SequenceParallelConfigError, match="depends on the query position"):
        normalize_key_padding_mask(torch.ones(2, 1, 9, 9, dtype=torch.bool), 2, 3, 9, "p")
    with pytest.raises(SequenceParallelConfigError, match="not a key padding mask"):
        normalize_key_padding_mask(torch.ones(2, 1, 1, 8, dtype=torch.bool), 2, 3, 9, "p")


def test_full_sequence_mask_rows():
    """A mask over the full sequence (T = 2 text tokens, 7 image tokens on ranks of 3 and 4): K/V-gather's
    rows of rank 1 are the text rows and rows 5..8 of the image part, in the call's order."""
    L = 9
    mask = torch.arange(L * L).reshape(1, 1, L, L)
    assert full_sequence_mask(mask[0, 0], 2, 3, L, "p").shape == (1, 1, L, L)
    assert full_sequence_mask(torch.ones(2, 1, 1, L), 2, 3, L, "p").shape == (2, 1, 1, L)
    prefix = query_rows(mask, 2, "prefix", [3, 4], 1)
    assert torch.equal(prefix, mask[:, :, [0, 1, 5, 6, 7, 8]])
    suffix = query_rows(mask, 2, "suffix", [3, 4], 0)
    assert torch.equal(suffix, mask[:, :, [0, 1, 2, 7, 8]])
    assert torch.equal(query_rows(mask, 0, None, [4, 5], 1), mask[:, :, 4:])
    key_padding = torch.ones(1, 1, 1, L)
    assert query_rows(key_padding, 2, "prefix", [3, 4], 1) is key_padding
    with pytest.raises(SequenceParallelConfigError, match="rows of this rank's queries"):
        full_sequence_mask(torch.ones(1, 1, 4, L), 2, 3, L, "p")


def test_plans_keep_text_replicated():
    """Plans derived from Diffusers' _cp_plan drop every text entry."""
    from diffusers_sp import tiny_models as tm

    for build in (tm.tiny_flux_transformer, tm.tiny_qwenimage_transformer, tm.tiny_ltx_transformer):
        model = build()
        plan = family_for_model(model).sharding_plan(model)
        text = repr(plan)
        for name in ("encoder_hidden_states", "txt_ids", "encoder_attention_mask"):
            for key, entry in plan.items():
                if isinstance(entry, dict):
                    assert name not in entry, (type(model).__name__, key, text)
    qwen = tm.tiny_qwenimage_transformer()
    assert list(family_for_model(qwen).sharding_plan(qwen)["pos_embed"]) == [0]  # txt_freqs (output 1) stays whole


def test_plan_without():
    plan = {"": {"a": 1, "b": 2}, "x": {"c": 3}, "out": "gather"}
    assert plan_without(plan, {"": ("b",), "x": ("c",)}) == {"": {"a": 1}, "out": "gather"}
    assert plan == {"": {"a": 1, "b": 2}, "x": {"c": 3}, "out": "gather"}


def test_unsupported_target_lists_what_runs():
    class StableCascadeCombinedPipeline:  # not a Diffusers pipeline or transformer
        pass

    with pytest.raises(SequenceParallelConfigError) as exc:
        enable_sequence_parallel(StableCascadeCombinedPipeline(), mode="auto")
    for name in supported_models():
        assert name in str(exc.value)


def test_pipelines_accepted_by_what_they_hold():
    """A pipeline class no family names runs when its transformer does (FluxKontext holds a Flux
    transformer); one holding a transformer nothing runs is refused, naming the component."""
    from diffusers import FluxKontextPipeline, FluxTransformer2DModel

    from diffusers_sp import tiny_models as tm
    from diffusers_sp.pipelines import resolve_target

    flux = tm.tiny_flux_pipeline()
    kontext = FluxKontextPipeline(**flux.components)
    family, models = resolve_target(kontext)
    assert family.name == "flux" and [(a, type(m)) for a, m in models] == [("transformer", FluxTransformer2DModel)]
    kontext.register_modules(transformer=torch.nn.Linear(2, 2))
    with pytest.raises(SequenceParallelConfigError, match=r"FluxKontextPipeline.transformer is a Linear"):
        enable_sequence_parallel(kontext, mode="auto")


def _traits(heads: int) -> PipelineTraits:
    m = ModelTraits(name="M", attribute="transformer", num_heads=heads, head_dim=8, is_video=False,
                    patch_size=(2, 2), joint_text="prefix", text_mask=True, num_attention_layers=1)
    return PipelineTraits(name="P", family="f", is_video=False, models=(m,))


@pytest.mark.parametrize("heads", [1, 2, 3, 5, 6, 24, 30])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
def test_auto_never_picks_a_failing_mode(heads, world):
    mode = choose_auto_mode(_traits(heads), world)
    assert validate_mode(mode, _traits(heads), world) == mode
    if heads < world:
        assert mode == "kv_gather"
        with pytest.raises(SequenceParallelConfigError, match="kv_gather"):
            validate_mode("ulysses", _traits(heads), world)


def test_registry_modes_and_layouts():
    for fam in FAMILIES:
        assert {"ulysses", "kv_gather"} <= set(fam.modes) <= {"ulysses", "kv_gather", "vsa"}
        # VSA needs the latent grid and no text inside self-attention.
        assert ("vsa" in fam.modes) == (fam.latent_grid is not None and fam.joint_text is None and fam.is_video)
        assert fam.joint_text in (None, "prefix", "suffix")
