"""Hybrid sequence parallelism (Ulysses inside groups of U ranks, K/V-gather across them) equals one
process (float32, CPU/gloo): world sizes 4 (2 x 2) and 6 (2 x 3, 3 x 2), and 8 for CFG parallelism and
replicas around a 2 x 2 mesh; ``mode="auto"``'s choice on emulated topologies. See tests/cases_hybrid.py.
"""

from __future__ import annotations

import pytest

from distributed import assert_close, run_cases, values

WORLD_SIZES = (4, 6)


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda p: f"P{p}")
def results(request):
    from cases_hybrid import case_names_below_8

    return request.param, run_cases("cases_hybrid", request.param, cases=case_names_below_8())
