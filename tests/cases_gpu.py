"""Cases for tests/test_gpu_nccl.py: bf16 on CUDA over NCCL, one GPU per rank.

Token counts are odd, so no even world size divides them.
"""

from __future__ import annotations

import functools

import torch

from diffusers_sp import disable_sequence_parallel, enable_sequence_parallel
from diffusers_sp.tiny_models import tiny_wan_pipeline, tiny_wan_transformer

DENSE_MODES = ("ulysses", "kv_gather")


def rel_err(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.float(), out.float()
    return ((out - ref).norm() / ref.norm()).item()


def _modes():
    try:
        from diffusers_sp.processors import PROCESSORS
    except ImportError:  # pragma: no cover
        return DENSE_MODES
    return tuple(m for m in ("ulysses", "kv_gather", "vsa") if m in PROCESSORS)


def case_transformer_bf16():
    """A Wan-shaped model (12 heads of 128, 2 blocks) at 5 x 15 x 21 = 1575 tokens."""
    dev = torch.device("cuda", torch.cuda.current_device())
    model = tiny_wan_transformer(num_attention_heads=12, attention_head_dim=128, num_layers=2, ffn_dim=512,
                                 text_dim=64, freq_dim=64).to(dev, torch.bfloat16)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(1, 16, 5, 30, 42, generator=g).to(dev, torch.bfloat16)
    e = torch.randn(1, 32, 64, generator=g).to(dev, torch.bfloat16)
    kwargs = dict(hidden_states=x, timestep=torch.tensor([700.0], device=dev), encoder_hidden_states=e)
    out = {}
    with torch.no_grad():
        ref = model(**kwargs).sample
        for mode in _modes():
            opts = {"vsa_sparsity": 0.0} if mode == "vsa" else {}
            handle = enable_sequence_parallel(model, mode=mode, **opts)
            out[mode] = rel_err(ref, model(**kwargs).sample)
            handle.disable()
    return out


@functools.lru_cache(maxsize=None)
def _pipe():
    dev = torch.device("cuda", torch.cuda.current_device())
    return tiny_wan_pipeline("t2v").to(dev, torch.bfloat16)


def case_pipeline_bf16():
    pipe = _pipe()
    pipe.set_progress_bar_config(disable=True)
    call = dict(prompt="a cat runs on the grass", negative_prompt="rain", height=80, width=112, num_frames=17,
                num_inference_steps=3, output_type="latent")
    ref = pipe(**call, generator=torch.Generator("cpu").manual_seed(0)).frames
    out = {}
    for mode in DENSE_MODES:
        enable_sequence_parallel(pipe, mode=mode)
        out[mode] = rel_err(ref, pipe(**call, generator=torch.Generator("cpu").manual_seed(0)).frames)
        disable_sequence_parallel(pipe)
    return out
