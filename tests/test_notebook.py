"""examples/quickstart.ipynb runs top to bottom (its own asserts included), so it never rots."""

import pathlib

import nbformat
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_quickstart_notebook_runs(monkeypatch):
  notebook = nbformat.read(ROOT / "examples" / "quickstart.ipynb", as_version=4)
  # The kernel inherits this environment: the tests' simulated CPU devices and compilation cache.
  monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")  # figures inline
  NotebookClient(notebook, timeout=600, kernel_name="python3",
                 resources={"metadata": {"path": str(ROOT / "examples")}}).execute()
  outputs = "".join(output.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                    for output in cell.get("outputs", []))
  assert "resumed at step 40" in outputs
  assert "nats/byte" in outputs
  images = [output for cell in notebook.cells for output in cell.get("outputs", [])
            if "image/png" in output.get("data", {})]
  assert len(images) == 2  # the loss curve and the expert-load heatmap
