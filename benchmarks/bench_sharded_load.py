"""Peak host memory per rank of loading a pipeline: whole on every rank (``from_pretrained``) against
loaded for weight sharding (``load_pipeline_for_sharding`` + ``enable_sequence_parallel(...,
shard_weights=True)``). CPU, gloo; one launch per world size and mode, so each peak is its own.

    python benchmarks/bench_sharded_load.py --world-sizes 2 3 --json sharded_load.json

A Wan pipeline with a transformer of about 150 M parameters (16 blocks of width 768, float32, 0.6 GB)
and the tiny text encoder is saved once with ``save_pretrained``; each rank reports the growth of its
peak resident set (``ru_maxrss``) from just before loading to after enabling and reading every
parameter once (``from_pretrained`` memory-maps the files, so untouched weights are not resident yet;
a forward touches them all), and the bytes of parameters it then holds (``handle.local_weight_bytes()``).
Pages of a file mapped by several ranks are shared in the page cache while untouched by a copy; a
dtype cast at load or a copy to the GPU makes them private.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

#: The transformer: Wan's classes, 16 blocks of 12 heads x 64, feed-forward 3072.
SIZE = dict(num_layers=16, num_attention_heads=12, attention_head_dim=64, ffn_dim=3072)


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rank_main(folder: str, mode: str, out: str) -> None:
    """One rank: load the saved pipeline in ``mode`` and write its memory figures to ``out``."""
    import torch
    from diffusers import WanPipeline

    from diffusers_sp import enable_sequence_parallel, load_pipeline_for_sharding
    from diffusers_sp.groups import destroy_process_groups, resolve_group

    group = resolve_group()
    torch.set_num_threads(1)
    before = _peak_mib()
    if mode == "replicated":
        pipe = WanPipeline.from_pretrained(folder, dtype=torch.float32)
        handle = enable_sequence_parallel(pipe)
    else:
        pipe = load_pipeline_for_sharding(WanPipeline, folder, dtype=torch.float32)
        handle = enable_sequence_parallel(pipe, shard_weights=True)
    with torch.no_grad():  # read every parameter once, as a forward does: memory-mapped pages become resident
        for module in (pipe.transformer, pipe.text_encoder):
            for p in module.parameters():
                (p.to_local() if hasattr(p, "to_local") else p).sum()
    grown = _peak_mib() - before
    held = handle.local_weight_bytes()
    handle.disable() if mode == "replicated" else None
    with open(f"{out}.{group.rank}", "w") as f:
        json.dump({"rank": group.rank, "peak_growth_mib": round(grown, 1),
                   "held_mib": {k: round(v / 2**20, 1) for k, v in held.items()}}, f)
    destroy_process_groups(barrier=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args(argv)
    from diffusers_sp.tiny_models import tiny_wan_pipeline

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "wan")
        tiny_wan_pipeline("t2v", **SIZE).save_pretrained(folder)
        for world in args.world_sizes:
            for mode in ("replicated", "sharded"):
                out = os.path.join(tmp, f"{mode}{world}")
                subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
                                "--master-port", str(29400 + world), __file__, "--rank-main", folder, mode, out],
                               check=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                ranks = [json.load(open(f"{out}.{r}")) for r in range(world)]
                results.append({"world_size": world, "mode": mode, "ranks": ranks})
                print(f"P={world} {mode:10s} peak RSS growth per rank (MiB): "
                      f"{[r['peak_growth_mib'] for r in ranks]}  weights held: {ranks[0]['held_mib']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-main":
        rank_main(*sys.argv[2:5])
    else:
        main()
