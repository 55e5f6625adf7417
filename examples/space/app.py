"""A Hugging Face Space (Gradio) that generates a video with one worker process per GPU, sequence parallel.

    python examples/space/app.py                     # GPUs: one worker per GPU; no GPU: two CPU workers
    SPACE_MODEL=Wan-AI/Wan2.1-T2V-1.3B-Diffusers python examples/space/app.py --port 7860
    SPACE_MODEL=Wan-AI/Wan2.1-T2V-14B-Diffusers SPACE_SHARD_WEIGHTS=1 python examples/space/app.py   # 4 x 24 GB

At start the app spawns N worker processes (N = visible GPUs, or 2 on a machine without a GPU, or
$SPACE_NUM_WORKERS) that form one torch.distributed group (NCCL on GPUs, gloo on CPU), each loads the
pipeline ($SPACE_MODEL, default: the built-in tiny Wan pipeline with random weights) and calls
diffusers_sp.enable_sequence_parallel on it. A request from the UI goes to worker 0 through a queue;
worker 0 broadcasts it to the others, every worker runs the same pipeline call (the transformer's
tokens split across them), worker 0 reports each denoising step (shown as the UI's progress bar) and
writes the video, whose path comes back to the UI.

Workers die with the app: they are daemonic children, the app stops them on exit (SIGTERM/SIGINT
included), and on Linux each asks the kernel to end it if its parent dies (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import atexit
import os
import queue
import signal
import socket
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# In the repository (examples/space/), use the checkout's diffusers_sp when it is not installed.
_REPO = os.path.dirname(os.path.dirname(HERE))
if os.path.isdir(os.path.join(_REPO, "diffusers_sp")) and _REPO not in sys.path:
    sys.path.insert(0, _REPO)

TINY_DEFAULTS = dict(height=80, width=112, num_frames=17, steps=4)
REAL_DEFAULTS = dict(height=480, width=832, num_frames=81, steps=30)
HEARTBEAT_S = 30.0  # worker 0 broadcasts a no-op this often, so idle workers never hit the collective timeout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def worker(rank: int, world_size: int, port: int, model: str | None, mode: str, requests, events, out_dir: str,
           shard_weights: bool = False):
    """One rank: loads the pipeline, enables sequence parallelism, serves requests until ``None``.

    With ``shard_weights`` the pipeline is loaded on the CPU and enabled there, so that FSDP moves each
    block's shard to the GPU (never the whole transformer); the rest (the VAE) moves after."""
    _die_with_parent()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist

    try:
        from diffusers_sp import enable_sequence_parallel
        from diffusers_sp.groups import resolve_group

        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        group = resolve_group()
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        dtype = torch.bfloat16 if cuda else torch.float32
        import diffusers
        from diffusers import DiffusionPipeline

        diffusers.utils.logging.set_verbosity_error()
        if model is None:
            from diffusers_sp.tiny_models import default_cache_dir, save_tiny_wan_pipeline

            model = str(default_cache_dir() / "tiny-wan-t2v")
            if rank == 0:
                save_tiny_wan_pipeline(model)
            dist.barrier()
        pipe = DiffusionPipeline.from_pretrained(model, dtype=dtype)
        if not shard_weights:
            pipe.to(device)
        pipe.set_progress_bar_config(disable=True)
        handle = enable_sequence_parallel(pipe, mode=mode, shard_weights=shard_weights)
        pipe.to(device)
        if rank == 0:
            held = sum(handle.local_weight_bytes().values()) / 2**30
            events.put(("ready", dict(mode=handle.mode, world_size=handle.world_size, device=str(device),
                                      shard_weights=shard_weights, weights_gib_per_worker=round(held, 3))))
    except Exception as exc:  # noqa: BLE001 - reported to the app, which prints it and exits
        from diffusers_sp import SequenceParallelConfigError
        from diffusers_sp.groups import destroy_process_groups

        if rank == 0:
            what = str(exc) if isinstance(exc, SequenceParallelConfigError) else f"{type(exc).__name__}: {exc}"
            events.put(("error", f"worker start failed: {what}"))
        destroy_process_groups()
        if not isinstance(exc, SequenceParallelConfigError):
            raise  # an unexpected failure keeps its traceback
        sys.exit(1)

    while True:
        box = [None]
        if rank == 0:
            try:
                box[0] = requests.get(timeout=HEARTBEAT_S)
            except queue.Empty:
                box[0] = "noop"
            if os.getppid() == 1:  # the app is gone
                box[0] = None
        dist.broadcast_object_list(box, src=0)
        req = box[0]
        if req is None:
            break
        if req == "noop":
            continue
        try:
            total = int(req["steps"])

            def on_step(p, i, t, kwargs):
                if rank == 0:
                    events.put(("step", i + 1, total))
                return {}

            start = time.perf_counter()
            frames = pipe(prompt=req["prompt"], negative_prompt=req.get("negative_prompt", ""),
                          height=int(req["height"]), width=int(req["width"]), num_frames=int(req["num_frames"]),
                          num_inference_steps=total, guidance_scale=float(req.get("guidance_scale", 5.0)),
                          generator=torch.Generator("cpu").manual_seed(int(req["seed"])),
                          callback_on_step_end=on_step, output_type="np").frames[0]
            if rank == 0:
                from diffusers.utils import export_to_video

                path = os.path.join(out_dir, f"video_{int(time.time() * 1000)}.mp4")
                export_to_video(list(frames), path, fps=16)
                events.put(("done", path, time.perf_counter() - start))
        except Exception as exc:  # noqa: BLE001 - every rank fails alike; rank 0 reports
            if rank == 0:
                events.put(("error", f"{type(exc).__name__}: {exc}"))
    from diffusers_sp.groups import destroy_process_groups

    destroy_process_groups(barrier=True)  # every rank got the stop request


