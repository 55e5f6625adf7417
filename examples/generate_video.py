"""Generate a video with a Diffusers Wan pipeline split across N processes (the main job).

    accelerate launch --config_file examples/accelerate_cpu.yaml examples/generate_video.py --check
    accelerate launch --config_file examples/accelerate_gpu.yaml --num_processes 2
        examples/generate_video.py --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers --height 480 --width 832
        --num-frames 81 --steps 50 --mode auto --output outputs/wan.mp4  (one command)
    torchrun --nproc-per-node 2 examples/generate_video.py --check

Every rank runs the same pipeline call; the transformer's tokens are split across the ranks
(diffusers_sp.enable_sequence_parallel) and rank 0 writes the video. With no --model, a tiny Wan
pipeline built from the real config classes with random weights is saved (safetensors) to a cache
folder and loaded back through from_pretrained: it runs anywhere in seconds and makes noise, not art.

--check: every rank then runs the same generation without sequence parallelism and compares; rank 0
prints `check: max_abs_diff=<x> rel_err=<y> OK` (or FAILED); every rank exits non-zero on failure.
A bad flag, or a setting sequence parallelism cannot run, is one line from rank 0 and a non-zero exit.

--cfg-parallel on|auto splits the ranks into two CFG groups (conditional / unconditional pass),
--sp-degree N sets the ranks per sequence-parallel group (the rest form replicas), --parallel-vae
shares the VAE's decode tiles over the ranks of a replica. --prompts-file FILE (one prompt a line)
spreads the prompts over the replicas; prompt i is written once, to <output stem>_<iii><suffix>
(e.g. outputs/video_000.mp4), by its replica's first rank; with --check each is compared with one process.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli import (ArgumentParser, FlagError, add_run_flags, check_run_flags, checked_output as _checked_output,  # noqa: E402
                 compare, finish, layout_line, one_process_note, output_path, quiet_enable, quiet_other_ranks,
                 read_prompts, run)

# Diffusers' export_to_video always encodes H.264 (libx264), which these containers take; WebM does
# not (it wants VP8/VP9/AV1), so .webm is not offered.
VIDEO_SUFFIXES = (".mp4", ".gif", ".mov", ".mkv", ".avi")


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="local folder or Hub id of a Wan Diffusers pipeline (default: the built-in tiny Wan)")
    p.add_argument("--prompt", default="a small red bird flies over the blue water")
    p.add_argument("--negative-prompt", default="")
    p.add_argument("--mode", default="auto", choices=["auto", "ulysses", "kv_gather", "vsa", "hybrid"],
                   help="sequence-parallel strategy (default: auto)")
    p.add_argument("--height", type=int, default=80, help="pixels (multiple of 16); default fits the tiny model")
    p.add_argument("--width", type=int, default=112, help="pixels (multiple of 16)")
    p.add_argument("--num-frames", type=int, default=17, help="frames, 4k+1")
    p.add_argument("--steps", type=int, default=4, help="denoising steps")
    p.add_argument("--guidance-scale", type=float, default=5.0)
    p.add_argument("--fps", type=int, default=16)
    p.add_argument("--output", default="outputs/video.mp4",
                   help="video file written by rank 0: .mp4, .mov, .mkv, .avi (H.264 through imageio-ffmpeg) or "
                        ".gif; a directory gets video.mp4 inside it")
    p.add_argument("--vsa-sparsity", type=float, default=0.9,
                   help="with --mode vsa: fraction of key tiles each query tile skips (default 0.9)")
    p.add_argument("--parallel-vae", action="store_true", help="share the VAE decode tiles over the ranks")
    add_run_flags(p)
    args = p.parse_args(argv)
    check_run_flags(args)
    check_flags(args)
    return args


def check_flags(args) -> None:
    """Flag values that cannot run, refused before any model is loaded (:class:`FlagError`)."""
    if not 0.0 <= args.vsa_sparsity < 1.0:
        raise FlagError(f"--vsa-sparsity {args.vsa_sparsity}: must be in [0, 1) (the fraction of key tiles skipped)")
    for flag, value, multiple in (("--height", args.height, 16), ("--width", args.width, 16)):
        if value <= 0 or value % multiple:
            raise FlagError(f"{flag} {value}: must be a positive multiple of {multiple} pixels")
    if args.num_frames < 1 or (args.num_frames - 1) % 4:
        raise FlagError(f"--num-frames {args.num_frames}: must be 4k+1 (1, 5, 9, ...)")
    if args.fps < 1:
        raise FlagError(f"--fps {args.fps}: must be at least 1")


def write_video(frames, path: str, fps: int) -> None:
    """Writes ``frames`` (``[F, H, W, 3]`` floats in [0, 1]) with Diffusers' exporters: GIF for ``.gif``,
    else ``export_to_video`` (imageio + ffmpeg, e.g. ``.mp4``)."""
    from diffusers.utils import export_to_gif, export_to_video
    from diffusers.utils.pil_utils import numpy_to_pil

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if path.lower().endswith(".gif"):
        export_to_gif(numpy_to_pil(frames), path, fps=fps)
    else:
        export_to_video(list(frames), path, fps=fps)


def load_pipeline(model: str | None, dtype: torch.dtype, rank: int):
    from diffusers import DiffusionPipeline

    if model is None:
        from diffusers_sp.tiny_models import default_cache_dir, save_tiny_wan_pipeline

        model = str(default_cache_dir() / "tiny-wan-t2v")
        if rank == 0:
            save_tiny_wan_pipeline(model)
        if dist.is_initialized():
            dist.barrier()  # the others load what rank 0 wrote
    return DiffusionPipeline.from_pretrained(model, dtype=dtype)


def checked_output(path: str) -> str:
    """``--output`` as the video file to write: ``video.mp4`` inside a directory, ``.mp4`` added to a
    path without a suffix (:func:`cli.checked_output`; raises :class:`FlagError`)."""
    return _checked_output(path, VIDEO_SUFFIXES, "video.mp4", needs_ffmpeg=VIDEO_SUFFIXES[:1] + VIDEO_SUFFIXES[2:])


def main(argv=None) -> int:
    args = parse_args(argv)
    args.output = checked_output(args.output)
    prompts = read_prompts(args.prompts_file) if args.prompts_file else None  # before any model is loaded
    from diffusers_sp import enable_sequence_parallel
    from diffusers_sp.groups import resolve_group

    group = resolve_group()  # accelerate.PartialState: NCCL on CUDA, gloo on CPU
    rank = group.rank
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if device.type == "cpu":
        # Ranks share the machine's cores.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // group.world_size))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, format="%(message)s")
    quiet_other_ranks(rank)
    log = logging.getLogger("generate_video")
    note = one_process_note(group.world_size, "examples/generate_video.py")
    if note and rank == 0:
        print(note, flush=True)

    pipe = load_pipeline(args.model, dtype, rank).to(device)
    pipe.set_progress_bar_config(disable=rank != 0)
    vsa_options = {"vsa_sparsity": args.vsa_sparsity} if args.mode == "vsa" else {}
    handle = enable_sequence_parallel(pipe, mode=args.mode, sp_degree=args.sp_degree,
                                      ulysses_degree=args.ulysses_degree, parallel_vae=args.parallel_vae,
                                      cfg_parallel={"off": False, "on": True, "auto": "auto"}[args.cfg_parallel],
                                      **vsa_options)
    # --check compares with one process. For VSA that is single-process VSA (sparse attention is not
    # dense attention): the checking rank re-enables VSA on a one-rank group. new_group is collective,
    # so every rank creates every one-rank group.
    solo_groups = ([dist.new_group([r]) for r in range(dist.get_world_size())]
                   if args.check and args.mode == "vsa" and dist.is_initialized() else None)
    log.info("%s: mode=%s (sp_mode=%s, transfers: %s) %s device=%s dtype=%s", type(pipe).__name__,
             handle.mode, handle.sp_mode, handle.transport, layout_line(handle), device, dtype)
    if prompts is not None:
        return _run_prompts_file(args, prompts, pipe, handle, group, device, dtype, log, solo_groups)

    call = dict(prompt=args.prompt, negative_prompt=args.negative_prompt, height=args.height, width=args.width,
                num_frames=args.num_frames, num_inference_steps=args.steps, guidance_scale=args.guidance_scale,
                output_type="np")
    start = time.perf_counter()
    frames = pipe(**call, generator=torch.Generator("cpu").manual_seed(args.seed)).frames[0]
    log.info("generated %d frames of %dx%d in %.2f s", len(frames), args.width, args.height, time.perf_counter() - start)

    if rank == 0:
        write_video(frames, args.output, args.fps)
        log.info("wrote %s", args.output)

    ok = True
    if args.check:
        # Every rank makes its own one-process reference and checks its own output, so no rank waits
        # in a collective for the whole reference (which could outlast the collective timeout).
        _single_process(pipe, args, solo_groups)
        ref = pipe(**call, generator=torch.Generator("cpu").manual_seed(args.seed)).frames[0]
        ok = compare(frames, ref, dtype, rank == 0)
    return finish(ok, group, device)


def _single_process(pipe, args, solo_groups) -> None:
    """Turns ``pipe`` into its one-process reference: no sequence parallelism (VSA on a one-rank
    group for ``--mode vsa``), and the VAE's tiled decode when ``--parallel-vae`` was on."""
    from diffusers_sp import disable_sequence_parallel, enable_sequence_parallel

    disable_sequence_parallel(pipe)
    if args.mode == "vsa":
        solo = solo_groups[dist.get_rank()] if solo_groups else None
        with quiet_enable():  # the run's header is printed already
            enable_sequence_parallel(pipe, mode="vsa", process_group=solo, vsa_sparsity=args.vsa_sparsity)
    if args.parallel_vae:  # the parallel decode equals the single-process *tiled* decode
        pipe.vae.enable_tiling()
    # Every rank makes its reference; the bar shows on rank 0 only, as for the generation.
    pipe.set_progress_bar_config(desc="--check: one-process reference",
                                 disable=dist.is_initialized() and dist.get_rank() != 0)


