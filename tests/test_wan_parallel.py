"""Wan under sequence parallelism equals one process (float32, CPU/gloo, world sizes 2, 3, 4).

Each world size spawns its processes once and runs every case of tests/cases_wan.py inside them.
"""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch

from distributed import assert_close, run_cases, values

WORLD_SIZES = (2, 3, 4)


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda p: f"P{p}")
def results(request):
    return request.param, run_cases("cases_wan", request.param)


@pytest.mark.parametrize("case", ["transformer_t2v", "transformer_uneven_heads",
                                  "transformer_ti2v_per_token_timesteps", "transformer_i2v_image_context"])
def test_transformer_forward_equals_one_process(results, case):
    P, res = results
    for rank, v in enumerate(values(res, case)):
        for mode in ("ulysses", "kv_gather"):
            assert_close(v[mode], f"P={P} rank {rank} {case} {mode}")
            assert v[mode]["resolved"] == mode
        assert v["restored_bitwise"], f"P={P} rank {rank}: disable did not restore the outputs bit for bit"
        # The self-attention (attn1 of every block, I2V included: the image context enters attn2)
        # takes Wan's K/V-first path in both modes, and not with overlap_query_projection=False.
        blocks = 2  # tiny_wan_transformer's depth
        for mode in ("ulysses", "kv_gather"):
            assert v[mode]["kv_first_calls"] == blocks, v[mode]
            generic = v[f"kv_first_vs_generic {mode}"]
            assert generic["generic_kv_first_calls"] == 0
            assert generic["equal"], f"P={P} rank {rank} {mode}: the K/V-first path differs: {generic}"


@pytest.mark.parametrize("case,modes,transformers", [
    ("pipeline_t2v_latent", ("ulysses", "kv_gather"), 1),
    ("pipeline_t2v_decoded", ("kv_gather",), 1),
    ("pipeline_i2v", ("ulysses", "kv_gather"), 1),
    ("pipeline_wan22_two_transformers", ("ulysses", "kv_gather"), 2),
    ("pipeline_ti2v", ("ulysses",), 1),
])
def test_pipeline_equals_one_process(results, case, modes, transformers):
    P, res = results
    for rank, v in enumerate(values(res, case)):
        for mode in modes:
            assert_close(v[mode], f"P={P} rank {rank} {case} {mode}")
            assert v[mode]["transformers"] == transformers


def test_random_draws_agree_across_ranks(results):
    P, res = results
    vals = values(res, "random_draws_agree")
    for v in vals[1:]:
        assert torch.equal(v["latents"], vals[0]["latents"])
        assert torch.equal(v["after"], vals[0]["after"])


@pytest.mark.parametrize("case,needles", [
    ("error_ulysses_too_few_heads", ["WanTransformer3DModel", "1 heads", "kv_gather"]),
    ("error_unknown_mode", ["'ring'", "'ulysses'", "'kv_gather'"]),
    ("error_vsa_bad_sparsity", ["vsa_sparsity", "[0, 1)", "1.5"]),
    ("error_vsa_option_with_dense_mode", ["vsa_sparsity apply to mode='vsa' only", "'kv_gather'"]),
    ("error_bad_overlap_query_projection", ["overlap_query_projection", "True or False", "'yes'"]),
    ("error_already_enabled", ["already enabled", "disable_sequence_parallel"]),
    ("error_unsupported_model", ["AutoencoderKLWan", "not a transformer", "WanTransformer3DModel"]),
    ("error_bad_process_group", ["ProcessGroup"]),
    ("error_timestep_b1", ["argument 'timestep' of WanTransformer3DModel of shape [1, 1]", "[B, 1]"]),
    ("error_timestep_one_token_short", ["inputs disagree on the sequence length", "'timestep'", "[1, 174]",
                                        "WanRotaryPosEmbed"]),
    ("error_timestep_one_per_rank", ["inputs disagree on the sequence length", "'timestep'", "WanRotaryPosEmbed"]),
    ("error_attention_without_sdpa", ["ManualAttention made no scaled_dot_product_attention call",
                                      "native attention backend"]),
])
def test_errors_raised_identically_on_every_rank(results, case, needles):
    P, res = results
    msgs = values(res, case)
    assert len(set(msgs)) == 1, f"ranks disagree: {msgs}"
    assert msgs[0] != "no error", f"{case} did not raise"
    for needle in needles:
        assert needle in msgs[0], f"{needle!r} not in {msgs[0]!r}"


def test_grad_mode_forward_equals_one_process_and_backward_raises(results):
    P, res = results
    for rank, v in enumerate(values(res, "transformer_grad_mode")):
        assert len(v) == 4
        for what, metrics in v.items():
            assert_close(metrics, f"P={P} rank {rank} {what}")
            assert "inference-only" in metrics["backward"], metrics["backward"]


def test_scheduler_noise_agrees_after_rng_drift(results):
    P, res = results
    for rank, v in enumerate(values(res, "pipeline_scheduler_noise_after_rng_drift")):
        assert_close(v, f"P={P} rank {rank} stochastic scheduler after RNG drift")


def test_group_usable_after_errors(results):
    P, res = results
    for v in values(res, "group_usable_after_errors"):
        assert v["sum"] == P * (P + 1) / 2
        assert_close(v["forward"]["kv_gather"], "forward after errors")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="GPU-only: the RoPE kernel runs on CUDA"))])
