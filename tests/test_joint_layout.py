"""Single-process unit tests: joint text/image layout helpers, key padding masks, plans, registry, auto mode."""

from __future__ import annotations

import math

import pytest
import torch

from diffusers_sp import SequenceParallelConfigError, enable_sequence_parallel
from diffusers_sp.pipelines import FAMILIES, family_for_model, plan_without, supported_models
from diffusers_sp.processors.masks import (full_sequence_mask, is_image_identity_mask, join_text_image,
                                          normalize_key_padding_mask, query_rows, split_text_image,
                                          symmetric_padding_vector)
from diffusers_sp.plan_entries import end_whole, split_value
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


def _pag_mask(image_len: int, text_len: int) -> torch.Tensor:
    """The perturbed-pass mask that Diffusers' PAGJointAttnProcessor2_0 builds: [image; text], image block the identity."""
    mask = torch.zeros(image_len + text_len, image_len + text_len)
    mask[:image_len, :image_len] = float("-inf")
    mask[:image_len, :image_len].fill_diagonal_(0)
    return mask[None, None]


def test_image_identity_mask():
    pag = _pag_mask(5, 3)
    assert is_image_identity_mask(pag, 3, "suffix")
    assert is_image_identity_mask(pag[0, 0], 3, "suffix") and is_image_identity_mask(pag == 0, 3, "suffix")
    assert not is_image_identity_mask(pag, 3, "prefix")  # the text is not where the family has it
    assert not is_image_identity_mask(torch.zeros(1, 1, 8, 8), 3, "suffix")  # open: not the identity
    blocked = pag.clone()
    blocked[..., 0, 6] = float("-inf")  # an image query that does not see all the text
    assert not is_image_identity_mask(blocked, 3, "suffix")
    other = pag.clone()
    other[..., 6, 0] = -1.0  # neither open nor closed
    assert not is_image_identity_mask(other, 3, "suffix")
    assert is_image_identity_mask(_pag_mask(4, 0), 0, None)


def test_padding_mask_over_queries_and_keys_is_recognized():
    """M[q, k] = m[q] and m[k] gives m back as a key padding mask (boolean, and the float 0/1 form
    CogView4 builds); masks of any other form give None (and stay refused as query-dependent)."""
    m = torch.tensor([[True, True, False, True], [True, False, True, True]])
    both = (m[:, :, None] & m[:, None, :])[:, None]
    assert torch.equal(symmetric_padding_vector(both, 2, 3, 4), m[:, None, None, :])
    f = m.float()
    cogview4 = ((f[:, :, None] @ f[:, None, :]) > 0)[:, None].to(torch.float32)
    assert torch.equal(symmetric_padding_vector(cogview4, 2, 3, 4), f[:, None, None, :])
    assert symmetric_padding_vector(torch.ones(4, 4, dtype=torch.bool).tril(), 2, 3, 4) is None  # causal
    assert symmetric_padding_vector(cogview4 * 2.0, 2, 3, 4) is None  # a bias of 2: not a padding vector
    assert symmetric_padding_vector(both[..., :3], 2, 3, 4) is None  # not square over the call's tokens
    assert symmetric_padding_vector(m[:, None, None, :], 2, 3, 4) is None  # a key padding mask already


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


def test_transformer2d_runs_with_token_ids_only():
    """Diffusers' generic Transformer2DModel runs as VQ-Diffusion's (token-id inputs); with continuous inputs
    it is refused in one line, before any collective."""
    from diffusers import Transformer2DModel

    model = Transformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=1,
                               norm_num_groups=2)
    with pytest.raises(SequenceParallelConfigError, match="with continuous or patched inputs is not parallelized"):
        enable_sequence_parallel(model, mode="kv_gather")


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
    if heads < world:  # Ulysses cannot run; hybrid over gcd(heads, world) ranks where that is above 1
        assert mode == ("hybrid" if math.gcd(heads, world) > 1 else "kv_gather")
        with pytest.raises(SequenceParallelConfigError, match="kv_gather"):
            validate_mode("ulysses", _traits(heads), world)