def _run_prompts_file(args, prompts, pipe, handle, group, device, dtype, log, solo_groups) -> int:
    """Prompt i goes to replica i mod num_replicas; that replica's output rank writes it once."""
    from diffusers_sp.replicas import split_for_replica

    mine = split_for_replica(prompts, handle.replica_index, handle.num_replicas)
    call = dict(negative_prompt=args.negative_prompt, height=args.height, width=args.width,
                num_frames=args.num_frames, num_inference_steps=args.steps, guidance_scale=args.guidance_scale,
                output_type="np")
    made = {}
    for index, prompt in mine:
        start = time.perf_counter()
        frames = pipe(prompt=prompt, **call, generator=torch.Generator("cpu").manual_seed(args.seed)).frames[0]
        made[index] = frames if args.check else None
        if handle.is_output_rank:
            path = output_path(args.output, index)
            write_video(frames, path, args.fps)
            print(f"replica {handle.replica_index}: prompt {index} -> {path} ({time.perf_counter() - start:.2f} s)",
                  flush=True)
    ok = True
    if args.check:  # every rank checks its own outputs (see main)
        _single_process(pipe, args, solo_groups)
        for index, frames in made.items():
            ref = pipe(prompt=prompts[index], **call, generator=torch.Generator("cpu").manual_seed(args.seed)).frames[0]
            ok = compare(frames, ref, dtype, handle.is_output_rank, f"prompt {index} ") and ok
    return finish(ok, group, device)


if __name__ == "__main__":
    run(main)
