"""The Hub Space app (examples/space/app.py) on CPU: started in a subprocess (two CPU workers on the
tiny default pipeline), driven through gradio_client; one request returns a video file. Afterwards
the app and its workers are gone (no orphan processes)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
gradio_client = pytest.importorskip("gradio_client")
pytest.importorskip("gradio")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


@pytest.mark.timeout(180)
@pytest.mark.parametrize("shard", ["0", "1"], ids=["replicated", "shard_weights"])
def test_space_returns_a_video(tmp_path, shard):
    """The app on two CPU workers returns a video; with SPACE_SHARD_WEIGHTS=1 the workers hold their
    weights sharded and say so."""
    port = _free_port()
    env = dict(os.environ, DIFFUSERS_SP_CACHE=str(tmp_path / "cache"), GRADIO_ANALYTICS_ENABLED="False",
               DIFFUSERS_SP_TIMEOUT_S="120", PYTHONUNBUFFERED="1", SPACE_NUM_WORKERS="2", SPACE_SHARD_WEIGHTS=shard)
    env.pop("SPACE_MODEL", None)
    log = open(tmp_path / "app.log", "w+")
    proc = subprocess.Popen([sys.executable, str(ROOT / "examples/space/app.py"), "--port", str(port),
                             "--host", "127.0.0.1"], cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    worker_pids = []
    try:
        deadline = time.monotonic() + 150
        client = None
        while client is None:
            assert proc.poll() is None, (tmp_path / "app.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (tmp_path / "app.log").read_text()[-3000:]
            text = (tmp_path / "app.log").read_text()
            if not worker_pids and "workers: pids" in text:
                worker_pids = [int(p) for p in text.split("workers: pids", 1)[1].splitlines()[0].split()]
            if "workers ready" in text:
                try:
                    client = gradio_client.Client(f"http://127.0.0.1:{port}/", verbose=False)
                except Exception:  # server not up yet
                    time.sleep(1)
            else:
                time.sleep(1)
        result = client.predict("a cat runs on the grass", "", 0, 2, 80, 112, 17, 5.0, api_name="/generate")
        video, timing = result
        path = video["video"] if isinstance(video, dict) else video
        assert path and Path(path).exists() and Path(path).stat().st_size > 0, result
        assert Path(path).suffix == ".mp4"
        assert "2 cpu worker(s)" in timing, timing
        assert ("weights sharded" in timing) == (shard == "1"), timing
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # the app stops its workers on SIGTERM
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the server's own process group only
                proc.wait()
        log.close()
    assert worker_pids, (tmp_path / "app.log").read_text()[-3000:]
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in worker_pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(_alive(p) for p in worker_pids), f"orphan workers: {worker_pids}"
