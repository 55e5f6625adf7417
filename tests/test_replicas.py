"""Replicas: 4 ranks with sp_degree=2 form 2 replicas; three prompts are spread over them.

Each prompt's output is produced exactly once (by its replica's output rank) and equals the
single-process result for that prompt. Runs inside the world-size-4 spawn of tests/cases_cfg.py.
"""

from __future__ import annotations

import torch

from cases_cfg import PROMPTS, results
from diffusers_sp.replicas import split_for_replica
from distributed import FLOAT32_TOL as TOL, values



def test_three_prompts_on_two_replicas():
    vals = values(results(4), "replicas_prompts")
    infos = [v["info"] for v in vals]
    assert [i["replica_index"] for i in infos] == [0, 0, 1, 1]
    assert all(i["num_replicas"] == 2 and i["sp"] == 2 for i in infos)
    assert [i["output_rank"] for i in infos] == [True, False, True, False]
    produced = {}
    for v in vals:
        for index, out in v["outputs"].items():
            assert index not in produced, f"prompt {index} written twice"
            produced[index] = out
    assert sorted(produced) == [0, 1, 2]
    refs = vals[0]["refs"]
    for index, out in produced.items():
        ref = refs[index]
        assert out.shape == ref.shape
        assert (out - ref).abs().max().item() <= TOL * max(ref.abs().max().item(), 1.0), index
    # Different prompts give different videos (the replicas really ran different prompts).
    assert not torch.equal(produced[0], produced[1])


def test_split_for_replica_round_robin():
    items = list(range(7))
    parts = [split_for_replica(items, r, 3) for r in range(3)]
    assert sorted(i for p in parts for i, _ in p) == items
    assert [len(p) for p in parts] == [3, 2, 2]
    assert len(PROMPTS) == 3
