"""The local attention kernel: which kernel runs for which device, dtype, head dim and mask (CPU), and
the FlashAttention-4 paths themselves against SDPA and VSA's reference (GPU with flash-attn-4 only)."""

import pytest
import torch
import torch.nn.functional as F

from diffusers_sp.kernels import fa4, sdpa
from diffusers_sp.kernels.sdpa import KernelChoice, choose_kernel, local_attention

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
H200 = (9, 0)
B200 = (10, 0)


def _choose(requested="auto", device_type="cuda", capability=H200, dtype=BF16, head_dim=128, mask=None,
            fa4_installed=True, legacy_flash=None, compiling=False, needs_grad=False):
    return choose_kernel(requested, device_type=device_type, capability=capability, dtype=dtype, head_dim=head_dim,
                         mask=mask, fa4_installed=fa4_installed, legacy_flash=legacy_flash, compiling=compiling,
                         needs_grad=needs_grad)


@pytest.mark.parametrize("kwargs,name", [
    ({}, "flash_attn_4"),                                   # Hopper, bf16, D=128
    ({"capability": B200, "dtype": F16}, "flash_attn_4"),  # Blackwell, fp16
    ({"head_dim": 256}, "flash_attn_4"),                    # sm90 takes D up to 256
    ({"capability": B200, "head_dim": 256}, "flash_attn_4"),
    ({"mask": "key_padding"}, "flash_attn_4"),              # through varlen
    ({"requested": "flash_attn"}, "flash_attn_4"),
    ({"requested": "sdpa"}, "sdpa"),
    ({"device_type": "cpu", "capability": None}, "sdpa"),
    ({"dtype": F32}, "sdpa"),
    ({"capability": (8, 0)}, "sdpa"),                       # Ampere: no FA4 kernel
    ({"capability": (12, 0)}, "sdpa"),                      # consumer Blackwell: not in FA4's forward set
    ({"head_dim": 72 + 4}, "sdpa"),                         # not a multiple of 8
    ({"capability": B200, "head_dim": 192}, "sdpa"),        # sm100: D <= 128 or 256
    ({"head_dim": 512}, "sdpa"),
    ({"mask": "other"}, "sdpa"),                            # float or per-query masks
    ({"fa4_installed": False}, "sdpa"),
    ({"fa4_installed": False, "legacy_flash": "flash_attn_3"}, "flash_attn_3"),
    ({"fa4_installed": False, "legacy_flash": "flash_attn_2"}, "sdpa"),  # FA2 is slower than cuDNN on Hopper
    ({"fa4_installed": False, "legacy_flash": "flash_attn_2", "capability": (8, 0)}, "flash_attn_2"),
    ({"fa4_installed": False, "legacy_flash": "flash_attn_2", "requested": "flash_attn"}, "flash_attn_2"),
    ({"fa4_installed": False, "legacy_flash": "flash_attn_3", "mask": "key_padding"}, "sdpa"),
    ({"fa4_installed": False, "legacy_flash": "flash_attn_3", "dtype": F32}, "sdpa"),
    ({"compiling": True}, "flash_attn_4"),                  # as a custom operator inside the graph
    ({"compiling": True, "mask": "key_padding"}, "flash_attn_4"),
    ({"compiling": True, "needs_grad": True}, "sdpa"),      # the operators are forward-only
    ({"needs_grad": True}, "flash_attn_4"),                 # eager FA4 has its backward
    ({"fa4_installed": False, "legacy_flash": "flash_attn_3", "capability": B200}, "sdpa"),  # FA3: sm90 only
    ({"fa4_installed": False, "legacy_flash": "flash_attn_3", "capability": (8, 6)}, "sdpa"),
    ({"fa4_installed": False, "legacy_flash": "flash_attn_3", "capability": (12, 0), "requested": "flash_attn"}, "sdpa"),
    ({"fa4_installed": False, "legacy_flash": "flash_attn_2", "capability": B200, "requested": "flash_attn"}, "sdpa"),
    ({"fa4_installed": False, "legacy_flash": "flash_attn_2", "capability": (8, 9)}, "flash_attn_2"),
    ({"compiling": True, "fa4_installed": False, "legacy_flash": "flash_attn_3"}, "sdpa"),
])
def test_kernel_choice(kwargs, name):
    assert _choose(**kwargs).name == name


@pytest.mark.parametrize("kwargs,words", [
    ({"fa4_installed": False}, "not installed"),
    ({"device_type": "cpu", "capability": None}, "CUDA only"),
    ({"dtype": F32}, "bfloat16 or float16"),
    ({"capability": (8, 6)}, "sm86"),
    ({"head_dim": 76}, "multiple of 8"),
    ({"capability": B200, "head_dim": 192}, "outside"),
    ({"mask": "other"}, "key padding"),
    ({"compiling": True, "needs_grad": True}, "forward-only"),
])
def test_fallback_says_why(kwargs, words):
    choice = _choose(requested="flash_attn", **kwargs)
    assert choice.name == "sdpa" and words in choice.reason


def test_masked_fa4_choice_says_varlen():
    assert "varlen" in _choose(mask="key_padding").reason
    assert _choose().reason == ""


