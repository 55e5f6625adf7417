"""What the example scripts share: messages from rank 0 only, one-line errors, output paths, the
``--check`` comparison and an ordered end of the run.

A launched run (``accelerate launch`` or ``torchrun``) starts the same script on every rank. A bad
flag or a :class:`~diffusers_sp.SequenceParallelConfigError` (raised alike on every rank, before any
collective) is printed once, by rank 0, as one line, and every rank exits non-zero (the launcher then
adds its own failure summary); ``--help`` is printed once. Whatever happens, the process groups are
destroyed before Python exits (:func:`diffusers_sp.groups.destroy_process_groups`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

import diffusers_sp  # noqa: F401  (first: it drops torchao's import warnings before Diffusers loads)


def launch_rank() -> int:
    """This process's global rank: from torch.distributed once initialised, else from the
    launcher's ``RANK`` (0 when not launched)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


class FlagError(Exception):
    """A flag value that cannot run, found before any model is loaded; printed as one line."""


class ArgumentParser(argparse.ArgumentParser):
    """``argparse`` for a launched script: help is printed by rank 0 only, and an error is a
    :class:`FlagError`, one line (``<prog>: error: <what> (see --help)``) with exit status 2 from
    :func:`run`."""

    def _print_message(self, message, file=None):
        if message and launch_rank() == 0:
            super()._print_message(message, file)

    def error(self, message):
        raise FlagError(f"{message} (see --help)")


def add_run_flags(p: argparse.ArgumentParser) -> None:
    """The flags every example shares: ``--seed``, ``--dtype``, ``--check``, ``--cfg-parallel``,
    ``--sp-degree``, ``--ulysses-degree`` and ``--prompts-file`` (checked by :func:`check_run_flags`)."""
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--check", action="store_true",
                   help="every rank then also runs without sequence parallelism and compares its output")
    p.add_argument("--cfg-parallel", default="off", choices=["off", "on", "auto"],
                   help="CFG parallelism: two rank groups for the conditional / unconditional passes")
    p.add_argument("--sp-degree", type=int, default=None,
                   help="ranks per sequence-parallel group (default: all ranks not used by CFG); the rest are replicas")
    p.add_argument("--ulysses-degree", type=int, default=None,
                   help="--mode hybrid or auto: Ulysses inside groups of this many ranks, K/V-gather across them "
                        "(default: chosen from the heads, the ranks and the ranks per host)")
    p.add_argument("--prompts-file", default=None,
                   help="file with one prompt per line, spread over the replicas (outputs <stem>_000<suffix>, ...)")


def check_run_flags(args) -> None:
    """The checks of :func:`add_run_flags`' values and of ``--steps`` (:class:`FlagError`)."""
    if args.steps < 1:
        raise FlagError(f"--steps {args.steps}: must be at least 1")
    if args.sp_degree is not None and args.sp_degree < 1:
        raise FlagError(f"--sp-degree {args.sp_degree}: must be at least 1")
    if args.ulysses_degree is not None and args.ulysses_degree < 1:
        raise FlagError(f"--ulysses-degree {args.ulysses_degree}: must be at least 1")


def run(main, argv=None) -> None:
    """Runs ``main(argv)`` and exits with its status.

    A :class:`FlagError` (status 2) or a ``SequenceParallelConfigError`` (status 1) becomes one line
    on rank 0; any other exception keeps its traceback. In every case the process groups are
    destroyed first (without waiting for the other ranks: after an error they may never come).
    """
    from diffusers_sp import SequenceParallelConfigError
    from diffusers_sp.groups import destroy_process_groups

    status, line = 1, None
    try:
        status = main(argv)
    except FlagError as exc:
        status, line = 2, f"{os.path.basename(sys.argv[0])}: error: {exc}"
    except SequenceParallelConfigError as exc:
        status, line = 1, f"error: {exc}"
    finally:
        rank = launch_rank()
        destroy_process_groups()
    if line is not None:
        if rank == 0:
            print(line, file=sys.stderr, flush=True)
        else:
            # Both errors are raised alike on every rank. The launcher stops the other ranks as soon
            # as one exits: leave rank 0 the time to print the line first.
            time.sleep(ERROR_GRACE_S)
    sys.exit(status)


#: Seconds a rank other than 0 waits after an expected error before it exits (see :func:`run`).
ERROR_GRACE_S = 2.0


