"""CPU smoke test of benchmarks/bench_transformer.py: the whole script, end to end, under torchrun (gloo).

Runs ``--device cpu --quick`` (tiny Wan shapes, float32) at world size 1 and 2 (both launched at
once, one torchrun each) and checks the JSON: the rows the GPU run will have, finite times, and
diffusers-sp's outputs equal to the stock model's (relative error <= 1e-4 in float32).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "bench_transformer.py"
TOL = 1e-4


def _launch(world_size: int, out: Path, cases: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
           str(SCRIPT), "--device", "cpu", "--quick", "--cases", cases, "--no-compile", "--no-sdpa-report",
           "--repeats", "2", "--warmup", "1", "--timeout", "120", "--json", str(out),
           "--variants", json.dumps({"kv_gather nccl G=3": ["kv_gather", {"sp_transport": "nccl",
                                                                         "overlap_head_groups": 3}]})]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.pop("WORLD_SIZE", None)
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    # World size 2 runs both quick cases (72 tokens: even; 45 tokens: uneven shards), world size 1 one.
    procs = {1: (_launch(1, tmp / "ws1.json", "1.3b"), tmp / "ws1.json"),
             2: (_launch(2, tmp / "ws2.json", "1.3b,14b"), tmp / "ws2.json")}
    results = {}
    for ws, (proc, path) in procs.items():
        try:
            log, _ = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            log, _ = proc.communicate()
            pytest.fail(f"world size {ws}: benchmark timed out\n{log[-4000:]}")
        assert proc.returncode == 0, f"world size {ws}: exit {proc.returncode}\n{log[-4000:]}"
        results[ws] = (json.loads(path.read_text()), log)
    return results


def _rows(data) -> dict:
    return {(r["case"], r["mode"]): r for r in data["rows"]}


def _assert_ok(row, what):
    assert row["status"] == "ok", f"{what}: {row}"
    assert row["ms"] is not None and math.isfinite(row["ms"]) and row["ms"] > 0, f"{what}: {row}"
    assert row["rel_err"] is not None and row["rel_err"] <= TOL, f"{what}: {row}"
    assert row["speedup"] is not None and math.isfinite(row["speedup"]), f"{what}: {row}"


@pytest.mark.parametrize("ws", [1, 2])
def test_rows_and_accuracy(runs, ws):
    data, log = runs[ws]
    rows = _rows(data)
    cases = ["1.3b"] if ws == 1 else ["1.3b", "14b"]
    for case in cases:
        stock = rows[(case, "stock (native)")]
        _assert_ok(stock, f"ws={ws} {case} stock")
        assert stock["ranks"] == 1 and stock["rel_err"] == 0.0 and stock["speedup"] == 1.0
        assert "self:" in (stock["kernels"] or ""), stock
        for mode in ("ulysses", "kv_gather", "kv_gather nccl G=3"):
            row = rows[(case, f"ours {mode}")]
            _assert_ok(row, f"ws={ws} {case} ours {mode}")
            assert row["ranks"] == ws and len(row["ms_per_rank"]) == ws
            assert row["ms"] == max(row["ms_per_rank"])
        # VSA: timed when the installed diffusers-sp has it, else skipped with the reason.
        vsa = rows[(case, "ours vsa")]
        assert vsa["status"] in ("ok", "skipped"), vsa
        if vsa["status"] == "skipped":
            assert "vsa" in vsa["note"], vsa
        every = rows.get((case, "stock (native), every GPU at once"))
        if ws == 1:
            assert every is None
        else:  # each GPU's (here each process's) pace, listed in the note
            _assert_ok(every, f"{case} stock on every GPU")
            assert every["ranks"] == 2 and every["ms"] == max(every["ms_per_rank"]), every
            assert every["note"].startswith("per GPU: ") and every["note"].count(" / ") == 1, every
        for label in ("stock (cudnn)", "stock (flash)"):
            assert rows[(case, label)]["status"] == "skipped"  # CUDA only
    if ws == 1:
        assert rows[("1.3b", "diffusers CP")]["status"] == "skipped"
    else:
        # Diffusers' own Ulysses runs on gloo (even split, 4 heads over 2 ranks) and matches the stock model.
        _assert_ok(rows[("1.3b", "diffusers ulysses (native)")], "diffusers ulysses")
        # cuDNN rows fail on CPU; the failure is reported in the row and the run goes on.
        for label in ("diffusers ulysses (cudnn)", "diffusers ring (cudnn)"):
            row = rows[("1.3b", label)]
            assert row["status"] == "failed" and row["note"], row
        assert ("14b", "diffusers ring (cudnn)") in rows
    meta = data["meta"]
    assert meta["world_size"] == ws
    for key in ("date_utc", "device", "torch", "diffusers", "command", "git_commit"):
        assert key in meta
    assert "| mode |" in log and "## Results" in log


def test_cache_benchmark_smoke(tmp_path):
    """benchmarks/bench_cache.py --device cpu --quick at world size 2: every row, the automatic threshold
    skipping some steps but not all, and diffusers-sp's cached call equal to the stock cached call."""
    out = tmp_path / "cache.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(REPO / "benchmarks" / "bench_cache.py"), "--device", "cpu", "--quick", "--steps", "6",
           "--repeats", "1", "--warmup", "0", "--modes", "kv_gather", "--collective-repeats", "5",
           "--timeout", "120", "--json", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{(proc.stdout + proc.stderr)[-4000:]}"
    data = json.loads(out.read_text())
    assert data["meta"]["world_size"] == 2 and data["meta"]["date_utc"]
    rows = {r["label"]: r for r in data["rows"]}
    assert set(rows) == {"stock, no cache", "stock, first block cache", "ours kv_gather, no cache",
                         "ours kv_gather, first block cache", "decision collective (one per step)"}
    for r in rows.values():
        assert r["ms"] is not None and math.isfinite(r["ms"]) and r["ms"] > 0, r
    assert rows["stock, no cache"]["steps_computed"] == 6
    cached = rows["stock, first block cache"]["steps_computed"]
    assert 0 < cached < 6 and rows["ours kv_gather, first block cache"]["steps_computed"] == cached, rows
    for label in ("ours kv_gather, no cache", "ours kv_gather, first block cache"):
        assert rows[label]["rel_err"] <= TOL, rows[label]


def test_plot_speedup_table_from_results(tmp_path):
    """benchmarks/plot_speedup.py reads the stored H200 results: one run per shape and GPU count, every
    plotted row a same-run ratio against the stock row; the PNG is written where matplotlib is installed."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import plot_speedup
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    chosen = plot_speedup.select(plot_speedup.load_runs(REPO / "benchmarks" / "results"))
    assert "NVIDIA H200" in chosen
    by_case = chosen["NVIDIA H200"]
    assert set(by_case) >= {"1.3b", "14b"} and all(2 in by_case[c] for c in ("1.3b", "14b"))
    for case in ("1.3b", "14b"):
        run = by_case[case][2]
        assert run.speedup[plot_speedup.STOCK] == 1.0
        for name, _ in plot_speedup.ROWS:
            assert math.isclose(run.speedup[name], run.ms[plot_speedup.STOCK] / run.ms[name])
    table = plot_speedup.markdown_table("NVIDIA H200", by_case)
    assert "diffusers-sp K/V-gather" in table and "Diffusers CP Ulysses (cuDNN)" in table
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert plot_speedup.main(["--out", str(tmp_path / "speedup.png")]) == 0
    assert (tmp_path / "speedup.png").stat().st_size > 10_000
