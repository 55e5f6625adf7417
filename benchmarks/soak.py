"""Soak: launch the main job and run the test suite many times, and count every failure by exit code
and signal.

    python benchmarks/soak.py --launches 200 --suites 10 --json soak.json
    python benchmarks/soak.py --launches 20 --suites 0 --busy   # with one core kept busy (CPU load)

Launches alternate between 2 and 3 ranks: ``accelerate launch --config_file examples/accelerate_cpu.yaml
--num_processes P examples/generate_video.py --check`` (the README's main job). A launch passes when it
exits 0 and prints ``check: ... OK``; otherwise it is counted under its exit status and under every
worker exit code the launcher reported (``exitcode: -6`` is a worker killed by SIGABRT). A suite run is
``python -m pytest -q`` (the README's test command); it passes when pytest exits 0, and the signals of any
test worker that died (``terminated with signal SIG...``) are counted. The logs of failed runs are kept
next to ``--json`` (or in the working folder). Runs on CPU; on a machine with GPUs the launches still use
gloo (CUDA hidden) so that they match CI.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name if code < 0 else f"exit {code}"
    except ValueError:
        return f"exit {code}"


def launch_once(ranks: int, work: Path, env: dict, timeout: float) -> tuple[bool, list[str], str]:
    """One launch of the main job: ``(passed, failure labels, log)``."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "examples/accelerate_cpu.yaml"),
           "--num_processes", str(ranks), "--main_process_port", str(_free_port()),
           str(REPO / "examples/generate_video.py"), "--check", "--output", str(work / "video.mp4")]
    try:
        proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        return False, ["timeout"], f"{exc.stdout or ''}\n{exc.stderr or ''}"
    log = proc.stdout + proc.stderr
    labels = [f"worker {_signal_name(int(c))}" for c in re.findall(r"exitcode: (-?\d+)", log)]
    if proc.returncode != 0:
        labels.append(f"launcher {_signal_name(proc.returncode)}")
    if proc.returncode == 0 and not re.search(r"^check: .* OK$", proc.stdout, re.M):
        labels.append("no check OK line")
    return not labels, labels, log


def suite_once(args: list[str], env: dict, timeout: float) -> tuple[bool, list[str], str, str]:
    """One run of the test suite: ``(passed, failure labels, summary line, log)``."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        return False, ["timeout"], "", f"{exc.stdout or ''}\n{exc.stderr or ''}"
    log = proc.stdout + proc.stderr
    summary = next((l for l in reversed(proc.stdout.splitlines()) if " in " in l and ("passed" in l or "failed" in l)), "")
    labels = [f"worker {name}" for name in re.findall(r"terminated with signal (SIG[A-Z]+)", log)]
    if proc.returncode != 0:
        labels.append(f"pytest {_signal_name(proc.returncode)}")
    return not labels, labels, summary, log


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--launches", type=int, default=200, help="main-job launches (alternating 2 and 3 ranks)")
    p.add_argument("--suites", type=int, default=10, help="full runs of the test suite")
    p.add_argument("--pytest-args", default="", help="arguments for pytest instead of the whole suite")
    p.add_argument("--busy", action="store_true", help="keep one core busy meanwhile (CPU load)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one run may take")
    p.add_argument("--suites-first", action="store_true", help="run the suites before the launches")
    p.add_argument("--json", default=None, help="write the counts here (rewritten after every run, so a soak cut "
                                                    "short keeps what it counted)")
    args = p.parse_args(argv)

    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", DIFFUSERS_SP_TIMEOUT_S=os.environ.get("DIFFUSERS_SP_TIMEOUT_S", "120"))
    logs = Path(args.json).resolve().parent if args.json else Path.cwd()
    counts = collections.Counter()
    failures = []
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    started = time.time()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()

    def report(done: bool) -> dict:
        result = dict(date_utc=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
                      command=" ".join([os.path.basename(sys.executable), *sys.argv]), cpus=os.cpu_count(),
                      busy=args.busy, hours=round((time.time() - started) / 3600, 2), finished=done,
                      counts=dict(sorted(counts.items())), failures=failures, commit=commit)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        return result

    def launches(tmp: str):
        for i in range(args.launches):
            ranks = 2 + i % 2
            ok, labels, log = launch_once(ranks, Path(tmp), env, args.timeout)
            counts[f"launch P{ranks} {'passed' if ok else 'failed'}"] += 1
            for label in labels:
                counts[f"launch: {label}"] += 1
            if not ok:
                path = logs / f"soak_launch_{i:03d}.log"
                path.write_text(log)
                failures.append(dict(run=f"launch {i} (P={ranks})", labels=labels, log=str(path)))
            print(f"launch {i + 1}/{args.launches} P={ranks}: {'ok' if ok else 'FAILED ' + ', '.join(labels)}",
                  flush=True)
            report(False)

    def suites():
        for i in range(args.suites):
            ok, labels, summary, log = suite_once(args.pytest_args.split(), env, args.timeout)
            counts[f"suite {'passed' if ok else 'failed'}"] += 1
            for label in labels:
                counts[f"suite: {label}"] += 1
            if not ok:
                path = logs / f"soak_suite_{i:02d}.log"
                path.write_text(log)
                failures.append(dict(run=f"suite {i}", labels=labels, log=str(path), summary=summary))
            print(f"suite {i + 1}/{args.suites}: {summary or '?'} {'ok' if ok else 'FAILED ' + ', '.join(labels)}",
                  flush=True)
            report(False)

    try:
        with tempfile.TemporaryDirectory() as tmp:
            env["DIFFUSERS_SP_CACHE"] = str(Path(tmp) / "cache")
            if args.suites_first:
                suites()
            launches(tmp)
            if not args.suites_first:
                suites()
    finally:
        if busy is not None:
            busy.kill()
    print(json.dumps(report(True), indent=1))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
