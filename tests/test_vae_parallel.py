"""Parallel VAE decode: a tiny Wan VAE's tiles shared over 2 and 4 ranks equal the
single-process tiled decode bit for bit (float32, CPU), and each rank's peak tensor memory is lower.

Peak memory is measured with diffusers_sp.vae.track_peak_memory (live tensor storage allocated
inside the decode, tracked per op). Runs inside the spawns of tests/cases_cfg.py.
"""

from __future__ import annotations

import pytest

from cases_cfg import results
from distributed import values


@pytest.mark.parametrize("P", (2, 4))
def test_tiled_decode_equal_and_lower_peak(P):
    for rank, v in enumerate(values(results(P), "vae_wan_tiled_decode")):
        assert v["cmp"]["equal"], f"P={P} rank {rank}: {v['cmp']}"
        assert v["peak_parallel"] < v["peak_single"], f"P={P} rank {rank}: {v}"


@pytest.mark.parametrize("P", (2, 4))
def test_pipeline_parallel_vae(P):
    for rank, v in enumerate(values(results(P), "vae_wan_pipeline")):
        assert v["cmp"]["equal"], f"P={P} rank {rank}: {v['cmp']}"
        assert v["restored"]


@pytest.mark.parametrize("P", (2, 4))
def test_other_vae_families(P):
    for rank, v in enumerate(values(results(P), "vae_other_families")):
        for family, cmp in v.items():
            assert cmp["equal"], f"P={P} rank {rank} {family}: {cmp}"