def test_registry_modes_and_layouts():
    for fam in FAMILIES:
        assert {"ulysses", "kv_gather"} <= set(fam.modes) <= {"ulysses", "kv_gather", "vsa"}
        # VSA needs the latent grid and no text inside self-attention.
        assert ("vsa" in fam.modes) == (fam.latent_grid is not None and fam.joint_text is None and fam.is_video)
        assert fam.joint_text in (None, "prefix", "suffix")


def test_prefix_count_gives_each_rank_its_part_or_refuses():
    """PrefixCount (HunyuanVideo token_replace's ``num_tokens``): each rank gets the leading tokens its
    shard holds; before any split, or with the tokens reordered (VSA tiles), it refuses alike."""
    from diffusers_sp.groups import SPGroup
    from diffusers_sp.plan_entries import PrefixCount, SequenceState
    from diffusers_sp.shards import TokenOrder

    parts = []
    for rank in range(3):
        state = SequenceState(SPGroup(None, rank, 3, "gloo"), seq_len=11)  # shards 4, 4, 3
        parts.append(PrefixCount().split_value(state, 6, "n"))
    assert parts == [4, 2, 0]
    state = SequenceState(SPGroup(None, 0, 3, "gloo"))
    with pytest.raises(SequenceParallelConfigError, match="before any sequence tensor was split"):
        PrefixCount().split_value(state, 6, "n")
    state.seq_len = 11
    state.order = TokenOrder(torch.arange(11), torch.arange(11), (4, 4, 3))
    with pytest.raises(SequenceParallelConfigError, match="reordered"):
        PrefixCount().split_value(state, 6, "n")
    assert PrefixCount().split_value(state, None, "n") is None


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("count", [0, 1, 15, 20, 35])
def test_tail_count_is_each_ranks_share_of_the_last_tokens(world, count):
    """TailCount (Helios' original_context_length): each rank gets how many of the sequence's last
    ``count`` tokens its shard holds; the shards' shares add up to ``count``."""
    from diffusers.models._modeling_parallel import ContextParallelInput

    from diffusers_sp.groups import SPGroup
    from diffusers_sp.sharding import SequenceSplitHook, SequenceState, TailCount, balanced_sizes

    class Block(torch.nn.Module):
        def forward(self, hidden_states, original_context_length=None):
            return hidden_states

    shares = []
    for rank in range(world):
        state = SequenceState(SPGroup(None, rank, world, "gloo"))
        hook = SequenceSplitHook({"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False),
                                  "original_context_length": TailCount()}, state)
        hook.initialize_hook(Block())
        (hidden, share), _ = hook.pre_forward(Block(), torch.zeros(1, 35, 2), count)
        sizes = balanced_sizes(35, world)
        start = sum(sizes[:rank])
        assert hidden.shape[1] == sizes[rank] and state.inputs_split
        assert share == len(set(range(start, start + sizes[rank])) & set(range(35 - count, 35)))
        shares.append(share)
    assert sum(shares) == count
    with pytest.raises(SequenceParallelConfigError, match="inputs disagree"):
        hook.pre_forward(Block(), torch.zeros(1, 35, 2), 36)
    with pytest.raises(SequenceParallelConfigError, match="last tokens .* before any sequence tensor was split"):
        TailCount().split_value(SequenceState(SPGroup(None, 0, world, "gloo")), 3, "n")


def test_helios_needs_two_blocks():
    import families

    model, _ = families.forward_cases()["helios_history"]()
    model.blocks = model.blocks[:1]
    with pytest.raises(SequenceParallelConfigError, match="at least 2 blocks"):
        enable_sequence_parallel(model, mode="kv_gather")


def test_models_with_a_cp_plan_and_no_family_module_run_through_it():
    """ChronoEdit and MiniMax-H3 run through their Diffusers _cp_plan (their forward cases in
    tests/families/ compare them with one process); Flux.2 and Helios have family modules."""
    import families

    for case in ("chronoedit_image_context", "minimax_h3_packed", "flux2", "helios_history"):
        model, _ = families.forward_cases()[case]()
        name = family_for_model(model).name
        assert name == (f"cp_plan:{type(model).__name__}" if case.startswith(("chronoedit", "minimax")) else
                        case.split("_")[0]), (case, name)


