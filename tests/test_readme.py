"""Every ``python`` code block of README.md and docs/*.md runs as written, so that none can rot.

Each block runs alone (a fresh namespace, a temporary working directory), on the CPU, as a
reader would paste it. Signature listings are ``text`` blocks and are not run.
"""

from __future__ import annotations

import functools
import os
import pathlib
import re
import subprocess
import sys

import pytest

import collators

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [
    block
    for doc in DOCS
    for block in re.findall(r"^```python\n(.*?)^```", doc.read_text(), flags=re.S | re.M)
]


def test_readme_has_the_blocks():
    assert len(BLOCKS) >= 6
    assert any("PackedSFTTrainer" in block and "trainer.train()" in block for block in BLOCKS)


@pytest.fixture(scope="module")
def loaded_once():
    """The default tokenizer and data set, loaded once for all blocks (seconds each on a busy
    CPU); the blocks still call collators.load_default_tokenizer() / load_default_dataset()."""
    with pytest.MonkeyPatch.context() as patch:
        for name in ("load_default_tokenizer", "load_default_dataset"):
            patch.setattr(collators, name, functools.lru_cache(maxsize=None)(getattr(collators, name)))
        yield


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, tmp_path, monkeypatch, loaded_once):
    code = BLOCKS[index]
    if "trl" in code:
        pytest.importorskip("trl")
    if "BitsAndBytesConfig" in code:  # QLoRA: a 4-bit model needs bitsandbytes
        pytest.importorskip("bitsandbytes")
    launch = re.search(r"run: (torchrun --nproc_per_node (\d+) (\S+))", code.splitlines()[0])
    if launch:  # a script for several processes: written out and run as the block says
        (tmp_path / launch.group(3)).write_text(code)
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", launch.group(2), launch.group(3)]
        done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        # the context-parallel script prints its ranks' loss and the one-process loss of the row
        compared = re.search(r"ranks: ([\d.]+), one process: ([\d.]+)", done.stdout)
        # float32: the ranks' shares add up in another order than one process's sum (1e-6 relative)
        assert compared is None or abs(float(compared.group(1)) / float(compared.group(2)) - 1) < 1e-6, done.stdout
        return
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"documentation python block {index}", "exec"), {"__name__": "__readme__"})
    # a reader runs it in the clone: what it writes goes to a temporary directory
    assert not list(tmp_path.iterdir()), f"block {index} wrote {sorted(p.name for p in tmp_path.iterdir())}"


README_BLOCKS = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), flags=re.S | re.M)


@pytest.mark.parametrize("index", range(len(README_BLOCKS)))
def test_every_readme_example_names_its_extras(index):
    """A first line `# extras: ...` names every extra the block needs: `demo` for the default
    tokenizer and data, `trl` for trl and peft."""
    code = README_BLOCKS[index]
    first = code.splitlines()[0]
    assert first.startswith("# extras: "), first
    if "load_default_" in code:
        assert "demo" in first, first
    if re.search(r"^(from|import) (trl|peft)\b", code, flags=re.M):
        assert "trl" in first, first


def test_the_cpu_install_route_is_one_line():
    """On a CPU, an unpinned torch pulls several GB of CUDA packages: the README's install
    section shows the CPU build first, then the package, in one line."""
    install = re.search(r"## Install\n(.*?)\n## ", (ROOT / "README.md").read_text(), flags=re.S).group(1)
    assert any(
        "download.pytorch.org/whl/cpu" in line and line.index("whl/cpu") < line.index('pip install ".[')
        for line in install.splitlines()
    ), install


def _github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation other than ``-`` and ``_``
    dropped, spaces turned into hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: doc.name)
def test_readme_links_reach_their_targets(doc):
    """Every relative link of the README and the docs names a file that exists and, with
    ``#anchor``, one of its headings (reference material moves between the pages)."""
    links = re.findall(r"\]\(([^)#\s]+)(?:#([^)\s]+))?\)", doc.read_text())
    local = [(path, anchor) for path, anchor in links if "://" not in path]
    for path, anchor in local:
        target = (doc.parent / path).resolve()
        assert target.exists(), path
        if anchor:
            headings = re.findall(r"^#+ (.+)$", target.read_text(), flags=re.M)
            assert anchor in {_github_anchor(h) for h in headings}, f"{path}#{anchor}"


def test_the_readme_reads_in_one_sitting():
    """At most 250 lines: reference material lives in docs/ and benchmarks/README.md."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
