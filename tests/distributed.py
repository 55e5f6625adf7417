"""Runs test cases inside P processes on CPU/gloo, once per world size (see DESIGN.md, "Testing").

A *case* is a module-level function ``case_<name>()`` in a module under ``tests/``, run on every
rank. Before it runs, the process group is initialised through the same path users take
(``accelerate.PartialState`` via :func:`diffusers_sp.groups.resolve_group`) from the environment a
launcher would set. A case returns a picklable value (usually metrics that the pytest side
asserts on) or raises. One spawn per (module, world size) runs all the cases of that module, in
order, and returns ``{case name: [result of rank 0, ..., result of rank P-1]}``, where a result is
``("ok", value)`` or ``("error", "ExceptionType: message", traceback text)``.

Cases must fail identically on every rank (or not at all), as the product does; the gloo group has a
short collective timeout (:data:`diffusers_sp.groups.TIMEOUT_ENV`) so a case that does not still ends.
"""

from __future__ import annotations

import importlib
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback

import torch.multiprocessing as mp

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(local_rank: int, world_size: int, port: int, module: str, cases: list[str], out_dir: str, device: str):
    import faulthandler

    faulthandler.enable()  # a crash of a rank (e.g. SIGSEGV in a native library) prints its Python stack
    if device == "cpu":
        # gloo on CPU even on a machine with GPUs.
        os.environ.update(ACCELERATE_USE_CPU="1", CUDA_VISIBLE_DEVICES="")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
                      LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                      OMP_NUM_THREADS="1")
    os.environ.setdefault("DIFFUSERS_SP_TIMEOUT_S", "120")
    sys.path.insert(0, TESTS_DIR)
    import torch

    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    from diffusers_sp.groups import resolve_group

    resolve_group()
    mod = importlib.import_module(module)
    results = {}
    for name in cases:
        other, _, case = name.rpartition(":")  # "<module>:<case>": a case of another module, in this spawn
        try:
            results[name] = ("ok", getattr(importlib.import_module(other) if other else mod, f"case_{case}")())
        except Exception as exc:  # reported to the pytest side, which fails that case's test
            results[name] = ("error", f"{type(exc).__name__}: {exc}", traceback.format_exc())
    from diffusers_sp.groups import destroy_process_groups

    # Every case has returned on every rank: end the groups here, while Python is intact, and record
    # any process-group thread that outlives them (such a thread aborted workers at exit).
    destroy_process_groups(barrier=True)
    results[TEARDOWN] = process_group_threads()
    with open(os.path.join(out_dir, f"rank{local_rank}.pkl"), "wb") as f:
        pickle.dump(results, f)


#: Key of a worker's results that lists the process-group threads alive after its teardown.
TEARDOWN = "__teardown__"
#: Names (Linux ``comm``) of the threads torch.distributed's backends run: gloo's work loops and
#: transport loop, NCCL's watchdog and heartbeat monitor.
PROCESS_GROUP_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop", "pt_nccl_watchdg", "pt_nccl_heartbt")


def process_group_threads() -> list[str]:
    """Names of this process's threads that belong to a process group (see
    :data:`PROCESS_GROUP_THREADS`); empty once every group is destroyed. Linux only (``/proc``)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if name.startswith(PROCESS_GROUP_THREADS):
            names.append(name)
    return sorted(names)


#: Equality with one process in float32: max abs difference <= FLOAT32_TOL x max(output scale, 1)
#: (DESIGN.md, Testing).
FLOAT32_TOL = 1e-5


def compare(ref, out) -> dict:
    """Inside a case: how ``out`` differs from the one-process ``ref`` (tensors), as picklable floats.

    Returns ``{"shape_ok", "equal" (bitwise), "max_abs" (inf when the shapes differ), "scale" (max abs of ref)}``.
    """
    import torch

    shape_ok = tuple(out.shape) == tuple(ref.shape)
    return {"shape_ok": shape_ok, "equal": shape_ok and torch.equal(ref, out),
            "max_abs": (out.double() - ref.double()).abs().max().item() if shape_ok else float("inf"),
            "scale": ref.abs().max().item()}


def within(metrics: dict, tol: float = FLOAT32_TOL) -> bool:
    """Whether :func:`compare`'s ``metrics`` meet ``tol`` relative to the output's scale."""
    return metrics["shape_ok"] and metrics["max_abs"] <= tol * max(metrics["scale"], 1.0)


def assert_close(metrics: dict, what: str, tol: float = FLOAT32_TOL) -> None:
    """Fails the calling test with ``what`` and the metrics unless :func:`within` holds."""
    assert within(metrics, tol), f"{what}: {metrics}"


def error_of(fn) -> str:
    """Runs ``fn`` inside a case: the message of the SequenceParallelConfigError it raises, or "no error"."""
    from diffusers_sp import SequenceParallelConfigError

    try:
        fn()
    except SequenceParallelConfigError as exc:
        return str(exc)
    return "no error"


def case_names(module) -> list[str]:
    """Names of the ``case_*`` functions of ``module``, in definition order."""
    return [n[len("case_"):] for n in vars(module) if n.startswith("case_") and callable(getattr(module, n))]


def run_cases(module: str, world_size: int, cases: list[str] | None = None, timeout: float = 900,
              device: str = "cpu") -> dict:
    """Runs the cases of ``tests/<module>.py`` on ``world_size`` processes; see the module docstring.

    ``cases`` (default: every case of ``module``) may name a case of another module as
    ``"<module>:<case>"``, so that modules share one spawn per world size.

    ``device="cpu"`` runs them on gloo (CUDA hidden), ``"cuda"`` on NCCL with one GPU per rank.
    """
    sys.path.insert(0, TESTS_DIR)
    if cases is None:
        cases = case_names(importlib.import_module(module))
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_worker, args=(world_size, _free_port(), module, cases, out_dir, device),
                                 nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{module} at world size {world_size} did not finish in {timeout} s")
        per_rank = []
        for r in range(world_size):
            with open(os.path.join(out_dir, f"rank{r}.pkl"), "rb") as f:
                per_rank.append(pickle.load(f))
    leftover = {r: res[TEARDOWN] for r, res in enumerate(per_rank) if res[TEARDOWN]}
    if leftover:
        raise AssertionError(f"{module} at world size {world_size}: process-group threads alive after "
                             f"destroy_process_groups(): {leftover}")
    return {name: [per_rank[r][name] for r in range(world_size)] for name in cases}


def values(results: dict, name: str) -> list:
    """The per-rank values of case ``name``; fails the calling test with the rank's traceback on error."""
    out = []
    for rank, res in enumerate(results[name]):
        if res[0] != "ok":
            raise AssertionError(f"case {name} failed on rank {rank}: {res[1]}\n{res[2]}")
        out.append(res[1])
    return out


def errors(results: dict, name: str) -> list[str]:
    """The per-rank error messages of case ``name``, which must have raised on every rank."""
    msgs = []
    for rank, res in enumerate(results[name]):
        if res[0] != "error":
            raise AssertionError(f"case {name} was expected to raise on rank {rank}, returned {res[1]!r}")
        msgs.append(res[1])
    return msgs
