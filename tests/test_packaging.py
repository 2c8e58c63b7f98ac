"""The package cannot be shadowed: every module jspec installs lives under ``jspec`` (the
repository's models/, policies/, serve/ and pallas_kernels/ folders are jspec.models,
jspec.policies, jspec.serve and jspec.kernels), so a user's own ``models.py`` or ``serve.py``
in the working directory leaves ``LLM()`` working."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jspec.layout import SUBPACKAGES

ROOT = Path(__file__).resolve().parents[1]
FORMER_NAMES = ("models", "policies", "serve", "pallas_kernels")


def _user_directory(tmp_path: Path) -> Path:
    """A working directory full of a user's modules with the names jspec's folders have."""
    for name in FORMER_NAMES:
        (tmp_path / f"{name}.py").write_text(f"raise ImportError(\"the user's own {name}.py\")\n")
    (tmp_path / "kernels").mkdir()  # a package too, with junk in it
    (tmp_path / "kernels" / "__init__.py").write_text("backend = 'not jspec'\n")
    return tmp_path


def _run(code: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    # `python -c` puts the working directory first on sys.path, as a user's script would
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def test_llm_runs_from_a_directory_of_shadowing_modules(tmp_path):
    """``LLM()`` on the built-in pair, from a directory holding models.py, serve.py,
    policies.py and pallas_kernels.py that raise on import."""
    cwd = _user_directory(tmp_path)
    proc = _run("""
        import sys
        from jspec import LLM, SamplingParams
        llm = LLM(warmup=False, max_num_seqs=1, max_model_len=64, max_num_batched_tokens=32)
        out = llm.generate("def f(x):", SamplingParams(max_tokens=2, temperature=0),
                           use_tqdm=False)
        assert len(out[0].token_ids) == 2, out
        import jspec.kernels.backend, jspec.serve.protocol
        for name in ("models", "policies", "serve", "pallas_kernels", "kernels"):
            assert name not in sys.modules, name  # jspec imported none of the user's modules
        """, cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_installed_distribution_has_no_other_top_level_name(tmp_path):
    """From a directory without the repository on the path, none of the folders' own names
    resolves to anything the jspec distribution installed."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = _run("""
        import importlib.metadata, importlib.util, json
        spec = importlib.util.find_spec("jspec")
        if spec is None:
            print(json.dumps(None))
        else:
            dist = importlib.metadata.distribution("jspec")
            models = importlib.util.find_spec("jspec.models")
            print(json.dumps({
                "top_level": (dist.read_text("top_level.txt") or "").split(),
                "files": [str(f) for f in dist.files or []],
                "found": {n: importlib.util.find_spec(n) is not None
                          for n in ("models", "policies", "serve", "pallas_kernels", "kernels")},
                "models": models and models.submodule_search_locations[0],
            }))
        """, tmp_path, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout)
    if seen is None:
        pytest.skip("jspec is not installed in this environment (only on PYTHONPATH)")
    assert not any(seen["found"].values()), f"top-level names installed: {seen['found']}"
    assert seen["models"], "the installed jspec has no jspec.models (an install older than " \
                           "pyproject.toml's package-dir: reinstall it)"
    assert seen["top_level"] in ([], ["jspec"]), seen["top_level"]
    tops = {Path(f).parts[0] for f in seen["files"]}
    assert not tops & set(FORMER_NAMES), sorted(tops)
    # the built-in pair is package data of jspec.models, wherever that was installed
    assert (Path(seen["models"]) / "default_pair" / "target" / "config.json").is_file()


def test_the_checkout_map_is_the_install_map():
    """jspec.layout (a checkout used from PYTHONPATH) maps the folders as pyproject.toml does
    for installs, and the package data keeps the built-in pair."""
    tomllib = pytest.importorskip("tomllib")
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == SUBPACKAGES
    assert set(setuptools["packages"]) == {"jspec", "jspec.bench", *SUBPACKAGES}
    assert not set(setuptools["packages"]) & set(FORMER_NAMES)
    patterns = setuptools["package-data"]["jspec.models"]
    shipped = [p.relative_to(ROOT / "models") for p in (ROOT / "models" / "default_pair").rglob("*")
               if p.is_file()]
    assert shipped and all(any(p.match(pat) for pat in patterns) for p in shipped), shipped
    for module, folder in SUBPACKAGES.items():
        __import__(module)
        assert Path(sys.modules[module].__file__).resolve().parent == (ROOT / folder).resolve()
