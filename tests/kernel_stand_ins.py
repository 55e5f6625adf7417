"""CPU stand-ins for the CUDA kernels, so that the CPU suite can check how they sit inside ``torch.compile``.

FlashAttention-4 and the Triton VSA fine stage run only on a GPU. :func:`stand_in_kernels` makes the
package believe both are there on CPU: FA4's ``flash_attn_func`` / ``flash_attn_varlen_func`` become
SDPA with FA4's ``[B, S, H, D]`` layout (varlen: over the packed ``cu_seqlens`` segments), the Triton
launches become the reference coarse and fine stages, and the checks that would refuse CPU tensors say yes. The
product's code paths above the kernels (the choice, the custom operators, their fake implementations,
the packing of key padding masks) run unchanged. The counters say how often each stand-in ran.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from unittest import mock

import torch
import torch.nn.functional as F

from diffusers_sp.kernels import fa4, sdpa, vsa, vsa_coarse_triton, vsa_triton

# Names of the custom operators as they appear in an FX graph.
FA4_DENSE_OP = "diffusers_sp.fa4_attention"
FA4_VARLEN_OP = "diffusers_sp.fa4_key_padding_attention"
VSA_TRITON_OP = "diffusers_sp.vsa_fine_stage_triton"


def _dense(calls):
    def flash_attn_func(q, k, v, softmax_scale=None):
        calls["fa4_dense"] += 1
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             scale=softmax_scale)
        return out.transpose(1, 2).contiguous(), None

    return flash_attn_func


def _varlen(calls):
    def flash_attn_varlen_func(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale=None):
        calls["fa4_varlen"] += 1
        out = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=q.dtype)
        for b in range(cu_seqlens_q.numel() - 1):
            qs, qe, ks, ke = (int(x) for x in (cu_seqlens_q[b], cu_seqlens_q[b + 1], cu_seqlens_k[b],
                                                cu_seqlens_k[b + 1]))
            if ke > ks:  # FA4 gives zeros for a row with no valid key
                o = F.scaled_dot_product_attention(q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1),
                                                   v[ks:ke].transpose(0, 1), scale=softmax_scale)
                out[qs:qe] = o.transpose(0, 1)
        return out, None

    return flash_attn_varlen_func


def _fa4_reason(device_type, capability, dtype, head_dim, *, installed):
    return None if installed else "flash-attn-4 is not installed"


@contextlib.contextmanager
def stand_in_kernels():
    """Within the block, FA4 and the Triton VSA kernel "run" on CPU (see the module docstring).

    Yields:
        A :class:`collections.Counter` of stand-in calls: ``fa4_dense``, ``fa4_varlen``, ``vsa_triton``,
        ``vsa_coarse``.
    """
    calls = Counter()
    functions = (_dense(calls), _varlen(calls))

    def launch(q, k, v, selected, q_offsets, q_sizes, kv_offsets, kv_sizes, tile_volume, scale, gate, coarse,
               config):
        # The reference fine stage on padded copies of the packed tiles, the gated coarse output added.
        calls["vsa_triton"] += 1
        q_slots, kv_slots = (_slots(off, sizes, tile_volume) for off, sizes in ((q_offsets, q_sizes),
                                                                               (kv_offsets, kv_sizes)))
        num_q, num_kv = q_offsets.shape[0], kv_offsets.shape[0]
        qt = _gather(q, q_slots, num_q, tile_volume)
        out = vsa._fine_stage_reference(qt, _gather(k, kv_slots, num_kv, tile_volume),
                                        _gather(v, kv_slots, num_kv, tile_volume), selected, kv_sizes.long(), scale)
        if gate is not None:
            out = torch.addcmul(out, coarse.to(q.dtype).unsqueeze(3), _gather(gate, q_slots, num_q, tile_volume))
        result = vsa_triton._output_like(q)
        valid = q_slots >= 0
        result[:, :, q_slots[valid]] = out.flatten(2, 3)[:, :, valid]
        return result

    def launch_coarse(q, k, v, q_offsets, q_sizes, kv_offsets, kv_sizes, tile_volume, topk, scale, with_output,
                      config=None):
        # The reference coarse stage (tile means, float32 products, torch.topk, softmax) on padded copies.
        calls["vsa_coarse"] += 1
        q_mean, k_mean, v_mean = (vsa._tile_means(_gather(x, _slots(off, sizes, tile_volume), off.shape[0],
                                                          tile_volume), sizes.long())
                                  for x, off, sizes in ((q, q_offsets, q_sizes), (k, kv_offsets, kv_sizes),
                                                        (v, kv_offsets, kv_sizes)))
        products = q_mean @ k_mean.transpose(-1, -2)
        selected = products.topk(topk, dim=-1, sorted=False).indices.to(torch.int32)
        coarse = torch.softmax(products * scale, dim=-1) @ v_mean if with_output else q.new_empty(0)
        return selected, coarse

    def triton_applies(q, k, v, tile_volume=None):
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        return q.dtype in (torch.float32, torch.bfloat16, torch.float16) and not needs_grad

    patches = [mock.patch.object(fa4, "fa4_functions", lambda: functions),
               mock.patch.object(fa4, "fa4_unsupported_reason", _fa4_reason),
               mock.patch.object(vsa_triton, "_launch", launch),
               mock.patch.object(vsa_coarse_triton, "_launch_coarse", launch_coarse),
               mock.patch.object(vsa_triton, "triton_applies", triton_applies),
               mock.patch.object(vsa, "triton_applies", triton_applies)]
    sdpa.choose_kernel.cache_clear()
    try:
        with contextlib.ExitStack() as stack:
            for p in patches:
                stack.enter_context(p)
            yield calls
    finally:
        sdpa.choose_kernel.cache_clear()
        torch._dynamo.reset()


def _slots(offsets, sizes, tile_volume):
    """``[N * V]``: for each padded slot of the packed tiles, the token it holds, or -1."""
    slot = torch.arange(tile_volume)
    tokens = offsets.long()[:, None] + slot
    return torch.where(slot < sizes.long()[:, None], tokens, -1).reshape(-1)


def _gather(x, slots, num_tiles, tile_volume):
    """Packed ``[B, H, S, D]`` -> padded ``[B, H, N, V, D]`` (zero padded slots) by the slots of :func:`_slots`."""
    out = x[:, :, slots.clamp(min=0)] * (slots >= 0)[:, None].to(x.dtype)
    return out.unflatten(2, (num_tiles, tile_volume))


def recording_backend(targets: Counter):
    """A ``torch.compile`` backend that counts the ``call_function`` targets of every graph it gets (as
    ``str(node.target)``) and then runs it through ``aot_eager`` (AOTAutograd with fake tensors, which
    exercises the custom operators' fake implementations, then eager kernels)."""
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        targets.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return aot_eager(gm, example_inputs)

    return backend
