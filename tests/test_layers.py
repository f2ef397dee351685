"""Imports run only downward: the core never imports the registry, the orchestration or the command line,
and only the composition root (`ridgefill/cli.py`, `ridgefill/results_cli.py`) imports the command-line
modules of the layers above it and the flows. Checked folder by folder and file by file (every import, those
under `TYPE_CHECKING` and inside functions too, against the layer of the module it names); and no function
takes more than 7 parameters (typer commands aside): values travel whole (`ModelRef`, `Fit`, `Cells`...)."""

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


LAYERS = [  # bottom to top, as docs/DESIGN.md draws them; a module may import its own layer and those below it
    ("core", ("ridgefill", "ridgefill.adapters", "ridgefill.rows", "ridgefill.params", "ridgefill.corpus",
              "ridgefill.capture", "ridgefill.fit", "ridgefill.heldout", "ridgefill.maps", "ridgefill.fingerprint",
              "ridgefill.runtime", "ridgefill.flops", "ridgefill.inputs", "ridgefill.steps", "ridgefill.settings",
              "ridgefill.default_model", "ridgefill.scores", "ridgefill.engines", "ridgefill.ttft_model")),
    ("runtimes", ("ridgefill.vllm_plugin",)),
    ("evaluation", ("ridgefill.evals", "ridgefill.decision")),
    ("study", ("ridgefill.study",)),
    ("tuning", ("ridgefill.search", "ridgefill.objectives", "ridgefill.report", "ridgefill.certify", "ridgefill.cost",
                "ridgefill.results")),
    ("registry", ("registry",)),
    ("tasks", ("tasks",)),
    ("flows", ("flows",)),
    ("command line", ("ridgefill.cli", "ridgefill.results_cli", "ridgefill.evals.cli", "registry.cli")),
]  # fmt: skip
MAX_PARAMS = 7


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int | None:
    """The layer of `module` (the longest matching name wins), None for a module outside the project."""
    best, rank = -1, None
    for i, (_, names) in enumerate(LAYERS):
        for n in names:
            if (module == n or module.startswith(n + ".")) and len(n) > best:
                best, rank = len(n), i
    return rank


def _imports(path: Path) -> set[str]:
    """Every module a file imports, function-local imports included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names if _is_module(f"{node.module}.{a.name}")}
    return found


def _is_module(name: str) -> bool:
    """Whether `name` is one of the project's modules (`from ridgefill import steps` imports the module)."""
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


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


def _files() -> list[Path]:
    return [p for folder in FORBIDDEN for p in sorted((ROOT / folder).rglob("*.py"))]


def test_every_module_has_a_layer():
    assert [p.relative_to(ROOT).as_posix() for p in _files() if _layer(_module(p)) is None] == []


def test_imports_run_only_downward_file_by_file():
    """Each file imports only its own layer and those below it: `steps` (core) may not name `search.Params` or
    `study.Study`, not even for type checking; the runtimes sit below the evaluation that drives them."""
    wrong = []
    for path in _files():
        mine = _layer(_module(path))
        for m in sorted(_imports(path)):
            theirs = _layer(m)
            if theirs is not None and theirs > mine:
                wrong.append(
                    f"{path.relative_to(ROOT).as_posix()} ({LAYERS[mine][0]}) imports {m} ({LAYERS[theirs][0]})"
                )
    assert wrong == [], "upward imports: " + "; ".join(wrong)


def _is_typer_command(fn: ast.FunctionDef) -> bool:
    """Decorated `@<app>.command(...)`, or registered later with its options annotated `typer.Option` /
    `typer.Argument`: its parameters are the command line's options."""
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Attribute) and target.attr == "command":
            return True
    notes = [ast.unparse(x.annotation) for x in fn.args.args + fn.args.kwonlyargs if x.annotation is not None]
    return any("typer.Option" in n or "typer.Argument" in n for n in notes)


def test_no_function_takes_more_than_seven_parameters():
    """Values travel whole: a function of more than 7 parameters (self aside; *args and **kwargs count one each)
    is a value waiting to be named. Typer commands are exempt: their parameters are the command line."""
    wrong = []
    for path in _files():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or _is_typer_command(node):
                continue
            a = node.args
            names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
            count = len(names) + (a.vararg is not None) + (a.kwarg is not None)
            where = f"{path.relative_to(ROOT).as_posix()}::{node.name}"
            if count > MAX_PARAMS:
                wrong.append(f"{where} ({count})")
    assert wrong == [], "functions of more than 7 parameters: " + ", ".join(sorted(set(wrong)))
