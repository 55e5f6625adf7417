"""The main job as a user starts it: accelerate launch with the CPU config, --check must print OK."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path, *extra):
    env = dict(os.environ, DIFFUSERS_SP_CACHE=str(tmp_path / "cache"), DIFFUSERS_SP_TIMEOUT_S="120")
    out = tmp_path / "video.mp4"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "examples/accelerate_cpu.yaml"), "--main_process_port", str(_free_port()), *extra[:2], str(ROOT / "examples/generate_video.py"),
           "--check", "--output", str(out), *extra[2:]]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    return proc, out


@pytest.mark.parametrize("extra", [(), ("--num_processes", "3", "--mode", "vsa")], ids=["P2-auto", "P3-vsa"])
def test_generate_video_check_ok(tmp_path, extra):
    proc, out = _launch(tmp_path, *extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [l for l in proc.stdout.splitlines() if l.startswith("check:")]
    assert len(lines) == 1 and lines[0].endswith(" OK"), proc.stdout[-3000:]
    assert out.exists() and out.stat().st_size > 0
    expected_ranks = "3" if extra else "2"
    assert f"world_size={expected_ranks}" in proc.stdout + proc.stderr


def test_generate_video_too_few_tokens_fails_on_every_rank(tmp_path):
    """A 16x16, 1-frame video has 1 token for 2 ranks: every rank raises in the forward, the run ends
    (no hang) and exits non-zero, and no video is written."""
    proc, out = _launch(tmp_path, "--num_processes", "2", "--height", "16", "--width", "16", "--num-frames", "1")
    assert proc.returncode != 0
    text = proc.stderr + proc.stdout
    assert text.count("SequenceParallelConfigError: cannot split a sequence of 1 tokens over 2 ranks") >= 2, text[-3000:]
    assert not out.exists()