@pytest.mark.parametrize("fused", [False, True], ids=["separate_qkv", "fused_qkv"])
def test_kv_first_matches_the_model_processor_bitwise(fused, device):
    """Wan's K/V-first self-attention (pipelines/wan.py) runs the model processor's operations in
    another order; on one process, with the attention itself left to SDPA, the model's output must
    not change by a bit (also guards against a Diffusers release changing WanAttnProcessor). On CUDA,
    in bf16, its RoPE is the Triton kernel of diffusers_sp.kernels.rope."""
    import torch.nn.functional as F

    from diffusers_sp.kernels import rope as rope_kernel
    from diffusers_sp.pipelines.wan import wan_self_attention_kv_first
    from diffusers_sp.tiny_models import tiny_wan_transformer

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = tiny_wan_transformer().eval()
    rope = copy.deepcopy(model.rope).to(device)  # float32 tables, as from_pretrained(torch_dtype=...) keeps them
    model = model.to(device, dtype)
    model.rope = rope
    if fused:
        for block in model.blocks:
            block.attn1.fuse_projections()
    g = torch.Generator().manual_seed(3)
    kwargs = dict(hidden_states=torch.randn(1, 16, 3, 6, 8, generator=g).to(device, dtype),
                  timestep=torch.tensor([700.0], device=device),
                  encoder_hidden_states=torch.randn(1, 12, 32, generator=g).to(device, dtype))
    starts = []

    class KVFirst:
        def __init__(self, inner):
            self.inner = inner

        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
            def start(key, value):
                starts.append(key.shape)
                return key, value

            def finish(kv, query, scale=None):
                return F.scaled_dot_product_attention(query, *kv, scale=scale)

            args = (hidden_states,)
            kw = dict(encoder_hidden_states=encoder_hidden_states, attention_mask=attention_mask, rotary_emb=rotary_emb)
            out = wan_self_attention_kv_first(self.inner, attn, args, kw, start, finish)
            assert out is not NotImplemented
            return out

    with torch.no_grad():
        ref = model(**kwargs).sample
        inners = [block.attn1.processor for block in model.blocks]
        # Cross-attention (encoder states given) is declined, so the model's processor runs it.
        attn2 = model.blocks[0].attn2
        text = torch.randn(1, 12, 72, device=device, dtype=dtype)
        assert wan_self_attention_kv_first(attn2.processor, attn2, (torch.randn(1, 4, 72, device=device, dtype=dtype),),
                                           dict(encoder_hidden_states=text), None, None) is NotImplemented
        for block, inner in zip(model.blocks, inners):
            block.attn1.processor = KVFirst(inner)
        with mock.patch.object(rope_kernel, "_rope_triton", wraps=rope_kernel._rope_triton) as launches:
            out = model(**kwargs).sample
    assert len(starts) == len(model.blocks) and starts[0] == (1, 6, 3 * 3 * 4, 12)
    assert launches.call_count == (2 * len(model.blocks) if device == "cuda" else 0)  # queries and keys
    assert torch.equal(out, ref), (out - ref).abs().max()


def test_kv_first_declines_what_it_does_not_cover():
    """The K/V-first hook returns NotImplemented (so the model's processor runs) for an attention mask,
    a processor subclass, a module with image-context projections (I2V's attn2) and one built as
    cross-attention; and a subclassed processor installed on attn1 keeps running, with its own output."""
    from diffusers.models.transformers.transformer_wan import WanAttention, WanAttnProcessor

    from diffusers_sp import enable_sequence_parallel
    from diffusers_sp.pipelines.wan import wan_self_attention_kv_first
    from diffusers_sp.tiny_models import tiny_wan_transformer

    def never(*args, **kwargs):
        raise AssertionError("the hook must decline before starting any transfer")

    model = tiny_wan_transformer(in_channels=36, image_dim=4, added_kv_proj_dim=72).eval()  # Wan 2.1 I2V
    attn1 = model.blocks[0].attn1
    x = torch.randn(1, 5, 72)
    mask = torch.ones(1, 1, 1, 5, dtype=torch.bool)
    assert wan_self_attention_kv_first(attn1.processor, attn1, (x,), dict(attention_mask=mask),
                                       never, never) is NotImplemented

    class Doubled(WanAttnProcessor):
        def __call__(self, *args, **kwargs):
            return 2 * super().__call__(*args, **kwargs)

    assert wan_self_attention_kv_first(Doubled(), attn1, (x,), {}, never, never) is NotImplemented
    attn2 = model.blocks[0].attn2
    assert attn2.add_k_proj is not None
    assert wan_self_attention_kv_first(attn2.processor, attn2, (x,), {}, never, never) is NotImplemented
    cross = WanAttention(dim=72, heads=6, dim_head=12, cross_attention_dim_head=12)
    assert cross.is_cross_attention
    assert wan_self_attention_kv_first(cross.processor, cross, (x,), {}, never, never) is NotImplemented

    g = torch.Generator().manual_seed(4)
    kwargs = dict(hidden_states=torch.randn(1, 36, 3, 6, 8, generator=g), timestep=torch.tensor([300.0]),
                  encoder_hidden_states=torch.randn(1, 512, 32, generator=g),
                  encoder_hidden_states_image=torch.randn(1, 9, 4, generator=g))
    with torch.no_grad():
        for block in model.blocks:
            block.attn1.set_processor(Doubled())
        ref = model(**kwargs).sample
        handle = enable_sequence_parallel(model, mode="kv_gather")
        out = model(**kwargs).sample
        handle.disable()
    assert torch.equal(out, ref)


def test_backend_of_a_device_list_group(results):
    for v in values(results[1], "backend_of_a_device_list_group"):
        assert v["ours"] == "gloo" and v["transport"] == "gloo", v
