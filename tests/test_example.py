"""The main job as a user starts it: accelerate launch with the CPU config, --check must print OK."""

from __future__ import annotations

import os
import re
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


@pytest.mark.parametrize("extra", [(), ("--num_processes", "3", "--mode", "vsa"),
                                   ("--num_processes", "2", "--height", "16", "--width", "16", "--num-frames", "1")],
                         ids=["P2-auto", "P3-vsa", "P2-one-token"])
def test_generate_video_check_ok(tmp_path, extra):
    """The main job equals one process: by default, with VSA at 3 ranks, and with a 16 x 16 one-frame video
    whose single token is fewer than the ranks (the transformer's forward then runs whole on each rank)."""
    proc, out = _launch(tmp_path, *extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [l for l in proc.stdout.splitlines() if l.startswith("check:")]
    assert len(lines) == 1 and lines[0].endswith(" OK"), proc.stdout[-3000:]
    assert out.exists() and out.stat().st_size > 0
    expected_ranks = extra[1] if extra else "2"
    assert f"ranks={expected_ranks} (sp {expected_ranks})" in proc.stdout + proc.stderr
    assert "transfers: gloo" in proc.stdout + proc.stderr  # the backend that runs, not "nccl"
    # One header: the --check reference (VSA on a one-rank group) does not log a second "sp 1" one.
    assert (proc.stdout + proc.stderr).count("diffusers-sp: ") == 1, proc.stderr[-3000:]
    assert "note: one process" not in proc.stdout


def test_main_job_prints_no_import_noise(tmp_path):
    """The main job (here at 2 ranks) prints none of the torchao/pytree/Diffusers import warnings, on
    any rank, whether or not torchao is installed."""
    proc, _ = _launch(tmp_path, "--num_processes", "2", "--num-frames", "1", "--steps", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    noisy = [l for l in (proc.stdout + proc.stderr).splitlines() if any(n in l for n in _IMPORT_NOISE)]
    assert not noisy, noisy


def test_plain_python_says_nothing_is_split(tmp_path):
    """``python examples/generate_video.py --check`` (no launcher) runs one process, passes its check
    and says in one line that nothing was split and how to start several processes."""
    env = dict(os.environ, DIFFUSERS_SP_CACHE=str(tmp_path / "cache"))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, str(ROOT / "examples/generate_video.py"), "--check", "--num-frames", "1",
                           "--steps", "1", "--output", str(tmp_path / "v.mp4")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    notes = [l for l in proc.stdout.splitlines() if l.startswith("note: one process")]
    assert len(notes) == 1 and "accelerate launch" in notes[0], proc.stdout[-2000:]


#: A line this project prints for an expected error: ``error: ...`` (a refused setting) or
#: ``<script>: error: ...`` (a bad flag), from rank 0 only (examples/cli.py). The launcher's failure
#: summary and libraries' log lines never start so, whatever their format.
_OUR_ERROR = re.compile(r"^(\S+\.py: )?error: ")


def _our_errors(*texts: str) -> list[str]:
    """The expected-error lines the ranks printed (:data:`_OUR_ERROR`), from all ``texts``."""
    return [l for t in texts for l in t.splitlines() if _OUR_ERROR.match(l)]


#: What importing Diffusers prints when torchao (in the ``test`` extra) has no compiled extensions for
#: this torch, and Transformers' torchvision note; ``diffusers_sp.import_noise`` drops them (see
#: :func:`test_main_job_prints_no_import_noise`).
_IMPORT_NOISE = ("Failed to load ", "torchao", "_pytree.py", "is an Enum subclass", "requires torchvision")


def test_generate_video_too_few_tiles_is_one_line(tmp_path):
    """VSA over a 16x16, 1-frame video has 1 tile for 3 ranks: every rank raises in the forward, alike;
    rank 0 prints the error as one line, the others stay quiet, the run ends (no hang) non-zero, and no
    video is written."""
    proc, out = _launch(tmp_path, "--num_processes", "3", "--mode", "vsa", "--height", "16", "--width", "16",
                        "--num-frames", "1")
    assert proc.returncode != 0
    errors = _our_errors(proc.stdout, proc.stderr)
    assert len(errors) == 1 and errors[0].startswith("error: VSA: the latent grid (1, 1, 1)"), \
        proc.stderr[-3000:]
    assert "generate_video.py\", line" not in proc.stderr, "a rank printed a traceback"
    assert not out.exists()


@pytest.mark.parametrize("flags,expected", [
    (["--vsa-sparsity", "1.5"], "generate_video.py: error: --vsa-sparsity 1.5: must be in [0, 1)"),
    (["--mode", "ring"], "generate_video.py: error: argument --mode: invalid choice: 'ring'"),
], ids=["value", "choice"])
def test_generate_video_bad_flag_is_one_line_from_rank0(tmp_path, flags, expected):
    proc, out = _launch(tmp_path, "--num_processes", "2", *flags)
    assert proc.returncode != 0
    ours = _our_errors(proc.stdout, proc.stderr)
    assert len(ours) == 1 and ours[0].startswith(expected), (ours, proc.stderr[-2000:])
    assert "generate_video.py\", line" not in proc.stderr, "a rank printed a traceback"


def test_generate_video_help_printed_once(tmp_path):
    proc, _ = _launch(tmp_path, "--num_processes", "2", "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("usage: generate_video.py") == 1, proc.stdout[-2000:]


def _launch_image(tmp_path, *args, processes="2"):
    env = dict(os.environ, DIFFUSERS_SP_CACHE=str(tmp_path / "cache"), DIFFUSERS_SP_TIMEOUT_S="120")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "examples/accelerate_cpu.yaml"),
           "--main_process_port", str(_free_port()), "--num_processes", processes,
           str(ROOT / "examples/generate_image.py"), "--check", *args]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def test_generate_image_check_ok(tmp_path):
    """The image job on its built-in tiny Flux at 2 ranks; --output a folder gets image.png inside."""
    proc = _launch_image(tmp_path, "--output", str(tmp_path / "out") + "/")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [l for l in proc.stdout.splitlines() if l.startswith("check:")]
    assert len(lines) == 1 and lines[0].endswith(" OK"), proc.stdout[-3000:]
    assert (tmp_path / "out" / "image.png").stat().st_size > 0
    assert "FluxPipeline: mode=kv_gather" in proc.stdout + proc.stderr


def test_generate_image_kontext_with_reference_image(tmp_path):
    """A FluxKontext pipeline (saved from tiny Flux components) with an input image at 3 ranks: the
    reference image's tokens join the image tokens (560 + 192, not divisible by 3) and the result
    equals one process."""
    from diffusers import FluxKontextPipeline

    from diffusers_sp.tiny_models import tiny_flux_pipeline

    FluxKontextPipeline(**tiny_flux_pipeline().components).save_pretrained(tmp_path / "kontext")
    from PIL import Image

    Image.new("RGB", (32, 24), (200, 30, 30)).save(tmp_path / "in.png")
    proc = _launch_image(tmp_path, "--model", str(tmp_path / "kontext"), "--image", str(tmp_path / "in.png"),
                         "--height", "40", "--width", "56", "--call-kwargs", '{"_auto_resize": false}',
                         "--output", str(tmp_path / "k.png"), processes="3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [l for l in proc.stdout.splitlines() if l.startswith("check:")][0].endswith(" OK")
    assert "FluxKontextPipeline" in proc.stdout + proc.stderr and (tmp_path / "k.png").exists()
