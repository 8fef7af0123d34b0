"""The worked examples in the docstrings are tests too."""

import doctest
import importlib
import pkgutil

import pytest

import asyncgrpo.core

MODULES = [
    importlib.import_module(f"asyncgrpo.core.{info.name}")
    for info in pkgutil.iter_modules(asyncgrpo.core.__path__)
]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_docstring_examples(module) -> None:
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{module.__name__} has no worked example"
    assert result.failed == 0
