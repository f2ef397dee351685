"""Imports run only downward: the core never imports the registry, the orchestration or the command line,
and only the composition root (`ridgefill/cli.py`, `ridgefill/results_cli.py`) imports the command-line
modules of the layers above it and the flows."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMPOSITION_ROOT = {"ridgefill/cli.py", "ridgefill/results_cli.py"}
COMMAND_LINE = ("ridgefill.cli", "ridgefill.results_cli", "registry.cli")
FORBIDDEN = {  # folder -> what its modules must not import (the layers above it, in docs/DESIGN.md)
    "ridgefill": ("registry", "tasks", "flows", *COMMAND_LINE),
    "registry": ("tasks", "flows", "ridgefill.cli", "ridgefill.results_cli"),
    "tasks": ("flows", *COMMAND_LINE),
    "flows": COMMAND_LINE,
}


def _imports(path: Path) -> set[str]:
    """Every module a file imports, function-local imports included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def _under(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_imports_run_only_downward():
    wrong = []
    for folder, above in FORBIDDEN.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            if name not in COMPOSITION_ROOT:
                wrong += [f"{name} imports {m}" for m in sorted(_imports(path)) if _under(m, above)]
    assert wrong == [], "upward imports: " + "; ".join(wrong)
    assert "registry.cli" in _imports(ROOT / "ridgefill" / "cli.py")  # the root composes the layers above