def test_split_each_splits_the_values_of_a_dict():
    """SplitEach on a dict ``{block index: [B, S, C]}`` (Z-Image's ControlNet residuals): every value
    is split like the sequence, keys kept; a list is split as before."""
    from diffusers.models._modeling_parallel import ContextParallelInput

    from diffusers_sp.groups import SPGroup
    from diffusers_sp.sharding import SequenceSplitHook, SequenceState, SplitEach

    spec = SplitEach(ContextParallelInput(split_dim=1, expected_dims=3, split_output=False))
    residuals = {0: torch.randn(2, 11, 4), 3: torch.randn(2, 11, 4)}
    hook = SequenceSplitHook({}, SequenceState(SPGroup(None, 2, 3, "gloo")))  # shards 4, 4, 3: rank 2 has 8:11
    out = split_value(hook.state, residuals, spec, "controlnet_block_samples")
    assert list(out) == [0, 3] and all(torch.equal(out[k], residuals[k][:, 8:]) for k in out)
    assert [t.shape[1] for t in split_value(hook.state, list(residuals.values()), spec, "r")] == [3, 3]


def test_sequence_length_then_a_joint_sequence():
    """SequenceLength (QwenImage 2.1's img_shapes) sets the forward's split length, so that a text-first
    JointSequence can split a tensor whose first split already holds whole tokens (none in QwenImage
    2.1's cached steps); lengths that disagree are refused alike on every rank."""
    from diffusers.models._modeling_parallel import ContextParallelInput

    from diffusers_sp.groups import SPGroup
    from diffusers_sp.sharding import JointSequence, SequenceLength, SequenceSplitHook, SequenceState

    length = SequenceLength(lambda shapes: shapes[0][-1][1] * shapes[0][-1][2])
    tail = JointSequence(ContextParallelInput(split_dim=0, expected_dims=2, split_output=False), text="prefix")
    x = torch.arange(15 * 2).reshape(15, 2)  # 4 whole entries, then 11 split ones
    parts = []
    for rank in range(3):
        hook = SequenceSplitHook({}, SequenceState(SPGroup(None, rank, 3, "gloo")))
        shapes = [[(1, 1, 3), (1, 1, 11)]]
        assert split_value(hook.state, shapes, length, "img_shapes") is shapes and hook.state.seq_len == 11
        parts.append(split_value(hook.state, x, tail, "rotary_emb"))
    assert [p.shape[0] for p in parts] == [8, 8, 7]  # shards 4, 4, 3 after the 4 whole entries
    assert all(torch.equal(p[:4], x[:4]) for p in parts)
    assert torch.equal(torch.cat([p[4:] for p in parts]), x[4:])
    assert torch.equal(split_value(hook.state, x[4:], tail, "rotary_emb"), x[12:])  # no whole entries: rank 2's shard
    assert split_value(hook.state, None, length, "img_shapes") is None
    with pytest.raises(SequenceParallelConfigError, match="gives 12"):
        split_value(hook.state, [[(1, 3, 4)]], length, "img_shapes")
    few = SequenceState(SPGroup(None, 2, 3, "gloo"))  # 2 tokens over 3 ranks: the forward runs whole
    split_value(few, [[(1, 1, 2)]], length, "s")
    assert few.whole is not None and few.group.world_size == 1 and few.seq_len == 2
    assert torch.equal(split_value(few, x[:6], tail, "rotary_emb"), x[:6])
    end_whole(few)
    assert few.group == SPGroup(None, 2, 3, "gloo") and few.whole is None
def test_framepack_needs_two_blocks_and_the_history_embedding():
    import families

    model, _ = families.forward_cases()["hunyuan_video_framepack_history_ragged_prompts"]()
    model.single_transformer_blocks = model.single_transformer_blocks[:0]
    with pytest.raises(SequenceParallelConfigError, match="at least 2 blocks"):
        enable_sequence_parallel(model, mode="kv_gather")


