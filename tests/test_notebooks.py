"""Executes every colabs/*.ipynb top to bottom in small mode on CPU (GPU cells skip themselves)."""

import glob
import os

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "colabs", "*.ipynb")))


def test_all_expected_notebooks_exist():
  names = {os.path.basename(p) for p in NOTEBOOKS}
  assert {"quickstart.ipynb", "numerics.ipynb", "kernels.ipynb"} <= names


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs_in_small_mode(path, monkeypatch, tmp_path):
  monkeypatch.setenv("INFIR2_NOTEBOOK_SMALL", "1")
  monkeypatch.setenv("XLA_FLAGS", "")  # one CPU device, not conftest's 8 fake ones
  monkeypatch.setenv("MPLBACKEND", "Agg")
  monkeypatch.setenv("INFIR2_COMPILATION_CACHE", str(tmp_path / "jax_cache"))
  workdir = tmp_path / "work"  # runs land in pytest's tmp, not a leaked mkdtemp folder
  workdir.mkdir()
  monkeypatch.setenv("INFIR2_NOTEBOOK_WORKDIR", str(workdir))
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
      p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p))
  nb = nbformat.read(path, as_version=4)
  # "python3" resolves to this interpreter (the venv's) in jupyter_client's kernel launcher.
  client = NotebookClient(nb, timeout=300, kernel_name="python3",
                          resources={"metadata": {"path": os.path.dirname(path)}})
  client.execute()
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if o.get("output_type") == "error"]
  assert not errors
  if os.path.basename(path) in ("quickstart.ipynb", "numerics.ipynb"):
    assert any(workdir.iterdir()), "the notebook did not write its runs under INFIR2_NOTEBOOK_WORKDIR"
