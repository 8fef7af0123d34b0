"""The worked examples in the docstrings are tests too."""

import ast
import doctest
import importlib
import pkgutil
from pathlib import Path

import pytest

import asyncgrpo.core


def holds_code(info: pkgutil.ModuleInfo) -> bool:
    """A module, or a package whose ``__init__`` is more than its docstring (a sub-package that
    only groups modules has nothing to show)."""
    if not info.ispkg:
        return True
    init = Path(info.module_finder.path, info.name.rsplit(".", 1)[-1], "__init__.py")
    return len(ast.parse(init.read_text()).body) > 1


MODULES = [
    importlib.import_module(info.name)
    for info in pkgutil.walk_packages(asyncgrpo.core.__path__, prefix="asyncgrpo.core.")
    if holds_code(info)
]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_docstring_examples(module) -> None:
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{module.__name__} has no worked example"
    assert result.failed == 0
