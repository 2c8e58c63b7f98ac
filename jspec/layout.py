"""Where jspec's subpackages live in the repository, and how a source checkout finds them.

The repository's top-level folders models/, policies/, serve/ and pallas_kernels/ are the
subpackages jspec.models, jspec.policies, jspec.serve and jspec.kernels. An install (a wheel, or
an editable install) maps them under jspec (pyproject.toml, ``[tool.setuptools.package-dir]``),
so the distribution's only top-level name is ``jspec`` and a user's own ``models.py`` cannot
shadow a part of it. A checkout used without an install (its root on ``sys.path``, e.g.
``PYTHONPATH=$PWD``) has no installer's map: :func:`install_checkout_finder` adds one, which
also makes such a checkout import its own folders rather than those of another checkout that
the environment holds an editable install of.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

# subpackage -> its folder at the repository root (pyproject.toml's package-dir says the same)
SUBPACKAGES = {
    "jspec.models": "models",
    "jspec.policies": "policies",
    "jspec.serve": "serve",
    "jspec.kernels": "pallas_kernels",
}


class _CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds the subpackages in a checkout's folders; their modules are then found as usual,
    on each subpackage's ``__path__``."""

    def __init__(self, root: Path):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        folder = SUBPACKAGES.get(fullname)
        if folder is None:
            return None
        init = self.root / folder / "__init__.py"
        return importlib.util.spec_from_file_location(
            fullname, init, submodule_search_locations=[str(init.parent)])


def _checkout_root() -> Path | None:
    """The repository root when jspec runs from a source checkout (the folders beside jspec/,
    no subpackage inside it), else None (installed as a wheel lays it out, or no checkout)."""
    package_dir = Path(__file__).parent
    root = package_dir.parent
    if (package_dir / "models").is_dir() or not (root / "pyproject.toml").is_file():
        return None
    if not all((root / folder / "__init__.py").is_file() for folder in SUBPACKAGES.values()):
        return None
    return root


def install_checkout_finder() -> bool:
    """When jspec runs from a source checkout, put a finder for the subpackages first on
    ``sys.meta_path``; returns whether it did."""
    root = _checkout_root()
    if root is None:
        return False
    if any(isinstance(f, _CheckoutFinder) for f in sys.meta_path):
        return False
    sys.meta_path.insert(0, _CheckoutFinder(root))
    return True


def checkout_entry_points(group: str) -> dict[str, str]:
    """name -> object reference of the entry points the checkout's pyproject.toml declares in
    ``group``: what an install registers, for a checkout used without one (or beside an install
    of an older checkout). Empty when jspec does not run from a checkout, and on Python 3.10
    (no tomllib), where only installed entry points count."""
    root = _checkout_root()
    if root is None:
        return {}
    try:
        import tomllib
    except ImportError:
        return {}
    project = tomllib.loads((root / "pyproject.toml").read_text()).get("project", {})
    return dict(project.get("entry-points", {}).get(group, {}))
