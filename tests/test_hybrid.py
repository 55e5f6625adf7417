"""Hybrid sequence parallelism (Ulysses inside groups of U ranks, K/V-gather across them) equals one
process (float32, CPU/gloo): world sizes 4 (2 x 2) and 6 (2 x 3, 3 x 2), CFG parallelism and replicas
around the mesh; ``mode="auto"``'s choice on emulated topologies, with processes and without. The
cases are in tests/cases_hybrid.py, one spawn per world size.

World size 4 shares the spawn of tests/cases_cfg.py (its processes start once for both); world size 6
has its own. World size 8 (cfg 2 x kv_gather 2 x ulysses 2, and 2 replicas x 2 x 2) takes about 3
minutes on 2 CPU cores, so it runs only with ``DIFFUSERS_SP_TEST_8_RANKS=1``; at world size 4 the same
cases run CFG parallelism and replicas around a 1 x 2 mesh.
"""

from __future__ import annotations

import os

import pytest

from diffusers_sp import SequenceParallelConfigError
from diffusers_sp.traits import ModelTraits, PipelineTraits
from diffusers_sp.validation import choose_auto_mode, resolve_mode
from distributed import assert_close, run_cases, values

WORLD_SIZES = (4, 6)


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda p: f"P{p}")
def results(request):
    """The cases' results by name: world 4 from the spawn tests/cases_cfg.py's tests share, world 6 from
    a spawn of its own."""
    from cases_hybrid import cases_at

    P = request.param
    if P == 4:
        from cases_cfg import results as cfg_results

        shared = cfg_results(4)
        return P, {name: shared[f"cases_hybrid:{name}"] for name in cases_at(4)}
    return P, run_cases("cases_hybrid", P, cases=cases_at(P))


def _degrees(heads: int, world: int) -> list[int]:
    return [u for u in range(1, world + 1) if world % u == 0 and u <= heads]


@pytest.mark.parametrize("case,heads", [("wan_forward", 6), ("wan_forward_uneven_heads", 5),
                                        ("hunyuan_video_ragged_text", 3), ("qwenimage_ragged_text", 5)])