def test_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match="unknown attention kernel"):
        _choose(requested="flash")


@pytest.mark.parametrize("shape,expected", [
    ((2, 1, 1, 7), "key_padding"), ((1, 7), "key_padding"), ((7,), "key_padding"), ((1, 1, 1, 7), "key_padding"),
    ((2, 3, 1, 7), "other"), ((2, 1, 5, 7), "other"), ((3, 1, 1, 7), "other"),
    ((2, 7), "other"),         # SDPA reads a 2-D mask as [Sq, Sk]: it varies over the queries
    ((2, 1, 1, 1), "other")])  # broadcast over the keys: not one value per key
def test_mask_kind(shape, expected):
    assert sdpa.mask_kind(torch.ones(shape, dtype=torch.bool), 2, 7) == expected
    assert sdpa.mask_kind(torch.zeros(shape), 2, 7) == "other"  # additive float masks stay on SDPA
    assert sdpa.mask_kind(None, 2, 7) is None


def test_masks_that_broadcast_over_keys_stay_on_sdpa():
    """A [B, 1, 1, 1] mask broadcasts one value over every key: SDPA's semantics, not a key padding mask."""
    mask = torch.tensor([True, False]).view(2, 1, 1, 1)
    assert sdpa.mask_kind(mask, 2, 7) == "other"
    assert fa4.key_padding_rows(mask, 2, 7) is None


