#!/usr/bin/env python
"""Speedup plot and table from the JSON files of ``bench_transformer.py``.

Reads every ``bench_transformer.py`` JSON in ``--results`` (default ``benchmarks/results/``; other
JSON files there are skipped) and, per GPU kind (``meta.device``), shape (``case``) and number of
GPUs, takes one run: the one holding the most of the plotted rows, the newest of those. Every
speedup is a same-run ratio against that run's ``stock (native)`` row (the unmodified Diffusers model
on one GPU), as the benchmark reports it. One GPU is the stock model itself (1.0x).

Writes, per GPU kind, a PNG with three panels: speedup against the number of GPUs for each shape
(with the ideal line), and every plotted row at the largest number of GPUs measured, diffusers-sp
beside Diffusers' own context parallelism. ``--table`` prints the same figures as a Markdown table
(the README's speed table), with the run each column comes from.

    python benchmarks/plot_speedup.py                      # writes docs/speedup.png
    python benchmarks/plot_speedup.py --table --no-plot    # the Markdown table only (no matplotlib)

Needs matplotlib for the PNG (``pip install -e ".[bench]"``). With more than one GPU kind in the
results, each kind gets its own file: ``speedup_<kind>.png`` beside ``--out``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: Rows plotted, in order: (row name in the JSON, label in the plot and table).
ROWS = (
    ("ours kv_gather", "diffusers-sp K/V-gather"),
    ("ours ulysses", "diffusers-sp Ulysses"),
    ("ours vsa", "diffusers-sp VSA (sparsity 0.9)"),
    ("diffusers ulysses (cudnn)", "Diffusers CP Ulysses (cuDNN)"),
    ("diffusers ring (cudnn)", "Diffusers CP ring (cuDNN)"),
    ("diffusers ulysses (native)", "Diffusers CP Ulysses (default backend)"),
)
STOCK = "stock (native)"
CASE_LABELS = {"1.3b": "Wan2.1 1.3B, 480x832x81 (32760 tokens)",
               "14b": "Wan2.1 14B (4 of 40 blocks), 1280x720x81"}


@dataclass
class Run:
    """One ``bench_transformer.py`` JSON, reduced to what the plot needs.

    ``ms`` maps a row name to its ms per step (ok rows only); ``speedup`` to its same-run ratio
    against :data:`STOCK`.
    """

    path: Path
    device: str
    world_size: int
    case: str
    date: str
    commit: str
    ms: dict
    speedup: dict


def load_runs(results: Path) -> list[Run]:
    """Every (file, case) of ``bench_transformer.py`` output under ``results``.

    Files of other scripts (lists, or rows without a ``speedup`` field) are skipped, and so is a case
    without an ok stock row. Raises ``FileNotFoundError`` if ``results`` is not a directory.
    """
    if not results.is_dir():
        raise FileNotFoundError(f"{results} is not a directory of benchmark JSON files")
    runs = []
    for path in sorted(results.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        rows = data.get("rows") if isinstance(data, dict) else None
        meta = data.get("meta", {}) if isinstance(data, dict) else {}
        if not rows or not all(isinstance(r, dict) and "speedup" in r and "case" in r for r in rows):
            continue
        for case in sorted({r["case"] for r in rows}):
            ok = {r["mode"]: r for r in rows if r["case"] == case and r.get("status") == "ok" and r.get("ms")}
            if STOCK not in ok:
                continue
            ranks = max(int(r.get("ranks") or 1) for r in ok.values())
            runs.append(Run(path=path, device=meta.get("device", "unknown GPU"), world_size=ranks, case=case,
                            date=meta.get("date_utc", ""),
                            commit=(meta.get("git_commit") or "?")[:7] + (" with local changes" if meta.get("git_dirty") else ""),
                            ms={m: r["ms"] for m, r in ok.items()},
                            speedup={m: ok[STOCK]["ms"] / r["ms"] for m, r in ok.items()}))
    return runs


def select(runs: list[Run]) -> dict:
    """``{device: {case: {world_size: Run}}}`` for world sizes above 1: per key the run holding the
    most plotted rows, the newest among those."""
    wanted = [name for name, _ in ROWS]
    best: dict = {}
    for run in runs:
        if run.world_size < 2:
            continue
        score = (sum(name in run.ms for name in wanted), run.date)
        if score[0] == 0:
            continue
        slot = best.setdefault(run.device, {}).setdefault(run.case, {})
        old = slot.get(run.world_size)
        if old is None or score > (sum(name in old.ms for name in wanted), old.date):
            slot[run.world_size] = run
    return best


def markdown_table(device: str, by_case: dict) -> str:
    """The speed table of one GPU kind: ms per step and speedup of every plotted row, one column per
    (shape, number of GPUs), and the run each column comes from."""
    cols = [(case, ws, by_case[case][ws]) for case in sorted(by_case) for ws in sorted(by_case[case])]
    head = ["row"] + [f"{case.upper()} shape, {ws} GPUs" for case, ws, _ in cols]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * len(cols) + "|"]
    stock = ["stock Diffusers, 1 GPU"] + [f"{run.ms[STOCK]:.1f} ms" for _, _, run in cols]
    lines.append("| " + " | ".join(stock) + " |")
    for name, label in ROWS:
        cells = [f"{run.ms[name]:.1f} ms ({run.speedup[name]:.2f}x)" if name in run.ms else "—"
                 for _, _, run in cols]
        if any(c != "—" for c in cells):
            lines.append("| " + " | ".join([label] + cells) + " |")
    sources = "; ".join(f"{case} x{ws}: `{run.path.name}` ({run.date}, git {run.commit})"
                        for case, ws, run in cols)
    return f"{device}, ms per transformer step (bf16):\n\n" + "\n".join(lines) + f"\n\nRuns: {sources}.\n"


def plot(device: str, by_case: dict, out: Path) -> Path:
    """Writes the PNG of one GPU kind to ``out`` and returns the path. Needs matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted(by_case)
    fig, axes = plt.subplots(1, len(cases) + 1, figsize=(5.0 * len(cases) + 7.0, 4.8),
                             gridspec_kw={"width_ratios": [1.0] * len(cases) + [1.5]}, layout="constrained")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, case in zip(axes, cases):
        sizes = sorted(by_case[case])
        top = max(sizes)
        ax.plot([1, top], [1, top], ls="--", color="0.6", label="ideal (linear)")
        for i, (name, label) in enumerate(ROWS):
            pts = [(ws, by_case[case][ws].speedup[name]) for ws in sizes if name in by_case[case][ws].speedup]
            if not pts:
                continue
            xs, ys = zip(*([(1, 1.0)] + pts))
            style = "-" if name.startswith("ours") else ":"
            ax.plot(xs, ys, style, marker="o", color=colors[i % len(colors)], label=label)
        ax.set_title(CASE_LABELS.get(case, case), fontsize=9)
        ax.set_xlabel("GPUs")
        ax.set_ylabel("speedup over stock Diffusers on 1 GPU")
        ax.set_xticks([1] + sizes)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="upper left")

    ax = axes[-1]
    labels, values, bar_colors = [], [], []
    for case in cases:
        run = by_case[case][max(by_case[case])]
        for i, (name, label) in enumerate(ROWS):
            if name in run.speedup:
                labels.append(f"{case.upper()}, {max(by_case[case])} GPUs: {label}")
                values.append(run.speedup[name])
                bar_colors.append(colors[i % len(colors)])
    ax.barh(range(len(values)), values, color=bar_colors)
    ax.set_yticks(range(len(values)), labels, fontsize=7)
    ax.invert_yaxis()
    for y, v in enumerate(values):
        ax.text(v, y, f" {v:.2f}x", va="center", fontsize=7)
    ax.set_xlim(0, max(values) * 1.18)
    ax.set_xlabel("speedup over stock Diffusers on 1 GPU")
    ax.set_title("against Diffusers' context parallelism (same runs)", fontsize=9)
    fig.suptitle(f"One transformer step, bf16, random weights, {device}", fontsize=11)

    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "speedup.png")
    p.add_argument("--table", action="store_true", help="print the Markdown table")
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG (no matplotlib needed)")
    args = p.parse_args(argv)
    chosen = select(load_runs(args.results))
    if not chosen:
        print(f"no multi-GPU bench_transformer.py results in {args.results}", file=sys.stderr)
        return 1
    for device, by_case in sorted(chosen.items()):
        if args.table:
            print(markdown_table(device, by_case))
        if not args.no_plot:
            out = args.out
            if len(chosen) > 1:
                slug = re.sub(r"[^a-z0-9]+", "_", device.lower()).strip("_")
                out = out.with_name(f"{out.stem}_{slug}{out.suffix}")
            print(f"wrote {plot(device, by_case, out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
