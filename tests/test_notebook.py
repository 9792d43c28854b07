"""The notebook runs from top to bottom, matches its paired script, and is committed executed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
pytest.importorskip("datasets")  # the notebook loads the corpus with datasets

_path = Path(__file__).resolve().parents[1] / "notebooks" / "execute.py"
_spec = importlib.util.spec_from_file_location("notebooks_execute", _path)
execute = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(execute)


def test_notebook_matches_its_script():
    committed = nbformat.read(execute.NOTEBOOK, as_version=4)
    assert execute.in_sync(committed, execute.SCRIPT), "run python notebooks/execute.py"
    code = [cell for cell in committed.cells if cell.cell_type == "code"]
    assert all(cell.execution_count is not None for cell in code), "commit the notebook executed"
    images = sum("image/png" in out.get("data", {}) for cell in code for out in cell.outputs)
    assert images == 3  # the packing layout, the per-token weights, the training run


def test_notebook_executes():
    notebook = execute.build(execute.SCRIPT)
    seconds = execute.execute(notebook, timeout=120)  # raises with the cell's traceback on error
    print(f"notebook executed in {seconds:.0f} s")
    errors = [
        out
        for cell in notebook.cells
        for out in cell.get("outputs", [])
        if out.output_type == "error"
    ]
    assert not errors