def test_cpu_runs_sdpa_and_matches_it():
    """On CPU every request runs SDPA; the result is SDPA's, with and without a key padding mask."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 16, generator=g) for _ in range(3))
    mask = torch.tensor([[True] * 7, [True, False, True, True, False, True, False]])[:, None, None, :]
    k7, v7 = torch.randn(2, 3, 7, 16, generator=g), torch.randn(2, 3, 7, 16, generator=g)
    for kernel in sdpa.KERNELS:
        assert sdpa.kernel_for(q, k, None, kernel) == KernelChoice("sdpa", sdpa.kernel_for(q, k, None, kernel).reason)
        torch.testing.assert_close(local_attention(q, k, v, kernel=kernel), F.scaled_dot_product_attention(q, k, v))
        torch.testing.assert_close(local_attention(q, k7, v7, attn_mask=mask, kernel=kernel),
                                   F.scaled_dot_product_attention(q, k7, v7, attn_mask=mask))


def test_handle_reports_the_kernel():
    """The handle says which kernel runs for the model as it is (CPU float32 here: SDPA, and why)."""
    from diffusers_sp import enable_sequence_parallel
    from diffusers_sp.tiny_models import tiny_wan_transformer

    model = tiny_wan_transformer()
    handle = enable_sequence_parallel(model, mode="ulysses", attention_kernel="flash_attn")
    try:
        assert handle.requested_kernel == "flash_attn"
        assert handle.attention_kernel == "sdpa"
        assert handle.kernel_choice().reason
    finally:
        handle.disable()


# --- FlashAttention-4 on the GPU --------------------------------------------------------------------

def _fa4_ready() -> bool:
    return (torch.cuda.is_available() and fa4.fa4_installed()
            and fa4.device_capability(torch.device("cuda"))[0] in fa4.FA4_ARCHS)


needs_fa4 = pytest.mark.skipif(not _fa4_ready(), reason="GPU-only: needs flash-attn-4 on a Hopper/Blackwell GPU")


@needs_fa4
@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("sq,sk,head_dim", [(1000, 1000, 128), (333, 4097, 64), (77, 512, 128)])
def test_fa4_dense_matches_sdpa_cuda(dtype, sq, sk, head_dim):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 6, sq, head_dim, generator=g).to("cuda", dtype)
    k, v = (torch.randn(2, 6, sk, head_dim, generator=g).to("cuda", dtype) for _ in range(2))
    assert sdpa.kernel_for(q, k, None, "auto").name == "flash_attn_4"
    out = local_attention(q, k, v, scale=0.1)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=0.1)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


@needs_fa4
@pytest.mark.parametrize("mask_shape", ["b11s", "111s", "1s"])
def test_fa4_key_padding_mask_matches_sdpa_cuda(mask_shape):
    """Ragged text: each batch row keeps a different, non-prefix set of keys (varlen entry); and one row of
    keys shared by the batch ([1, 1, 1, Sk] and [1, Sk], which SDPA broadcasts)."""
    g = torch.Generator().manual_seed(2)
    batch, heads, sq, sk, d = 3, 4, 300, 517, 128
    q = torch.randn(batch, heads, sq, d, generator=g).to("cuda", BF16)
    k, v = (torch.randn(batch, heads, sk, d, generator=g).to("cuda", BF16) for _ in range(2))
    keep = torch.rand(batch, sk, generator=g) < torch.tensor([[0.9], [0.3], [0.6]])
    keep[:, 0] = True
    if mask_shape != "b11s":
        keep = keep[:1]
    mask = (keep if mask_shape == "1s" else keep[:, None, None, :]).to("cuda")
    assert sdpa.kernel_for(q, k, mask, "auto").name == "flash_attn_4"
    out = local_attention(q, k, v, attn_mask=mask)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=keep[:, None, None, :].to("cuda"))
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


@needs_fa4
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9])
def test_fa4_block_sparse_vsa_matches_reference_cuda(sparsity):
    """VSA with the FA4 fine stage against the reference, partial tiles on every axis, with and
    without a gate, all query tiles and a subset (the K/V-gather path's rows)."""
    from diffusers_sp.kernels.vsa import make_tile_layout, tile_tokens, video_sparse_attention

    layout = make_tile_layout((5, 10, 9), (4, 4, 4), device="cuda")
    g = torch.Generator().manual_seed(3)
    qt, kt, vt = (tile_tokens(torch.randn(2, 3, layout.num_tokens, 128, generator=g).to("cuda", BF16), layout, dim=2)
                  for _ in range(3))
    gate = torch.randn(qt.shape, generator=g).to("cuda", BF16)
    for gate_arg in (None, gate):
        for start, end in [(0, layout.num_tiles), (5, 12)]:
            kwargs = dict(q_block_sizes=layout.block_sizes[start:end], kv_block_sizes=layout.block_sizes,
                          sparsity=sparsity)
            part_gate = None if gate_arg is None else gate_arg[:, :, start:end]
            fast = video_sparse_attention(qt[:, :, start:end], kt, vt, backend="fa4", gate=part_gate, **kwargs)
            ref = video_sparse_attention(qt[:, :, start:end].float(), kt.float(), vt.float(), backend="reference",
                                         gate=None if part_gate is None else part_gate.float(), **kwargs)
            assert fast.dtype == BF16
            torch.testing.assert_close(fast.float(), ref, rtol=2e-2, atol=2e-2)


@needs_fa4
@pytest.mark.parametrize("mode", ["ulysses", "kv_gather"])
def test_fa4_runs_both_dense_modes_at_world_size_1_cuda(mode, monkeypatch):
    """A Wan-shaped transformer in bf16: the handle reports FA4, FA4 actually runs every self-attention,
    and the output matches the stock model (cuDNN SDPA) to bf16 precision."""
    from diffusers_sp import enable_sequence_parallel
    from diffusers_sp.tiny_models import tiny_wan_transformer

    dev = torch.device("cuda")
    model = tiny_wan_transformer(num_attention_heads=12, attention_head_dim=128, num_layers=2, ffn_dim=512,
                                 text_dim=64, freq_dim=64).to(dev, BF16)
    g = torch.Generator().manual_seed(4)
    kwargs = dict(hidden_states=torch.randn(1, 16, 5, 30, 42, generator=g).to(dev, BF16),
                  timestep=torch.tensor([700.0], device=dev),
                  encoder_hidden_states=torch.randn(1, 32, 64, generator=g).to(dev, BF16))
    calls = []
    real = fa4.fa4_attention
    monkeypatch.setattr(fa4, "fa4_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with torch.no_grad():
        ref = model(**kwargs).sample
        handle = enable_sequence_parallel(model, mode=mode)
        try:
            assert handle.attention_kernel == "flash_attn_4"
            out = model(**kwargs).sample
        finally:
            handle.disable()
    assert len(calls) >= 2  # one self-attention per block at least
    assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 2e-2


@needs_fa4
@pytest.mark.parametrize("mode", ["ulysses", "kv_gather", "hybrid"])
def test_fa4_inside_compiled_blocks_cuda(mode, monkeypatch):
    """Regional compilation with ``fullgraph=True`` (inductor) keeps FA4: its custom operator runs every
    self-attention of the compiled blocks, and the output is the eager FA4 output to bf16 precision."""
    from diffusers_sp import enable_sequence_parallel
    from diffusers_sp.tiny_models import tiny_wan_transformer

    dev = torch.device("cuda")
    model = tiny_wan_transformer(num_attention_heads=12, attention_head_dim=128, num_layers=2, ffn_dim=512,
                                 text_dim=64, freq_dim=64).to(dev, BF16)
    g = torch.Generator().manual_seed(4)
    kwargs = dict(hidden_states=torch.randn(1, 16, 5, 30, 42, generator=g).to(dev, BF16),
                  timestep=torch.tensor([700.0], device=dev),
                  encoder_hidden_states=torch.randn(1, 32, 64, generator=g).to(dev, BF16))
    calls = []
    real = fa4._dense
    monkeypatch.setattr(fa4, "_dense", lambda *a: calls.append(1) or real(*a))
    torch._dynamo.reset()
    handle = enable_sequence_parallel(model, mode=mode, **({"ulysses_degree": 1} if mode == "hybrid" else {}))
    try:
        assert handle.kernel_choice(compiled=True).name == "flash_attn_4"
        with torch.no_grad():
            eager = model(**kwargs).sample
            eager_calls, calls[:] = len(calls), []
            model.compile_repeated_blocks(fullgraph=True)
            compiled = model(**kwargs).sample
    finally:
        handle.disable()
        torch._dynamo.reset()
    assert eager_calls >= 2 and len(calls) == eager_calls
    assert ((compiled.float() - eager.float()).norm() / eager.float().norm()).item() < 2e-2
