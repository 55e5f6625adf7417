"""Generate an image with a Diffusers image pipeline split across N processes.

    accelerate launch --config_file examples/accelerate_cpu.yaml examples/generate_image.py --check
    accelerate launch --config_file examples/accelerate_gpu.yaml --num_processes 2
        examples/generate_image.py --model black-forest-labs/FLUX.1-dev --height 1024 --width 1024
        --steps 28 --prompt "a cat on the grass" --output outputs/cat.png  (one command)
    ... --model black-forest-labs/FLUX.1-Kontext-dev --image input.png --prompt "make it snow"
    torchrun --nproc-per-node 2 examples/generate_image.py --check

Every rank runs the same pipeline call; the transformer's tokens are split across the ranks
(diffusers_sp.enable_sequence_parallel) and rank 0 writes the image. Any pipeline diffusers-sp runs
works (Flux, FluxKontext, Flux Fill, QwenImage, QwenImage Edit, SD3, ...): --image passes input images
(reference images for Kontext and Edit pipelines), --call-kwargs any other argument of the pipeline
call. With no --model, a tiny Flux pipeline built from the real config classes with random weights is
saved (safetensors) to a cache folder and loaded back through from_pretrained: it runs anywhere in
seconds and makes noise, not art.

--check: every rank then runs the same generation without sequence parallelism and compares; rank 0
prints `check: max_abs_diff=<x> rel_err=<y> OK` (or FAILED); every rank exits non-zero on failure.
A bad flag, or a setting sequence parallelism cannot run, is one line from rank 0 and a non-zero exit.
--cfg-parallel, --sp-degree and --prompts-file work as in examples/generate_video.py.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli import (ArgumentParser, FlagError, add_run_flags, check_run_flags, checked_output as _checked_output,  # noqa: E402
                 compare, finish, layout_line, one_process_note, output_path, quiet_other_ranks,
                 read_prompts, run)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
#: Size of the built-in tiny Flux pipeline's images (its VAE does not downsample): 20 x 28 tokens.
TINY_SIZE = (40, 56)


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="local folder or Hub id of a Diffusers image pipeline (default: the built-in tiny Flux)")
    p.add_argument("--prompt", default="a small red bird flies over the blue water")
    p.add_argument("--negative-prompt", default=None,
                   help="passed to pipelines that take one (true CFG for Flux and QwenImage)")
    p.add_argument("--image", action="append", default=None,
                   help="input image file (repeat for several), for Kontext, Edit, img2img and inpaint pipelines")
    p.add_argument("--mode", default="auto", choices=["auto", "ulysses", "kv_gather", "hybrid"],
                   help="sequence-parallel strategy (default: auto)")
    p.add_argument("--height", type=int, default=None, help="pixels (default: the pipeline's; 40 for the tiny model)")
    p.add_argument("--width", type=int, default=None, help="pixels (default: the pipeline's; 56 for the tiny model)")
    p.add_argument("--steps", type=int, default=4, help="denoising steps")
    p.add_argument("--guidance-scale", type=float, default=None, help="default: the pipeline's")
    p.add_argument("--output", default="outputs/image.png",
                   help="image file written by rank 0: .png, .jpg, .jpeg or .webp; a directory gets image.png inside it")
    p.add_argument("--call-kwargs", default=None,
                   help='other arguments of the pipeline call as JSON, e.g. \'{"true_cfg_scale": 4.0}\'')
    add_run_flags(p)
    args = p.parse_args(argv)
    check_run_flags(args)
    check_flags(args)
    return args


def check_flags(args) -> None:
    """Flag values that cannot run, refused before any model is loaded (:class:`FlagError`)."""
    for flag, value in (("--height", args.height), ("--width", args.width)):
        if value is not None and value <= 0:
            raise FlagError(f"{flag} {value}: must be a positive number of pixels")
    for path in args.image or ():
        if not os.path.isfile(path):
            raise FlagError(f"--image {path!r}: no such file")
    if args.call_kwargs is not None:
        try:
            extra = json.loads(args.call_kwargs)
        except json.JSONDecodeError as exc:
            raise FlagError(f"--call-kwargs: not JSON ({exc})") from None
        if not isinstance(extra, dict):
            raise FlagError("--call-kwargs: must be a JSON object of argument names and values")
        args.call_kwargs = extra
    else:
        args.call_kwargs = {}


def checked_output(path: str) -> str:
    """``--output`` as the image file to write: ``image.png`` inside a directory, ``.png`` added to a
    path without a suffix (:func:`cli.checked_output`; raises :class:`FlagError`)."""
    return _checked_output(path, IMAGE_SUFFIXES, "image.png")


def load_pipeline(model: str | None, dtype: torch.dtype, rank: int):
    from diffusers import DiffusionPipeline

    if model is None:
        from diffusers_sp.tiny_models import default_cache_dir, save_tiny_pipeline, tiny_flux_pipeline

        model = str(default_cache_dir() / "tiny-flux")
        if rank == 0:
            save_tiny_pipeline(model, tiny_flux_pipeline)
        if dist.is_initialized():
            dist.barrier()  # the others load what rank 0 wrote
    return DiffusionPipeline.from_pretrained(model, dtype=dtype)


def call_arguments(pipe, args) -> dict:
    """The pipeline call's keyword arguments from the flags, keeping those the pipeline takes.

    Raises:
        FlagError: ``--image`` or a ``--call-kwargs`` name the pipeline does not take.
    """
    from PIL import Image

    takes = inspect.signature(pipe.__call__).parameters
    call = dict(num_inference_steps=args.steps, output_type="np")
    if args.model is None:
        call.update(height=args.height or TINY_SIZE[0], width=args.width or TINY_SIZE[1])
    else:
        call.update({k: v for k, v in (("height", args.height), ("width", args.width)) if v is not None})
    if "max_area" in takes and "height" in call and "width" in call:
        # FluxKontext sizes its output from max_area (default 1024^2) and only keeps the aspect of the
        # height and width it is given: make it the size asked for.
        call["max_area"] = call["height"] * call["width"]
    if args.guidance_scale is not None:
        call["guidance_scale"] = args.guidance_scale
    if args.negative_prompt is not None and "negative_prompt" in takes:
        call["negative_prompt"] = args.negative_prompt
    if args.image:
        if "image" not in takes:
            raise FlagError(f"--image: {type(pipe).__name__} takes no input image")
        images = [Image.open(path).convert("RGB") for path in args.image]
        call["image"] = images[0] if len(images) == 1 else images
    unknown = sorted(set(args.call_kwargs) - set(takes))
    if unknown and not any(p.kind == p.VAR_KEYWORD for p in takes.values()):
        raise FlagError(f"--call-kwargs: {type(pipe).__name__} takes no {', '.join(unknown)}")
    call.update(args.call_kwargs)
    return {k: v for k, v in call.items() if k in takes or k in args.call_kwargs}


def write_image(image, path: str) -> None:
    """Writes ``image`` (``[H, W, 3]`` floats in [0, 1]) with PIL; the suffix chooses the format."""
    from diffusers.utils.pil_utils import numpy_to_pil

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    numpy_to_pil(image[None])[0].save(path)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.output = checked_output(args.output)
    prompts = read_prompts(args.prompts_file) if args.prompts_file else [args.prompt]  # before any model
    from diffusers_sp import disable_sequence_parallel, enable_sequence_parallel
    from diffusers_sp.groups import resolve_group

    group = resolve_group()  # accelerate.PartialState: NCCL on CUDA, gloo on CPU
    rank = group.rank
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // group.world_size))  # ranks share the cores
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, format="%(message)s")
    quiet_other_ranks(rank)
    log = logging.getLogger("generate_image")
    note = one_process_note(group.world_size, "examples/generate_image.py")
    if note and rank == 0:
        print(note, flush=True)

    pipe = load_pipeline(args.model, dtype, rank).to(device)
    pipe.set_progress_bar_config(disable=rank != 0)
    call = call_arguments(pipe, args)
    handle = enable_sequence_parallel(pipe, mode=args.mode, sp_degree=args.sp_degree,
                                      ulysses_degree=args.ulysses_degree,
                                      cfg_parallel={"off": False, "on": True, "auto": "auto"}[args.cfg_parallel])
    log.info("%s: mode=%s (transfers: %s) %s device=%s dtype=%s", type(pipe).__name__, handle.mode,
             handle.transport, layout_line(handle), device, dtype)

    from diffusers_sp.replicas import split_for_replica

    mine = split_for_replica(prompts, handle.replica_index, handle.num_replicas)
    made = {}
    for index, prompt in mine:
        start = time.perf_counter()
        image = pipe(prompt=prompt, **call, generator=torch.Generator("cpu").manual_seed(args.seed)).images[0]
        made[index] = image
        if handle.is_output_rank:
            path = args.output if args.prompts_file is None else output_path(args.output, index)
            write_image(image, path)
            log.info("%s%dx%d image in %.2f s -> %s", f"replica {handle.replica_index}: prompt {index}: "
                     if args.prompts_file else "", image.shape[1], image.shape[0], time.perf_counter() - start, path)

    ok = True
    if args.check:
        # Every rank makes its own one-process reference and checks its own outputs (no rank waits in a
        # collective for another's reference).
        disable_sequence_parallel(pipe)
        pipe.set_progress_bar_config(desc="--check: one-process reference", disable=rank != 0)
        for index, image in made.items():
            ref = pipe(prompt=prompts[index], **call, generator=torch.Generator("cpu").manual_seed(args.seed)).images[0]
            what = f"prompt {index} " if args.prompts_file else ""
            ok = compare(image, ref, dtype, handle.is_output_rank, what) and ok
    return finish(ok, group, device)


if __name__ == "__main__":
    run(main)
