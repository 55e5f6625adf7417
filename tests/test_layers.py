"""The package's layers as docs/design.md draws them: no module imports one drawn above it, the
imports close no circle, and every module of the package is in the picture."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "diffusers_sp"


def _picture() -> list[list[str]]:
    """The module patterns of each line of the layer picture (``## Where things live``), top first."""
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    section = text[text.index("## Where things live"):]
    block = section[section.index("```\n") + 4:]
    block = block[:block.index("```")]
    return [re.findall(r"[\w/*]+\.py", line) for line in block.splitlines() if line.strip()]


def _modules() -> list[str]:
    return sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py"))


def _level(module: str, picture: list[list[str]]) -> int:
    """The line of ``module`` in the picture: its own name, else the first ``folder/*.py`` of its folder."""
    for i, patterns in enumerate(picture):
        if module in patterns:
            return i
    folder = module.rsplit("/", 1)[0] + "/*.py" if "/" in module else None
    for i, patterns in enumerate(picture):
        if folder in patterns:
            return i
    raise AssertionError(f"diffusers_sp/{module} is not in the layer picture of docs/design.md")


def _resolve(module: str, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The package modules (paths under diffusers_sp/) that an import statement of ``module`` names."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names if a.name.startswith("diffusers_sp")]
        parts = [n.split(".")[1:] for n in names]
    elif node.level == 0:
        if not (node.module or "").startswith("diffusers_sp"):
            return []
        parts = [node.module.split(".")[1:] + [a.name] for a in node.names]
    else:
        here = module.split("/")[:-1]
        base = here[:len(here) - (node.level - 1)] if node.level > 1 else here
        prefix = base + (node.module.split(".") if node.module else [])
        parts = [prefix + [a.name] for a in node.names]
    found = []
    for p in parts:
        for cut in (len(p), len(p) - 1):  # `from .x import name`: name may be a module or an attribute
            path = "/".join(p[:cut])
            if (PACKAGE / f"{path}.py").is_file():
                found.append(f"{path}.py")
                break
            if cut and (PACKAGE / path / "__init__.py").is_file():
                found.append(f"{path}/__init__.py")
                break
    return found


def _imports() -> dict[str, set[str]]:
    graph = {}
    for module in _modules():
        tree = ast.parse((PACKAGE / module).read_text(encoding="utf-8"))
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                targets.update(t for t in _resolve(module, node) if t != module)
        graph[module] = targets
    return graph


def test_every_module_is_in_the_picture():
    picture = _picture()
    for module in _modules():
        _level(module, picture)


def test_no_import_runs_up_the_layers():
    picture, upward = _picture(), []
    for module, targets in _imports().items():
        for target in targets:
            if target.endswith("__init__.py") and target != "__init__.py" and module.startswith(target[:-11]):
                continue  # a package's modules may read names their own package collects below them
            if _level(target, picture) < _level(module, picture):
                upward.append(f"{module} -> {target}")
    assert not upward, f"imports that run up the layers of docs/design.md: {upward}"


def test_the_imports_close_no_circle():
    graph = _imports()
    done, path = set(), []

    def visit(module):
        if module in path:
            raise AssertionError(f"import circle: {' -> '.join(path[path.index(module):] + [module])}")
        if module in done:
            return
        path.append(module)
        for target in sorted(graph.get(module, ())):
            visit(target)
        path.pop()
        done.add(module)

    for module in graph:
        visit(module)


def test_the_check_sees_an_upward_import():
    """The resolver finds the package's imports, relative and absolute (a check that finds nothing
    would pass vacuously)."""
    graph = _imports()
    assert "errors.py" in graph["validation.py"] and "plan_entries.py" in graph["sharding.py"]
    assert "spec.py" not in graph["errors.py"] and "pipelines/spec.py" in graph["pipelines/flux.py"]
    picture = _picture()
    assert _level("api.py", picture) < _level("errors.py", picture)
