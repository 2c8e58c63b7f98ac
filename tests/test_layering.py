"""The packages import only downward: ``jspec.serve -> jspec -> {jspec.policies, jspec.models
-> jspec.kernels}`` (docs/architecture.md, "Modules and dependencies").

Every module's imports are read with ``ast``, nothing is imported: ``import``, ``from ...
import``, relative imports, imports inside functions and under ``TYPE_CHECKING``, and
``importlib.import_module`` / ``__import__`` of a literal name. The CLI's tables of lazily
imported modules are checked too. A failure names each file, line and imported module.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from jspec.layout import SUBPACKAGES

ROOT = Path(__file__).resolve().parents[1]

ENGINE = "jspec"  # the engine package: jspec/ and everything in it not mapped below
FOLDER_OF = {ENGINE: "jspec", **SUBPACKAGES}
PACKAGE_OF = {folder: package for package, folder in FOLDER_OF.items()}

# package -> the jspec packages its modules may import (itself included)
ALLOWED = {
    "jspec.kernels": {"jspec.kernels"},
    "jspec.models": {"jspec.models", "jspec.kernels"},
    "jspec.policies": {"jspec.policies"},
    ENGINE: {ENGINE, "jspec.policies", "jspec.models", "jspec.kernels"},
    "jspec.serve": set(FOLDER_OF),  # the top: anything of jspec
}

# the folders' own names, which an install does not provide (test_packaging.py): importing one
# would find a user's module of that name, or nothing
BARE_NAMES = set(SUBPACKAGES.values()) | {"kernels"}


def _package(module: str) -> str | None:
    """The jspec package a module name belongs to (the longest match), None outside jspec."""
    for package in sorted(FOLDER_OF, key=len, reverse=True):
        if module == package or module.startswith(package + "."):
            return package
    return None


def _module_name(path: Path) -> str:
    folder, *rest = path.relative_to(ROOT).with_suffix("").parts
    parts = [PACKAGE_OF[folder], *rest]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute name a (possibly relative) ``from ... import`` reads from."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[:len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import in a file; ``from pkg import name`` counts as
    ``pkg.name`` (a submodule or a name of pkg: both depend on pkg's layer)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module, is_package = _module_name(path), path.name == "__init__.py"
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(node, module, is_package)
            found += [(node.lineno, f"{source}.{alias.name}" if source else alias.name)
                      for alias in node.names]
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and (getattr(node.func, "attr", None) == "import_module"
                   or getattr(node.func, "id", None) in ("import_module", "__import__"))):
            found.append((node.lineno, node.args[0].value))
    return sorted(found)


def _sources(package: str) -> list[Path]:
    files = sorted((ROOT / FOLDER_OF[package]).rglob("*.py"))
    assert files, f"no modules found for {package} in {FOLDER_OF[package]}/"
    return files


def _violation(path: Path, line: int, module: str, package: str) -> str | None:
    where = f"{path.relative_to(ROOT)}:{line} imports {module}"
    if module.split(".")[0] in BARE_NAMES:
        return f"{where}: a folder's own name; import it as a jspec subpackage"
    target = _package(module)
    if target is None or target in ALLOWED[package]:
        return None
    return f"{where}: {package} must not depend on {target}"


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_downward(package):
    problems = [problem
                for path in _sources(package)
                for line, module in imports(path)
                if (problem := _violation(path, line, module, package))]
    if problems:
        pytest.fail(f"{package} may import only {sorted(ALLOWED[package])}; {len(problems)} "
                    "import(s) reach above it:\n  " + "\n  ".join(problems), pytrace=False)


def test_cli_tables_name_only_engine_modules():
    """`jspec` imports its subcommands by name (jspec/cli.py's tables); the server's command is
    registered through the entry-point group instead, so no table names a server module."""
    from jspec import cli

    tables = {**cli.COMMANDS, **{f"bench {k}": v for k, v in cli.BENCHMARKS.items()}}
    wrong = {name: module for name, (module, _) in tables.items()
             if _package(module) not in ALLOWED[ENGINE]}
    assert not wrong, f"jspec/cli.py's tables name modules above the engine: {wrong}"


def test_the_serve_command_comes_from_the_entry_point_group():
    """pyproject.toml registers `jspec serve` (serve/cli.py) in ``jspec.commands``; the parser
    finds it there, from an install's metadata or a checkout's pyproject.toml."""
    from jspec import cli
    from jspec.layout import checkout_entry_points

    assert checkout_entry_points(cli.COMMAND_GROUP) == {"serve": "jspec.serve.cli"}
    assert cli.extra_commands()["serve"] == "jspec.serve.cli"
    args = cli.build_parser().parse_args(["serve", "--port", "0"])
    assert args._module == "jspec.serve.cli" and args.port == 0


def test_the_checker_sees_every_kind_of_import(tmp_path, monkeypatch):
    """Relative, lazy, ``from jspec import x`` and import_module imports all count."""
    package = tmp_path / "policies"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "bad.py").write_text(
        "from . import base\n"
        "from .. import engine\n"
        "import models\n"
        "def f():\n"
        "    from jspec import llm\n"
        "    import importlib\n"
        "    importlib.import_module('jspec.serve.app')\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    path = package / "bad.py"
    found = imports(path)
    assert found == [(1, "jspec.policies.base"), (2, "jspec.engine"), (3, "models"),
                     (5, "jspec.llm"), (6, "importlib"), (7, "jspec.serve.app")], found
    problems = [p for line, module in found
                if (p := _violation(path, line, module, "jspec.policies"))]
    assert [p.split(" imports ")[1].split(":")[0] for p in problems] == [
        "jspec.engine", "models", "jspec.llm", "jspec.serve.app"], problems
