"""The house as docs/architecture.md draws it: imports run one way, and messages name real files.

The layers and what each may import are written once, in the table of docs/architecture.md; this
test reads that table and every import of the library (at the top of a file or inside a
function), and fails on one the table does not allow. A cell that names files (``columns.py``)
allows those modules of the layer only.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
LIBRARY = ("packed_ce", "collators", "packed_ce_demo")


def layers() -> list[tuple[str, str, set[str], set[str]]]:
    """``(name, folder, allowed layers, allowed files)`` per row of the table, top to bottom."""
    rows = []
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not re.fullmatch(r"`\w+`", cells[0]):
            continue
        folder = re.search(r"`([\w/]+)/`", cells[1]).group(1)
        names = set(re.findall(r"`([\w.]+)`", cells[3]))
        files = {name for name in names if name.endswith(".py")}
        rows.append((cells[0].strip("`"), folder, names - files, files))
    return rows


def layer_of(module: str, table) -> tuple[str, str] | None:
    """The layer of a dotted module name (the deepest folder that holds it), and its file."""
    path = module.replace(".", "/")
    if path == "packed_ce/integrations":  # the integrations' public names: their top layer
        path = "packed_ce/integrations/trainers"
    found = [row for row in table if path == row[1] or path.startswith(row[1] + "/")]
    if not found:
        return None
    name, folder, *_ = max(found, key=lambda row: len(row[1]))
    return name, path[len(folder) + 1 :].split("/")[0] + ".py" if path != folder else "__init__.py"


def imports_of(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in ``path``, relative ones resolved."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    package = parts if parts[-1] == "__init__" else parts[:-1]
    package = [part for part in package if part != "__init__"]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
                found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
            found.append((node.lineno, node.module or ""))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return found


def library_files() -> list[Path]:
    return sorted(path for folder in LIBRARY for path in (ROOT / folder).rglob("*.py"))


def test_the_table_names_every_layer_and_folder():
    table = layers()
    assert [row[0] for row in table] == ["demo", "trainers", "context_parallel", "model", "data", "core"]
    for _, folder, allowed, _ in table:
        assert (ROOT / folder).is_dir(), folder
        assert allowed <= {row[0] for row in table}, allowed


def test_no_import_climbs_a_layer():
    table = layers()
    rules = {name: (allowed, files) for name, _, allowed, files in table}
    wrong = []
    for path in library_files():
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        mine = layer_of(module, table)
        for line, target in imports_of(path):
            theirs = layer_of(target, table)
            if mine is None or theirs is None or theirs[0] == mine[0]:
                continue
            allowed, files = rules[mine[0]]
            if theirs[0] not in allowed or (files and theirs[1] not in files | {"__init__.py"}):
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({mine[0]}) imports {target} ({theirs[0]})")
    assert not wrong, "\n".join(wrong)


def test_importing_the_data_package_loads_no_loss():
    """``import collators`` loads the core's batch contract, not the loss, its kernels or
    triton."""
    code = (
        "import sys, collators; "
        "print(sorted(m for m in sys.modules if m.startswith('packed_ce')), 'triton' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.split() == ["['packed_ce',", "'packed_ce.columns',", "'packed_ce.weights']", "False"]


def strings_of(path: Path) -> list[tuple[int, str]]:
    return [
        (node.lineno, node.value)
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    ]


@pytest.mark.parametrize("folder", LIBRARY)
def test_messages_and_docstrings_name_files_that_exist(folder):
    """A path to a ``.py`` file in a message or docstring (``trainers/seams.py``) is one that
    exists: the end of a path of the repository."""
    files = {path.relative_to(ROOT).as_posix() for path in ROOT.rglob("*.py") if ".venv" not in path.parts}
    missing = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for line, text in strings_of(path):
            for named in re.findall(r"(?<![\w/.])((?:[\w.]+/)*\w+\.py)\b", text):
                if not any(f == named or f.endswith("/" + named) for f in files):
                    missing.append(f"{path.relative_to(ROOT)}:{line}: {named}")
    assert not missing, "\n".join(missing)
