"""Build ``packed_vs_unpacked.ipynb`` from its paired script and execute it in place.

The ``# %%`` script ``packed_vs_unpacked.py`` is the source that gets reviewed; the notebook is
made from it (``# %% [markdown]`` cells become markdown, ``# %%`` cells code) and executed
with nbclient, its outputs written into the ``.ipynb`` next to it. ``make notebook`` runs this.

The file it writes depends only on the script and what the cells print: cell ids are numbered,
no execution timestamps are recorded and consecutive stream outputs are merged (how a kernel
splits them depends on timing), so running it twice gives the same bytes and, on a clean
clone, leaves ``git status`` clean.

Usage::

    python notebooks/execute.py            # rebuild from the script, execute, save in place
    python notebooks/execute.py --check    # exit 1 if the notebook is not in sync with the script
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import nbformat
from jupyter_client import KernelManager
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
NOTEBOOK = HERE / "packed_vs_unpacked.ipynb"
SCRIPT = HERE / "packed_vs_unpacked.py"
CELL_MARKER = "# %%"
MARKDOWN_MARKER = "# %% [markdown]"


def cells_from_script(script: Path) -> list[nbformat.NotebookNode]:
    """The cells of a ``# %%`` (percent format) script, in order."""
    cells, kind, lines = [], None, []

    def close():
        text = "\n".join(lines).strip("\n")
        if kind == "markdown":
            text = "\n".join(
                line[2:] if line.startswith("# ") else line.lstrip("#")
                for line in text.splitlines()
            )
            cells.append(nbformat.v4.new_markdown_cell(text))
        elif kind == "code":
            cells.append(nbformat.v4.new_code_cell(text))

    for line in script.read_text().splitlines():
        if line.startswith(CELL_MARKER):
            close()
            kind, lines = ("markdown" if line.startswith(MARKDOWN_MARKER) else "code"), []
        else:
            lines.append(line)
    close()
    for number, cell in enumerate(cells):
        cell.id = f"cell-{number:02d}"  # nbformat draws random ids: a diff on every run
    return cells


def in_sync(notebook: nbformat.NotebookNode, script: Path) -> bool:
    """True if the notebook's cells are the script's, with their ids (outputs aside)."""
    expected = [(cell.id, cell.cell_type, cell.source) for cell in cells_from_script(script)]
    return [(cell.get("id"), cell.cell_type, cell.source) for cell in notebook.cells] == expected


def build(script: Path) -> nbformat.NotebookNode:
    notebook = nbformat.v4.new_notebook(cells=cells_from_script(script))
    notebook.metadata.kernelspec = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    notebook.metadata.language_info = {"name": "python"}
    return notebook


def execute(notebook: nbformat.NotebookNode, *, timeout: int = 300) -> None:
    """Runs every cell with the current Python in the repository root, outputs into ``notebook``;
    the kernel's start and each cell fail after ``timeout`` seconds (a hang, not a slow machine).

    Raises:
        nbclient.exceptions.CellExecutionError: with the failing cell's traceback.
    """
    with tempfile.TemporaryDirectory(prefix="kernel-") as sockets:
        # the kernel's channels on Unix sockets: TCP ports found free before the kernel started
        # and bound them could be taken meanwhile on a loaded machine
        kernel = KernelManager(kernel_name="python3", transport="ipc", ip=str(Path(sockets, "ipc")))
        client = NotebookClient(
            notebook,
            km=kernel,
            timeout=timeout,
            startup_timeout=timeout,
            kernel_name="python3",
            resources={"metadata": {"path": str(REPO)}},  # so that collators and packed_ce import
            record_timing=False,  # timestamps in every cell's metadata would change on every run
            coalesce_streams=True,  # one output per stream, however the kernel flushed it
        )
        client.execute()
    # the kernel writes its Python version here: the file would change with the machine
    notebook.metadata.language_info = {"name": "python"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="only check that the notebook matches the script"
    )
    args = parser.parse_args(argv)
    if args.check:
        if NOTEBOOK.exists() and in_sync(nbformat.read(NOTEBOOK, as_version=4), SCRIPT):
            return 0
        print(f"{NOTEBOOK.name} is out of date: run python notebooks/execute.py", file=sys.stderr)
        return 1
    notebook = build(SCRIPT)
    execute(notebook)
    nbformat.write(notebook, NOTEBOOK)
    print(f"executed {NOTEBOOK.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
