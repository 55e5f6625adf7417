"""CFG parallelism against one process, CPU/gloo: world size 2 (cfg 2 x sp 1) and 4 (cfg 2 x sp 2).

Two-call pipelines (Wan) must be bit for bit equal at cfg 2 x sp 1; at cfg 2 x sp 2 sequence
parallelism inside each CFG group allows the usual float tolerance (TOL; on CPU they are bitwise
equal in practice). The batched-CFG pipeline (CogVideoX, batch of 2 split in two halves) is held to
diffusers_sp.cfg_parallel.BATCHED_TOLERANCE. The cases run in one spawn per world size
(tests/cases_cfg.py, shared with test_replicas.py and test_vae_parallel.py).
"""

from __future__ import annotations

import pytest

from cases_cfg import results as run_results
from diffusers_sp import SequenceParallelConfigError
from diffusers_sp.cfg_parallel import BATCHED_TOLERANCE, choose_cfg_parallel
from diffusers_sp.replicas import resolve_layout
from distributed import FLOAT32_TOL as TOL, values, within


@pytest.fixture(scope="module", params=(2, 4), ids=lambda p: f"P{p}")
def results(request):
    return request.param, run_results(request.param)


@pytest.mark.parametrize("case,transformers", [("cfg_wan_t2v", 1), ("cfg_wan_i2v", 1),
                                               ("cfg_wan22_two_transformers", 2)])
def test_two_call_pipeline_equals_one_process(results, case, transformers):
    P, res = results
    for rank, v in enumerate(values(res, case)):
        for key in ("cmp", "cmp2"):  # first and second pipeline call
            if P == 2:  # cfg 2 x sp 1: bit for bit
                assert v[key]["equal"], f"P={P} rank {rank} {case} {key}: {v[key]}"
            else:  # cfg 2 x sp 2: sequence parallelism's tolerance
                assert within(v[key], TOL), f"P={P} rank {rank} {case} {key}: {v[key]}"
        assert v["layout"] == dict(cfg_rank=rank // (P // 2), cfg_degree=2, sp=P // 2, num_replicas=1,
                                   replica_index=0)
        assert len(v["stats"]) == transformers
        # Every step ran its two passes in parallel (the Wan prediction from encode_prompt), none missed.
        assert sum(s["parallel"] for s in v["stats"]) == 2 * 3  # two pipeline calls x 3 steps
        assert all(s["missed"] == 0 and s["redundant"] == 0 for s in v["stats"])
        assert v["restored"], "disable() did not restore the single-process outputs bit for bit"


def test_guidance_off_still_exact(results):
    P, res = results
    for v in values(res, "cfg_wan_guidance_off"):
        assert v["cmp"]["equal"] if P == 2 else within(v["cmp"], TOL)
        assert v["stats"][0]["parallel"] == 0 and v["stats"][0]["redundant"] == 6  # no speed-up, by design


def test_batched_cfg_pipeline_within_tolerance(results):
    P, res = results
    for rank, v in enumerate(values(res, "cfg_batched_cogvideox")):
        assert within(v["cmp"], BATCHED_TOLERANCE), f"P={P} rank {rank}: {v['cmp']}"
        assert v["stats"][0]["batch_split"] == 3


def test_auto_chooses_cfg_parallel(results):
    P, res = results
    for v in values(res, "cfg_auto"):
        assert v == {"cfg_degree": 2, "sp": P // 2}


def test_pag_pipeline_refuses_cfg_parallel(results):
    P, res = results
    got = values(res, "cfg_pag_refused")
    assert len({v["refused"] for v in got}) == 1
    msg = got[0]["refused"]
    assert "StableDiffusion3PAGPipeline" in msg and "perturbed-attention guidance" in msg and \
        "cfg_parallel=False" in msg, msg
    assert all(v["auto"] == (1, P) for v in got), got  # 'auto': sequence parallelism over every rank


def test_groups_usable_after(results):
    P, res = results
    assert values(res, "group_usable_after") == [P * (P + 1) / 2] * P


def test_auto_rule_records_measurement():
    use, reason = choose_cfg_parallel("wan", 2, None, True)
    assert use and "4.77" in reason and "5.95" in reason
    assert choose_cfg_parallel("wan", 3, None, True)[0] is False
    assert choose_cfg_parallel("wan", 2, None, False)[0] is False


@pytest.mark.parametrize("kwargs,world,needles", [
    (dict(cfg_parallel=True), 3, ["even number of ranks", "2 or 4"]),
    (dict(cfg_parallel=True), 1, ["got 1. Launch 2 ranks"]),  # said "Launch 2 or 2 ranks"
    (dict(cfg_parallel=True, sp_degree=3), 4, ["sp_degree values that work here: [1, 2]"]),
    (dict(sp_degree=3), 4, ["[1, 2, 4]"]),
    (dict(sp_degree=0), 4, ["positive int"]),
    (dict(cfg_parallel="yes"), 2, ["False, True or 'auto'"]),
    (dict(cfg_parallel=True, process_group=object()), 2, ["process_group=None"]),
    (dict(cfg_parallel=True, cfg_capable=False), 2, ["cfg_parallel=False"]),
])
def test_layout_errors(kwargs, world, needles):
    with pytest.raises(SequenceParallelConfigError) as exc:
        resolve_layout("WanPipeline", world, **kwargs)
    for needle in needles:
        assert needle in str(exc.value)


def test_layouts():
    assert resolve_layout("W", 8, cfg_parallel=True, sp_degree=2) == resolve_layout("W", 8, cfg_parallel=True,
                                                                                    sp_degree=2)
    lay = resolve_layout("W", 8, cfg_parallel=True, sp_degree=2)
    assert (lay.num_replicas, lay.cfg_degree, lay.sp_degree) == (2, 2, 2)
    lay = resolve_layout("W", 4)
    assert (lay.num_replicas, lay.cfg_degree, lay.sp_degree, lay.trivial) == (1, 1, 4, True)


def test_layout_disagreement_raises_on_every_rank(results):
    """Different cfg_parallel / sp_degree on different ranks: the same clear error everywhere, no hang."""
    P, res = results
    for key in ("plain", "copy_engine"):
        messages = [v[key] for v in values(res, "layout_disagrees")]
        assert len(set(messages)) == 1, messages
        assert "ranks disagree" in messages[0], messages[0]
        assert ("cfg_degree" if P == 2 else "sp_degree") in messages[0], messages[0]
        assert "not checked" not in messages[0], messages[0]  # only real differences are listed