class Workers:
    """The worker processes and the queues to them; one request at a time."""

    def __init__(self, num_workers: int, model: str | None, mode: str = "auto", start_timeout: float = 600,
                 shard_weights: bool = False):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.requests = ctx.Queue()
        self.events = ctx.Queue()
        self.out_dir = tempfile.mkdtemp(prefix="diffusers_sp_space_")
        self.lock = threading.Lock()
        port = _free_port()
        self.procs = [ctx.Process(target=worker, args=(r, num_workers, port, model, mode, self.requests, self.events,
                                                        self.out_dir, shard_weights), daemon=True)
                      for r in range(num_workers)]
        for p in self.procs:
            p.start()
        print(f"workers: pids {' '.join(str(p.pid) for p in self.procs)}", flush=True)
        try:
            self.info = self._wait("ready", start_timeout)[1]
        except BaseException:
            self.close()  # no worker outlives a failed start
            raise
        print(f"workers ready: {self.info}", flush=True)

    def _wait(self, kind: str, timeout: float, on_step=None):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                event = self.events.get(timeout=1.0)
            except queue.Empty:
                dead = [p.pid for p in self.procs if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"worker process(es) {dead} exited")
                continue
            if event[0] == "error":
                raise RuntimeError(event[1])
            if event[0] == "step" and on_step is not None:
                on_step(event[1], event[2])
            if event[0] == kind:
                return event
        raise TimeoutError(f"no {kind!r} from the workers in {timeout} s")

    def generate(self, request: dict, on_step=None, timeout: float = 3600) -> tuple[str, float]:
        with self.lock:
            self.requests.put(request)
            _, path, seconds = self._wait("done", timeout, on_step)
        return path, seconds

    def close(self) -> None:
        if not any(p.is_alive() for p in self.procs):
            return
        self.requests.put(None)
        for p in self.procs:
            p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()


