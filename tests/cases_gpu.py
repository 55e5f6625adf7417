"""Cases for tests/test_gpu_nccl.py: bf16 on CUDA over NCCL, one GPU per rank.

Token counts are odd, so no even world size divides them.
"""

from __future__ import annotations

import functools

import torch

from diffusers_sp import disable_sequence_parallel, enable_sequence_parallel
from diffusers_sp.tiny_models import tiny_wan_pipeline, tiny_wan_transformer

def rel_err(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.float(), out.float()
    return ((out - ref).norm() / ref.norm()).item()


#: Row name -> (mode, options). Both dense modes once per transport, the copy engines at 1, 4 and 5
#: head groups (5 divides neither the 12 heads of K/V-gather nor the 6 per rank of Ulysses), and
#: both transports without Wan's K/V-first path (overlap_query_projection=False).
RUNS = {
    "ulysses": ("ulysses", {"sp_transport": "nccl"}),
    "ulysses copy_engine G=1": ("ulysses", {"sp_transport": "copy_engine", "overlap_head_groups": 1}),
    "ulysses copy_engine G=4": ("ulysses", {"sp_transport": "copy_engine", "overlap_head_groups": 4}),
    "ulysses copy_engine G=5": ("ulysses", {"sp_transport": "copy_engine", "overlap_head_groups": 5}),
    "kv_gather": ("kv_gather", {"sp_transport": "nccl"}),
    "kv_gather copy_engine G=1": ("kv_gather", {"sp_transport": "copy_engine", "overlap_head_groups": 1}),
    "kv_gather copy_engine G=4": ("kv_gather", {"sp_transport": "copy_engine", "overlap_head_groups": 4}),
    "kv_gather copy_engine G=5": ("kv_gather", {"sp_transport": "copy_engine", "overlap_head_groups": 5}),
    "ulysses no-overlap": ("ulysses", {"sp_transport": "nccl", "overlap_query_projection": False}),
    "ulysses copy_engine G=2 no-overlap": ("ulysses", {"sp_transport": "copy_engine", "overlap_query_projection": False}),
    "kv_gather no-overlap": ("kv_gather", {"sp_transport": "nccl", "overlap_query_projection": False}),
    "kv_gather copy_engine G=2 no-overlap": ("kv_gather", {"sp_transport": "copy_engine",
                                                           "overlap_query_projection": False}),
    "vsa": ("vsa", {"vsa_sparsity": 0.0}),
}


def case_transformer_bf16():
    """A Wan-shaped model (12 heads of 128, 2 blocks) at 5 x 15 x 21 = 1575 tokens."""
    dev = torch.device("cuda", torch.cuda.current_device())
    model = tiny_wan_transformer(num_attention_heads=12, attention_head_dim=128, num_layers=2, ffn_dim=512,
                                 text_dim=64, freq_dim=64).to(dev, torch.bfloat16)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(1, 16, 5, 30, 42, generator=g).to(dev, torch.bfloat16)
    e = torch.randn(1, 32, 64, generator=g).to(dev, torch.bfloat16)
    kwargs = dict(hidden_states=x, timestep=torch.tensor([700.0], device=dev), encoder_hidden_states=e)
    out, outputs = {}, {}
    with torch.no_grad():
        ref = model(**kwargs).sample
        for name, (mode, opts) in RUNS.items():
            handle = enable_sequence_parallel(model, mode=mode, **opts)
            outputs[name] = model(**kwargs).sample
            out[name] = rel_err(ref, outputs[name])
            handle.disable()
    # The copy engines move the same bits as NCCL, and the K/V-first path runs the same operations as
    # the model's processor: the outputs are identical, not just close.
    for name in RUNS:
        if name != name.split()[0]:
            nccl = outputs[name.split()[0]]
            out[f"{name} differs from NCCL"] = float(not torch.equal(outputs[name], nccl))
    return out


def case_copy_engine_functional():
    """The copy-engine K/V-gather against the NCCL one on raw tensors, bitwise: batch 2, text prefix
    and suffix, per-head and shared masks, unequal head groups, and calls that grow and shrink the
    symmetric buffer (1575, then 4001, then 33 image tokens)."""
    from diffusers_sp.groups import resolve_group
    from diffusers_sp.processors.masks import gather_key_padding_mask, split_text_image
    from diffusers_sp.processors.kv_gather import (finish_kv_gather, kv_gather_attention,
                                                   kv_gather_attention_copy_engine, start_kv_gather)
    from diffusers_sp.sharding import balanced_sizes, shard

    group = resolve_group()
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device="cpu").manual_seed(1)
    diffs = {}
    for S, T, layout, heads, groups, mask_heads in ((1575, 7, "prefix", 12, 5, 12), (4001, 0, None, 12, 4, 0),
                                                     (33, 5, "suffix", 6, 4, 1)):
        B, D = 2, 64
        L = S + T
        q, k, v = (torch.randn(B, heads, L, D, generator=g).to(dev, torch.bfloat16) for _ in range(3))
        mask = None
        if mask_heads:
            mask = torch.rand(B, mask_heads, 1, L, generator=g).to(dev) > 0.2
            mask[..., 0] = True

        def local(x, dim=2):
            t, i = split_text_image(x, T, layout, dim=dim)
            i = shard(i, dim, group.rank, group.world_size)
            return i if T == 0 else torch.cat([t, i] if layout == "prefix" else [i, t], dim=dim)

        sizes = balanced_sizes(S, group.world_size)
        lmask = None if mask is None else gather_key_padding_mask(local(mask, 3), T, layout, sizes, group)
        kw = dict(text_len=T, text_layout=layout, key_mask=lmask)
        want = kv_gather_attention(local(q), local(k), local(v), sizes, group, **kw)
        got = kv_gather_attention_copy_engine(local(q), local(k), local(v), sizes, group, head_groups=groups, **kw)
        diffs[f"kv_gather S={S} T={T} G={groups}"] = (got - want).abs().max().item()
        for ce in (False, True):  # the K/V-first halves, with other work queued between them
            pending = start_kv_gather(local(k), local(v), sizes, group, copy_engine=ce, head_groups=groups,
                                      text_len=T, text_layout=layout)
            busy = torch.randn(2048, 2048, device=dev) @ torch.randn(2048, 2048, device=dev)
            got = finish_kv_gather(pending, local(q), key_mask=lmask)
            del busy
            diffs[f"kv_gather start/finish copy_engine={ce} S={S} T={T}"] = (got - want).abs().max().item()
    return diffs