def checked_output(path: str, suffixes: tuple[str, ...], default_name: str, needs_ffmpeg: tuple[str, ...] = ()) -> str:
    """``--output`` as the file to write: ``default_name`` inside it when it names a directory (an
    existing one, or any path ending in a separator), the first of ``suffixes`` added when it has none.

    Raises:
        FlagError: an unknown suffix, a missing writer (``needs_ffmpeg``: suffixes written through
            imageio-ffmpeg), or a folder that cannot be made or written (a path under a file, a
            read-only folder, a broken link), before any work, on every rank alike.
    """
    if path.endswith(("/", os.sep)) or os.path.isdir(path):
        path = os.path.join(path, default_name)
    elif not os.path.splitext(path)[1]:
        path += suffixes[0]
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in suffixes:
        raise FlagError(f"--output {path!r}: unknown format {suffix!r}; use one of {', '.join(suffixes)}")
    folder = os.path.dirname(os.path.abspath(path))
    existing = folder
    while not os.path.lexists(existing):  # the folders that do not exist yet are made when writing
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        what = ("is a broken symbolic link" if not os.path.exists(existing)
                else "is not a directory" if not os.path.isdir(existing) else "is not writable")
        raise FlagError(f"--output {path!r}: {existing!r} {what}, so the output could not be written there")
    if suffix in needs_ffmpeg and importlib.util.find_spec("imageio_ffmpeg") is None:
        raise FlagError(f"--output {path!r}: writing {suffix} needs imageio-ffmpeg (pip install imageio-ffmpeg, "
                        f"installed with this package), or use a .gif output")
    return path


def read_prompts(path: str) -> list[str]:
    """The prompts of ``--prompts-file`` (one a line, blank lines skipped).

    Raises:
        FlagError: no such file, or a file without a prompt.
    """
    if not os.path.isfile(path):
        raise FlagError(f"--prompts-file {path!r}: no such file")
    with open(path) as f:
        prompts = [line.strip() for line in f if line.strip()]
    if not prompts:
        raise FlagError(f"--prompts-file {path!r}: no prompt in it (one prompt per line)")
    return prompts


def output_path(output: str, index: int) -> str:
    """Where prompt ``index`` of a prompts file goes: ``<stem>_<iii><suffix>``."""
    stem, suffix = os.path.splitext(output)
    return f"{stem}_{index:03d}{suffix}"


def quiet_other_ranks(rank: int) -> None:
    """Logs and progress bars of Diffusers and Transformers from rank 0 only."""
    if rank != 0:
        import diffusers
        import transformers

        diffusers.utils.logging.set_verbosity_error()
        diffusers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()


def compare(out, ref, dtype: torch.dtype, show: bool, what: str = "") -> bool:
    """Compares one output with its one-process reference and prints the result if ``show`` (the rank
    that writes the output) or if it failed. Tolerance on the relative error: 1e-4 in float32, 2e-2 in
    half precision."""
    out, ref = torch.as_tensor(out).double(), torch.as_tensor(ref).double()
    max_abs = (out - ref).abs().max().item()
    rel = ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item()
    ok = rel <= (1e-4 if dtype == torch.float32 else 2e-2)
    if show or not ok:
        where = "" if show else f" (rank {launch_rank()})"
        print(f"check{where}: {what}max_abs_diff={max_abs:.3e} rel_err={rel:.3e} {'OK' if ok else 'FAILED'}",
              flush=True)
    return ok


def finish(ok: bool, group, device) -> int:
    """Shares the check's verdict (one all-reduce: failed on any rank = failed everywhere), ends the
    process groups once every rank is here, and returns the exit status."""
    from diffusers_sp.groups import destroy_process_groups

    if dist.is_initialized():
        status = torch.tensor([1.0 if ok else 0.0], device=device if group.backend == "nccl" else "cpu")
        dist.all_reduce(status, op=dist.ReduceOp.MIN)
        ok = bool(status.item())
    destroy_process_groups(barrier=True)
    return 0 if ok else 1


def one_process_note(world_size: int, script: str) -> str | None:
    """The line printed when a run has one process (plain ``python script.py``, or a launch of one):
    nothing is split, and how to start several; ``None`` with more than one process."""
    if world_size > 1:
        return None
    return (f"note: one process, so nothing is split; start several with `accelerate launch --config_file "
            f"examples/accelerate_cpu.yaml --num_processes 2 {script}` (or torchrun --nproc-per-node 2)")


@contextlib.contextmanager
def quiet_enable():
    """Inside it, ``enable_sequence_parallel`` logs no header: the ``--check`` reference re-enables VSA
    on a one-rank group after the run's own header was printed."""
    log = logging.getLogger("diffusers_sp")
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        log.setLevel(level)


def layout_line(handle) -> str:
    """The run's layout for the log: ranks in all, ``replicas x cfg x sp`` when not plain SP, and the
    ``ulysses x kv_gather`` factorisation of ``sp`` under hybrid."""
    total = handle.num_replicas * handle.cfg_degree * handle.world_size
    sp = f"sp {handle.world_size}"
    if handle.sp_mode == "hybrid":
        sp += f" = ulysses {handle.ulysses_degree} x kv_gather {handle.kv_gather_degree}"
    if handle.num_replicas == 1 and handle.cfg_degree == 1:
        return f"ranks={total} ({sp})"
    return (f"ranks={total} (replicas {handle.num_replicas} x cfg {handle.cfg_degree} x {sp})")