def test_forward_equals_one_process_at_every_factorisation(results, case, heads):
    P, res = results
    for rank, v in enumerate(values(res, case)):
        assert sorted(k for k in v if isinstance(k, int)) == _degrees(heads, P)
        for u in _degrees(heads, P):
            assert_close(v[u], f"P={P} rank {rank} {case} ulysses {u}")
            assert (v[u]["mode"], v[u]["ulysses"], v[u]["kv_gather"]) == ("hybrid", u, P // u)
            assert v[u]["seq_len"] == (175 if case.startswith("wan") else 35), "the forward did not run split"
            if case.startswith("wan"):
                assert v[u]["kv_first_calls"] == 2  # Wan's K/V-first self-attention, both blocks
        assert v["restored_bitwise"]


def test_forward_without_the_kv_first_path(results):
    P, res = results
    for rank, v in enumerate(values(res, "wan_forward_generic_path")):
        degrees = [u for u in _degrees(6, P) if 1 < u < P]
        assert degrees and sorted(k for k in v if isinstance(k, int)) == degrees
        for u in degrees:
            assert_close(v[u], f"P={P} rank {rank} generic path ulysses {u}")
            assert v[u]["kv_first_calls"] == 0


def test_fewer_heads_than_ranks(results):
    """2 heads on 4 or 6 ranks: 2 x P/2 runs exactly, and auto picks it; Ulysses alone is refused."""
    P, res = results
    for rank, v in enumerate(values(res, "wan_forward_fewer_heads_than_ranks")):
        assert_close(v[2], f"P={P} rank {rank} 2 heads, ulysses 2")
        assert_close(v["auto"], f"P={P} rank {rank} 2 heads, auto")
        assert (v["auto"]["mode"], v["auto"]["ulysses"]) == ("hybrid", 2)
        assert "2 heads for world size" in v["ulysses_error"] and "mode='hybrid'" in v["ulysses_error"]


def test_pipeline_equals_one_process(results):
    P, res = results
    for rank, v in enumerate(values(res, "wan_pipeline")):
        assert len(v) == 1
        for u, metrics in v.items():
            assert 1 < u < P
            assert_close(metrics, f"P={P} rank {rank} pipeline ulysses {u}")


def test_masks_on_raw_tensors(results):
    """Ragged key padding masks (boolean, additive, per head), joint text first or last, masks over the
    full sequence (block-causal, per head), a padding mask over queries and keys."""
    P, res = results
    for rank, v in enumerate(values(res, "functional_masks")):
        assert len(v) == 7 * len([u for u in _degrees(5, P) if 1 < u < P])
        for what, metrics in v.items():
            assert_close(metrics, f"P={P} rank {rank} {what}")


def test_vsa_over_the_hybrid_mesh(results):
    P, res = results
    for rank, v in enumerate(values(res, "vsa_hybrid")):
        degrees = [u for u in _degrees(6, P) if 1 < u < P]
        for u in degrees:
            assert_close(v[u], f"P={P} rank {rank} VSA hybrid ulysses {u}")
            assert (v[u]["sp_mode"], v[u]["ulysses"]) == ("hybrid", u)
        assert v["differs_from_dense"] > 1e-4  # sparsity 0.9 really is sparse


def test_auto_on_emulated_hosts(results):
    """Tiny Wan (6 heads): hosts of P ranks keep the one-host rule; smaller hosts get Ulysses inside a host
    over gcd(6, P, host) ranks and K/V-gather across hosts."""
    P, res = results
    expected = {4: {1: ("kv_gather", 1), 2: ("hybrid", 2), 4: ("kv_gather", 1)},
                6: {1: ("kv_gather", 1), 2: ("hybrid", 2), 3: ("hybrid", 3), 6: ("ulysses", 6)}}[P]
    for rank, v in enumerate(values(res, "auto_emulated_hosts")):
        assert {h: (m["mode"], m["ulysses"]) for h, m in v.items()} == expected
        for host, metrics in v.items():
            assert_close(metrics, f"P={P} rank {rank} auto with hosts of {host}")
            assert metrics["ulysses"] * metrics["kv_gather"] == P


def test_log_line_names_the_factorisation(results):
    P, res = results
    logs = values(res, "log_line")
    assert any(f"sp {P} (ulysses 2 x kv_gather {P // 2})" in line for line in logs[0]), logs[0]
    assert all(not lines for lines in logs[1:])  # rank 0 only


@pytest.mark.parametrize("key,needles", [
    ("not_a_divisor", ["ulysses_degree=5 does not divide", "values that work here: [1, 2, "]),
    ("too_few_heads", ["without a head", "has 2 heads", "values that work here: [1, 2]"]),
    ("ulysses_contradicts", ["mode='ulysses' runs Ulysses over all", "mode='hybrid'"]),
    ("kv_gather_contradicts", ["mode='kv_gather' gathers K and V", "mode='hybrid'"]),
    ("copy_engine", ["sp_transport='copy_engine' does not apply to mode='hybrid'"]),
    ("process_group", ["process_group=None"]),
    ("vsa_sp_mode_contradicts", ["vsa_sp_mode='kv_gather'", "vsa_sp_mode='hybrid'"]),
])
def test_errors_alike_on_every_rank(results, key, needles):
    P, res = results
    msgs = [v[key] for v in values(res, "errors")]
    assert len(set(msgs)) == 1, msgs
    for needle in needles:
        assert needle in msgs[0], msgs[0]


def _check_layout_cases(P, res):
    for rank, v in enumerate(values(res, "cfg_hybrid")):
        assert v["layout"] == dict(replicas=1, cfg=2, kv_gather=P // 4, ulysses=2, replica=0, cfg_rank=rank // (P // 2))
        for prompt in (0, 1):
            assert_close(v[prompt], f"P={P} rank {rank} CFG x hybrid, prompt {prompt}")
        assert v["parallel_steps"] == 2 * 3  # both prompts' 3 steps ran their two passes in parallel
    per_rank = values(res, "replicas_hybrid")
    for rank, v in enumerate(per_rank):
        replica = rank // (P // 2)
        assert v["layout"] == dict(replicas=2, cfg=1, kv_gather=P // 4, ulysses=2, replica=replica, cfg_rank=0)
        assert sorted(k for k in v if isinstance(k, int)) == [replica]  # one prompt per replica
        assert_close(v[replica], f"P={P} rank {rank} replicas x hybrid")


def test_cfg_parallel_and_replicas_compose(results):
    P, res = results
    if P != 4:
        pytest.skip("the layout cases need a world of 4 or 8")
    _check_layout_cases(P, res)


@pytest.mark.skipif(os.environ.get("DIFFUSERS_SP_TEST_8_RANKS") != "1",
                    reason="8 processes take about 3 minutes on 2 CPU cores; set DIFFUSERS_SP_TEST_8_RANKS=1")
def test_cfg_parallel_and_replicas_around_a_2x2_mesh_at_8_ranks():
    """world = cfg 2 x kv_gather 2 x ulysses 2, and 2 replicas x kv_gather 2 x ulysses 2."""
    from cases_hybrid import cases_at

    _check_layout_cases(8, run_cases("cases_hybrid", 8, cases=cases_at(8)))


# ------------------------------------------------------------------ auto's rule without processes


def _traits(*heads: int) -> PipelineTraits:
    models = tuple(ModelTraits(name=f"M{i}", attribute="transformer", num_heads=h, head_dim=8, is_video=True,
                               patch_size=(1, 2, 2), joint_text=None, text_mask=False, num_attention_layers=1)
                   for i, h in enumerate(heads))
    return PipelineTraits(name="P", family="f", is_video=True, models=models)


@pytest.mark.parametrize("heads,world,host,expected", [
    # one host (host None: not launched by a launcher, or a host of at least the group)
    ((12,), 2, None, ("kv_gather", 1)),
    ((24,), 8, 8, ("ulysses", 8)),
    ((12,), 8, 8, ("kv_gather", 1)),      # uneven heads on one host: today's rule
    ((2,), 4, None, ("hybrid", 2)),       # fewer heads than ranks: 2 x 2
    ((12,), 16, 16, ("hybrid", 4)),       # Wan 1.3B on one 16-rank host: 12 heads, gcd 4
    ((1,), 4, None, ("kv_gather", 1)),
    ((5,), 8, None, ("kv_gather", 1)),    # gcd(5, 8) = 1
    # several hosts: Ulysses inside a host over gcd(H, P, host), K/V-gather across
    ((12,), 16, 8, ("hybrid", 4)),        # Wan2.1-1.3B on 2 x 8 GPUs: 4 x 4
    ((40,), 16, 8, ("hybrid", 8)),        # Wan 14B on 2 x 8 GPUs: 8 x 2 (40 heads over 16 are uneven)
    ((40,), 32, 8, ("hybrid", 8)),        # 4 hosts: 8 x 4
    ((12, 40), 16, 8, ("hybrid", 4)),     # two transformers (Wan 2.2): the heads of both split evenly
    ((12,), 4, 2, ("hybrid", 2)),         # the CPU emulation of two hosts of 2 ranks
    ((12,), 2, 1, ("kv_gather", 1)),      # two hosts of one rank
    ((7,), 16, 8, ("kv_gather", 1)),      # gcd(7, 16, 8) = 1
    ((24,), 4, 8, ("ulysses", 4)),        # groups of 4 inside hosts of 8 (replicas or CFG): one host each
    ((24,), 4, 6, ("hybrid", 2)),         # groups of 4 over hosts of 6 cross hosts: Ulysses over 2
])
def test_auto_rule(heads, world, host, expected):
    traits = _traits(*heads)
    assert resolve_mode("auto", traits, world, host_size=host) == expected
    assert choose_auto_mode(traits, world, host) == expected[0]
    # What auto picks always runs when asked for explicitly.
    mode, u = expected
    assert resolve_mode(mode, traits, world, ulysses_degree=u if mode == "hybrid" else None, host_size=host)[1] == u


@pytest.mark.parametrize("mode,u,expected", [("auto", 4, ("ulysses", 4)), ("auto", 1, ("kv_gather", 1)),
                                             ("auto", 2, ("hybrid", 2)), ("hybrid", 4, ("hybrid", 4)),
                                             ("hybrid", None, ("hybrid", 2)), ("ulysses", 4, ("ulysses", 4)),
                                             ("kv_gather", 1, ("kv_gather", 1))])
def test_explicit_ulysses_degree_honoured(mode, u, expected):
    """12 heads on 4 ranks in hosts of 2: an explicit degree is honoured across hosts too; without one,
    hybrid takes gcd(12, 4, 2) = 2."""
    assert resolve_mode(mode, _traits(12), 4, ulysses_degree=u, host_size=2) == expected


@pytest.mark.parametrize("mode,heads,u,needle", [
    ("hybrid", 2, 3, "does not divide the 4 ranks"),
    ("hybrid", 2, 0, "is not a positive int"),
    ("hybrid", 2, True, "is not a positive int"),
    ("auto", 2, 4, "without a head (M0 has 2 heads)"),
    ("ulysses", 4, 2, "mode='ulysses' runs Ulysses over all 4 ranks"),
    ("kv_gather", 4, 4, "mode='kv_gather' gathers K and V"),
])
def test_bad_ulysses_degree_refused(mode, heads, u, needle):
    with pytest.raises(SequenceParallelConfigError) as err:
        resolve_mode(mode, _traits(heads), 4, ulysses_degree=u)
    assert needle in str(err.value), str(err.value)


def test_auto_falls_back_where_hybrid_cannot_run(results):
    P, res = results
    for rank, v in enumerate(values(res, "auto_falls_back_where_hybrid_cannot_run")):
        assert v["process_group"]["sp_mode"] == "kv_gather" and v["process_group"]["ulysses"] == 1, v
        assert_close(v["process_group"], f"P={P} rank {rank} auto with a process_group")
        assert v["vsa_process_group"] == dict(sp_mode="kv_gather", ulysses=1), v
        # On CPU the copy engines are refused for their own reason (they need CUDA), not for hybrid.
        assert "hybrid" not in v["copy_engine"], v["copy_engine"]


def test_refused_on_one_rank_alike_everywhere(results):
    P, res = results
    per_rank = values(res, "refused_on_one_rank_alike_everywhere")
    msgs = [v["error"] for v in per_rank]
    assert len(set(msgs)) == 1, msgs
    assert "rank 0" in msgs[0] and "ulysses_degree=5" in msgs[0], msgs[0]
    assert all(v["sum"] == P for v in per_rank)