def case_ulysses_copy_engine_functional():
    """The copy-engine Ulysses against the NCCL one on raw tensors, bitwise: batch 2, heads that do not
    divide the world size (5 and 7), per-head and shared masks, head groups that do not divide a
    rank's heads, and calls that grow and shrink the symmetric buffer."""
    from diffusers_sp.groups import resolve_group
    from diffusers_sp.processors.masks import gather_key_padding_mask
    from diffusers_sp.processors.ulysses import (finish_ulysses, start_ulysses, ulysses_attention,
                                                 ulysses_attention_copy_engine)
    from diffusers_sp.sharding import balanced_sizes, shard

    group = resolve_group()
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device="cpu").manual_seed(2)
    diffs = {}
    for S, heads, groups, mask_heads in ((1575, 5, 2, 5), (4001, 12, 4, 0), (33, 7, 3, 1), (2049, 12, 5, 0)):
        B, D = 2, 64
        q, k, v = (torch.randn(B, heads, S, D, generator=g).to(dev, torch.bfloat16) for _ in range(3))
        mask = None
        if mask_heads:
            mask = torch.rand(B, mask_heads, 1, S, generator=g).to(dev) > 0.2
            mask[..., 0] = True
        sizes = balanced_sizes(S, group.world_size)
        local = [shard(t, 2, group.rank, group.world_size) for t in (q, k, v)]
        lmask = None if mask is None else gather_key_padding_mask(shard(mask, 3, group.rank, group.world_size), 0,
                                                                  None, sizes, group)
        want = ulysses_attention(*local, sizes, group, key_mask=lmask)
        got = ulysses_attention_copy_engine(*local, sizes, group, key_mask=lmask, head_groups=groups)
        diffs[f"ulysses S={S} H={heads} G={groups}"] = (got - want).abs().max().item()
        for ce in (False, True):  # the K/V-first halves, with other work queued between them
            pending = start_ulysses(local[1], local[2], sizes, group, copy_engine=ce, head_groups=groups)
            busy = torch.randn(2048, 2048, device=dev) @ torch.randn(2048, 2048, device=dev)
            got = finish_ulysses(pending, local[0], key_mask=lmask)
            del busy
            diffs[f"ulysses start/finish copy_engine={ce} S={S} H={heads}"] = (got - want).abs().max().item()
    # The result is a view of the symmetric buffer, documented to stay valid across one more call.
    first = ulysses_attention_copy_engine(*local, sizes, group, key_mask=lmask, head_groups=groups)
    ulysses_attention_copy_engine(*(t.flip(2) for t in local), sizes, group, key_mask=lmask, head_groups=groups)
    diffs["ulysses result held across one more call"] = (first - want).abs().max().item()
    return diffs


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
    # "auto" resolves to the copy engines for Ulysses and to NCCL for K/V-gather on Wan (its K/V-first
    # path); the other transport of each mode is asked for by name.
    for mode, opts in (("ulysses", {}), ("ulysses", {"sp_transport": "nccl"}), ("kv_gather", {}),
                       ("kv_gather", {"sp_transport": "copy_engine"})):
        handle = enable_sequence_parallel(pipe, mode=mode, **opts)
        frames = pipe(**call, generator=torch.Generator("cpu").manual_seed(0)).frames
        key = f"{mode} ({handle.transport})"
        assert key not in out, f"two runs resolved to {key}"
        out[key] = rel_err(ref, frames)
        disable_sequence_parallel(pipe)
    return out
