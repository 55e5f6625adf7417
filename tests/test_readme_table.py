"""The README's table of supported pipelines agrees with the family registry (and vice versa).

The table sits under the heading ``## Supported pipelines`` and has the columns
``Family | Pipelines | Text in self-attention | Text mask | Modes``. Pipelines are
the inline-code names ending in ``Pipeline`` (```FluxPipeline```; other notes may follow); modes
are the mode names in the cell (``ulysses``, ``kv_gather``, with or without backticks); "Text in
self-attention" says ``prefix``, ``suffix`` or ``no``; "Text mask" says ``yes`` or ``no``.
"""

from __future__ import annotations

import re
from pathlib import Path

from diffusers_sp.pipelines import FAMILIES

README = Path(__file__).resolve().parents[1] / "README.md"
COLUMNS = ["family", "pipelines", "text in self-attention", "text mask", "modes"]


def parse_supported_table(markdown: str) -> list[dict]:
    """Rows of the first table under ``## Supported pipelines`` as dicts keyed by lower-case column name.

    Raises:
        AssertionError: no such heading, no table under it, or unexpected columns.
    """
    match = re.search(r"^##\s+Supported pipelines\s*$(.*?)(?=^##\s|\Z)", markdown, re.M | re.S)
    assert match, "README.md has no '## Supported pipelines' section"
    lines = [ln.strip() for ln in match.group(1).splitlines() if ln.strip().startswith("|")]
    assert len(lines) >= 3, "no markdown table under '## Supported pipelines'"

    def cells(line):
        return [c.strip() for c in line.strip("|").split("|")]

    header = [c.lower() for c in cells(lines[0])]
    assert header == COLUMNS, f"table columns {header}, expected {COLUMNS}"
    return [dict(zip(header, cells(ln))) for ln in lines[2:]]


def _pipelines(cell: str) -> set[str]:
    return {name for name in re.findall(r"`([^`]+)`", cell) if name.endswith("Pipeline")}


def _modes(cell: str) -> set[str]:
    return set(re.findall(r"\b(ulysses|kv_gather|vsa)\b", cell))


def _text_layout(cell: str):
    low = cell.lower()
    for layout in ("prefix", "suffix"):
        if layout in low:
            return layout
    return None


def table_problems(markdown: str) -> list[str]:
    """Disagreements between the README table and :data:`diffusers_sp.pipelines.FAMILIES` (empty: agree)."""
    rows = parse_supported_table(markdown)
    problems = []
    by_pipeline = {p: fam for fam in FAMILIES for p in fam.pipeline_classes}
    listed = set()
    for row in rows:
        pipelines = _pipelines(row["pipelines"])
        fams = {by_pipeline[p].name for p in pipelines if p in by_pipeline}
        unknown = pipelines - set(by_pipeline)
        if unknown:
            problems.append(f"row {row['family']!r} lists pipelines the registry does not support: {sorted(unknown)}")
        if len(fams) != 1:
            problems.append(f"row {row['family']!r} must list the pipelines of exactly one family, got {sorted(fams)}")
            continue
        fam = next(f for f in FAMILIES if f.name in fams)
        listed |= pipelines
        if pipelines != set(fam.pipeline_classes):
            problems.append(f"row {row['family']!r}: pipelines {sorted(pipelines)} != registry "
                            f"{sorted(fam.pipeline_classes)}")
        if _text_layout(row["text in self-attention"]) != fam.joint_text:
            problems.append(f"row {row['family']!r}: text in self-attention {row['text in self-attention']!r} "
                            f"!= registry {fam.joint_text or 'no'!r}")
        mask = row["text mask"].lower().startswith("yes")
        if mask != fam.text_mask:
            problems.append(f"row {row['family']!r}: text mask {row['text mask']!r} != registry {fam.text_mask}")
        if _modes(row["modes"]) != set(fam.modes):
            problems.append(f"row {row['family']!r}: modes {sorted(_modes(row['modes']))} != registry {sorted(fam.modes)}")
    missing = set(by_pipeline) - listed
    if missing:
        problems.append(f"registry pipelines missing from the README table: {sorted(missing)}")
    return problems


def test_readme_table_matches_registry():
    assert README.exists(), "README.md is missing"
    problems = table_problems(README.read_text(encoding="utf-8"))
    assert not problems, "\n".join(problems)


def test_checker_catches_disagreements():
    """The checker itself: a table missing a family and with a wrong mode is reported."""
    good = ["| Family | Pipelines | Text in self-attention | Text mask | Modes |", "|---|---|---|---|---|"]
    for fam in FAMILIES:
        good.append(f"| {fam.name} | {', '.join(f'`{p}`' for p in fam.pipeline_classes)} | "
                    f"{fam.joint_text or 'no'} | {'yes' if fam.text_mask else 'no'} | "
                    f"{', '.join(f'`{m}`' for m in fam.modes)} |")
    text = "## Supported pipelines\n\n" + "\n".join(good) + "\n\n## Next\n"
    assert table_problems(text) == []
    broken = text.replace(good[-1], "").replace("`kv_gather`", "`ring`", 1)
    problems = table_problems(broken)
    assert any("missing" in p for p in problems) and any("modes" in p for p in problems), problems
