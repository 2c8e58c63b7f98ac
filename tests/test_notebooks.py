"""The Colab notebooks (colab/*.ipynb): valid nbformat v4, outputs stripped, an "Open in Colab"
badge naming the repository colab/README.md documents, and every notebook executes end to end
with nbclient in smoke mode (JSPEC_NOTEBOOK_SMOKE=1: the built-in pair, small shapes, on CPU).

The notebooks share the session's JSPEC_CACHE (tests/conftest.py), so what one compiles (the same
smoke engine shapes everywhere) the next loads from the compilation cache.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import nbclient
import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
COLAB = ROOT / "colab"
NOTEBOOKS = sorted(COLAB.glob("*.ipynb"))
IDS = [p.stem for p in NOTEBOOKS]
CELL_TIMEOUT = 600  # seconds per cell: a cold compile on a slow CI machine, never a hang


def test_there_are_notebooks():
    assert {"quickstart", "adaptation_under_load", "server", "gpu_kernels"} <= set(IDS)


def _repo() -> str:
    """The repository's assumed public home, as colab/README.md documents it."""
    text = (COLAB / "README.md").read_text()
    match = re.search(r"Assumed public home: \*\*([\w.-]+/[\w.-]+)\*\*", text)
    assert match, "colab/README.md must say 'Assumed public home: **OWNER/REPO**'"
    return match.group(1)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_is_valid_and_stripped(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.nbformat == 4
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"cell {i} has outputs: strip them"
            assert cell.execution_count is None, f"cell {i} has an execution count: strip it"
    repo = _repo()
    badge = f"https://colab.research.google.com/github/{repo}/blob/main/colab/{path.name}"
    assert nb.cells[0].cell_type == "markdown" and badge in nb.cells[0].source
    sources = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert 'os.environ.get("JSPEC_NOTEBOOK_SMOKE") == "1"' in sources
    assert 'find_spec("jspec") is None' in sources
    assert f"git+https://github.com/{repo}" in sources
    # no other repository named anywhere
    names = set(re.findall(r"github(?:\.com)?/([\w.-]+/[\w.-]+)/", json.dumps(nb)))
    assert names <= {repo}, names


@pytest.fixture(scope="module")
def kernel_name(tmp_path_factory):
    """A kernel that runs this interpreter (the venv's, where jspec is installed). ipykernel's
    own "python3" spec does when its command resolves to sys.executable; otherwise (another
    "python3" spec earlier on the Jupyter path) a temporary spec is put first on JUPYTER_PATH."""
    from jupyter_client.manager import KernelManager

    cmd = KernelManager(kernel_name="python3").format_kernel_cmd()
    if os.path.abspath(cmd[0]) == os.path.abspath(sys.executable):
        yield "python3"
        return
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / "jspec-test-python"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "jspec tests", "language": "python"}))
    rest = [os.environ["JUPYTER_PATH"]] if os.environ.get("JUPYTER_PATH") else []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_PATH", os.pathsep.join([str(root), *rest]))
        yield "jspec-test-python"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_executes_in_smoke_mode(path, kernel_name, tmp_path, monkeypatch):
    # the kernel inherits this environment: smoke mode (no download either: the notebooks only
    # check whether the hub answers), and the session's JSPEC_CACHE
    monkeypatch.setenv("JSPEC_NOTEBOOK_SMOKE", "1")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name=kernel_name,
                                     resources={"metadata": {"path": str(tmp_path)}})
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:
        pytest.fail(f"{path.name} failed in smoke mode:\n{e}", pytrace=False)