def test_heads_of_attention_modules_without_heads_or_to_q():
    """Kandinsky5Attention names its heads num_heads and its query projection to_query."""
    from diffusers.models.transformers.transformer_kandinsky import Kandinsky5Attention

    from diffusers_sp.pipelines import _head_dim, _heads

    attn = Kandinsky5Attention(48, 16)
    assert (_heads(attn), _head_dim(attn)) == (3, 16)


def test_split_unless_broadcast():
    """Sana-Video's modulation: [B, S, C] split like the tokens, [B, 1, C] (one row per sample) whole."""
    from diffusers.models._modeling_parallel import ContextParallelInput

    from diffusers_sp.groups import SPGroup
    from diffusers_sp.sharding import SequenceSplitHook, SequenceState, SplitUnlessBroadcast

    spec = SplitUnlessBroadcast(ContextParallelInput(split_dim=1, expected_dims=3, split_output=False))
    hook = SequenceSplitHook({}, SequenceState(SPGroup(None, 2, 3, "gloo"), seq_len=11))  # shards 4, 4, 3
    per_token = torch.arange(2 * 11 * 5.0).reshape(2, 11, 5)
    assert torch.equal(split_value(hook.state, per_token, spec, "t"), per_token[:, 8:])
    per_sample = torch.ones(2, 1, 5)
    assert split_value(hook.state, per_sample, spec, "t") is per_sample
    with pytest.raises(SequenceParallelConfigError, match="inputs disagree"):
        split_value(hook.state, torch.ones(2, 10, 5), spec, "t")


def test_sana_video_linear_attention_at_one_rank_is_the_processor():
    """At one rank (the sums over ranks are the rank's own) the family's linear attention is Diffusers'
    SanaLinearAttnProcessor3_0 bit for bit: the same operations in the same order."""
    import families

    from diffusers_sp.pipelines.sana_video import sana_video_linear_attention

    model, kwargs = families.forward_cases()["sana_video_per_sample_timestep"]()
    attn = model.transformer_blocks[0].attn1
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 35, 48, generator=g)
    rotary = model.rope(kwargs["hidden_states"])
    with torch.no_grad():
        ref = attn.processor(attn, hidden, rotary_emb=rotary)
        out = sana_video_linear_attention(attn.processor, attn, (hidden,), {"rotary_emb": rotary}, lambda x: x)
        with pytest.raises(SequenceParallelConfigError, match="linear attention"):
            sana_video_linear_attention(attn.processor, attn, (hidden, hidden), {"rotary_emb": rotary}, lambda x: x)
    assert torch.equal(out, ref)


def test_vsa_refusals_name_the_reason():
    """Joint text (HunyuanVideo 1.5, Framepack) and linear attention (Sana-Video) refuse mode 'vsa' with
    their reason; the dense modes are named."""
    import families

    reasons = {"hunyuan_video15_t2v_ragged_prompts": "text tokens inside self-attention",
               "hunyuan_video_framepack_history_ragged_prompts": "text tokens inside self-attention",
               "sana_video_per_sample_timestep": "linear attention"}
    for case, reason in reasons.items():
        model, _ = families.forward_cases()[case]()
        with pytest.raises(SequenceParallelConfigError, match=reason) as err:
            enable_sequence_parallel(model, mode="vsa")
        assert "'kv_gather'" in str(err.value)


def test_attach_refuses_a_hook_that_replaces_forward():
    """A family hook overriding new_forward cannot run as a torch module hook (those run around forward,
    never instead of it), so attaching one is a TypeError rather than a hook silently skipped."""
    from diffusers.hooks import ModelHook

    from diffusers_sp.sharding import attach

    class Replaces(ModelHook):
        def new_forward(self, module, *args, **kwargs):
            return 0

    with pytest.raises(TypeError, match="new_forward"):
        attach("", torch.nn.Linear(2, 2), Replaces())
