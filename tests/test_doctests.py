"""The ``>>>`` examples of every ``packed_ce`` and ``packed_ce_demo`` module run and are right."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import packed_ce
import packed_ce_demo


def _modules() -> list[str]:
    names = []
    for package in (packed_ce, packed_ce_demo):
        names.append(package.__name__)
        for info in pkgutil.walk_packages(package.__path__, prefix=package.__name__ + "."):
            names.append(info.name)
    return sorted(names)


@pytest.mark.parametrize("name", _modules())
def test_doctests(name):
    module = importlib.import_module(name)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    result = doctest.testmod(module, optionflags=flags, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