def build_ui(workers: Workers, defaults: dict):
    import gradio as gr

    def generate(prompt, negative_prompt, seed, steps, height, width, num_frames, guidance_scale,
                 progress=gr.Progress()):
        progress((0, int(steps)), desc="denoising")
        request = dict(prompt=prompt, negative_prompt=negative_prompt, seed=int(seed), steps=int(steps),
                       height=int(height), width=int(width), num_frames=int(num_frames),
                       guidance_scale=float(guidance_scale))
        try:
            path, seconds = workers.generate(request, on_step=lambda i, n: progress((i, n), desc="denoising"))
        except RuntimeError as exc:
            raise gr.Error(str(exc)) from exc
        info = workers.info
        weights = (f", weights sharded ({info['weights_gib_per_worker']} GiB per worker)" if info["shard_weights"]
                   else "")
        return path, (f"{seconds:.2f} s on {info['world_size']} {info['device'].split(':')[0]} worker(s), "
                      f"mode {info['mode']}{weights}")

    with gr.Blocks(title="diffusers-sp: sequence-parallel video generation") as demo:
        gr.Markdown("# diffusers-sp\nOne video, generated by all workers at once (sequence parallelism: "
                    "the transformer's tokens are split across the processes).")
        with gr.Row():
            with gr.Column():
                prompt = gr.Textbox(label="Prompt", value="a small red bird flies over the blue water")
                negative = gr.Textbox(label="Negative prompt", value="")
                with gr.Row():
                    seed = gr.Number(label="Seed", value=0, precision=0)
                    steps = gr.Slider(1, 100, value=defaults["steps"], step=1, label="Steps")
                    guidance = gr.Slider(1.0, 10.0, value=5.0, step=0.5, label="Guidance scale")
                with gr.Row():
                    height = gr.Slider(16, 1280, value=defaults["height"], step=16, label="Height")
                    width = gr.Slider(16, 1280, value=defaults["width"], step=16, label="Width")
                    frames = gr.Slider(1, 161, value=defaults["num_frames"], step=4, label="Frames (4k+1)")
                button = gr.Button("Generate", variant="primary")
            with gr.Column():
                video = gr.Video(label="Video")
                timing = gr.Textbox(label="Timing", interactive=False)
        button.click(generate, [prompt, negative, seed, steps, height, width, frames, guidance], [video, timing],
                     api_name="generate")
    return demo


def main(argv=None):
    parser = argparse.ArgumentParser(description="diffusers-sp Gradio Space")
    parser.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", 7860)))
    parser.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "0.0.0.0"))
    parser.add_argument("--model", default=os.environ.get("SPACE_MODEL") or None)
    parser.add_argument("--workers", type=int, default=int(os.environ.get("SPACE_NUM_WORKERS", 0)) or None)
    parser.add_argument("--mode", default=os.environ.get("SPACE_SP_MODE", "auto"),
                        choices=["auto", "ulysses", "kv_gather", "vsa"])
    parser.add_argument("--shard-weights", action="store_true",
                        default=os.environ.get("SPACE_SHARD_WEIGHTS", "").lower() in ("1", "true", "yes"),
                        help="shard the transformer and text encoder weights over the workers (FSDP2), so that "
                             "e.g. four 24 GB GPUs hold a 14B model (env SPACE_SHARD_WEIGHTS=1)")
    args = parser.parse_args(argv)
    if args.workers is not None and args.workers < 1:
        parser.error(f"--workers {args.workers}: must be at least 1")

    import torch

    num = args.workers or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    try:
        workers = Workers(num, args.model, args.mode, shard_weights=args.shard_weights)
    except (RuntimeError, TimeoutError) as exc:  # the workers' own one-line report
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
    atexit.register(workers.close)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # SystemExit runs atexit, which stops the workers
    demo = build_ui(workers, TINY_DEFAULTS if args.model is None else REAL_DEFAULTS)
    demo.queue(default_concurrency_limit=1).launch(server_name=args.host, server_port=args.port)
    workers.close()


if __name__ == "__main__":
    main()
