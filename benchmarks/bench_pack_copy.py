#!/usr/bin/env python
"""How fast the copy-engine transport's packing copy can be: one rank's K shard of the Wan 1.3B shape
([S_r, B, H, D] = [16380, 1, 12, 128], bf16) written into the head-group-major layout
[G, S, B, H/G, D] (G = 4), against a plain contiguous copy of the same bytes.

Variants: one permuted 5-D copy (what ``kv_gather_attention_copy_engine`` did until the transport pushed
with 2-D copy-engine copies, b2c4ccf), one copy per head
group, a 3-D view of the same permutation, ``index_select`` into a contiguous buffer (speed only: the
real destination is not contiguous), and the plain copy (the bound). Times from Triton's
``do_bench``; TB/s counts bytes read and written. Needs a CUDA GPU and Triton.

    python benchmarks/bench_pack_copy.py
"""

from __future__ import annotations

import torch
from triton.testing import do_bench


def main() -> None:
    S_r, B, H, D, G = 16380, 1, 12, 128, 4
    h, S = H // G, 2 * S_r
    src_full = torch.randn(B, S_r, H, D, device="cuda", dtype=torch.bfloat16)
    src = src_full.permute(1, 0, 2, 3)  # [S_r, B, H, D], as the model hands K over
    buf = torch.empty(G * S * B * h * D, device="cuda", dtype=torch.bfloat16)
    lo, hi = 0, S_r

    def permuted_5d():
        buf.view(G, S, B, h, D)[:, lo:hi].copy_(src.unflatten(2, (G, h)).permute(2, 0, 1, 3, 4))

    def per_group():
        v = buf.view(G, S, B, h, D)
        for g in range(G):
            v[g, lo:hi].copy_(src[:, :, g * h:(g + 1) * h])

    def view_3d():
        buf.view(G, S * B, h * D)[:, lo * B:hi * B].copy_(src.reshape(S_r * B, G, h * D).permute(1, 0, 2))

    tmp = torch.empty(G * S_r * B, h * D, device="cuda", dtype=torch.bfloat16)
    idx = torch.arange(S_r * B * G, device="cuda").view(S_r * B, G).t().reshape(-1)

    def index_select():
        torch.index_select(src.reshape(S_r * B * G, h * D), 0, idx, out=tmp)

    flat = torch.empty(S_r * B * H * D, device="cuda", dtype=torch.bfloat16)

    def plain():
        flat.copy_(src_full.view(-1))

    for name, fn in (("permuted 5-D copy", permuted_5d), ("one copy per group", per_group), ("3-D view", view_3d),
                     ("index_select", index_select), ("plain contiguous", plain)):
        ms = do_bench(fn, warmup=20, rep=200)
        print(f"{name:20s} {ms * 1000:8.1f} us  {2 * src.numel() * 2 / ms / 1e9:6.2f} TB/s")
    permuted_5d()
    want = buf.clone()
    for fn in (per_group, view_3d):
        buf.zero_()
        fn()
        assert torch.equal(buf, want), fn.__name__
    print("layouts agree")


if __name__ == "__main__":
    main()
