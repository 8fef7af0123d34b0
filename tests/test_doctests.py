"""The worked examples in the docstrings are tests too, in every part of the package:
``asyncgrpo`` itself, ``asyncgrpo.core``, ``asyncgrpo.adapters`` and ``asyncgrpo.shell``.

Every core module must have an example (core is pure: each function's behaviour can be shown
in a line). Elsewhere a module's examples run where it has any; the modules are found on disk,
and only those whose source holds an example (a ``>>>`` line) are imported, so that the test
imports no module it has nothing to run in (some import vLLM, and ``__main__`` runs the CLI).
"""

import ast
import doctest
import importlib
from pathlib import Path
from types import ModuleType

import pytest

import asyncgrpo
import asyncgrpo.adapters
import asyncgrpo.core
import asyncgrpo.shell

PARTS = (asyncgrpo, asyncgrpo.core, asyncgrpo.adapters, asyncgrpo.shell)
"""The package's parts, each in its own folder (pyproject's package-dir)."""

EXAMPLES_REQUIRED = asyncgrpo.core.__name__


def module_names(part: ModuleType) -> list[str]:
    """The importable modules of ``part``'s folder, sub-packages included, but not those of
    another part (``asyncgrpo``'s folder holds neither core, adapters nor shell) nor a
    ``__main__``."""
    folder = Path(part.__path__[0])
    names = []
    for path in sorted(folder.rglob("*.py")):
        if path.name == "__main__.py":
            continue
        inside = path.relative_to(folder).with_suffix("").parts
        names.append(".".join((part.__name__, *inside)).removesuffix(".__init__"))
    return names


def holds_code(name: str, source: str) -> bool:
    """A module, or a package whose ``__init__`` is more than its docstring (a sub-package that
    only groups modules has nothing to show)."""
    is_package = Path(importlib.util.find_spec(name).origin).name == "__init__.py"
    return not is_package or len(ast.parse(source).body) > 1


def source_of(name: str) -> str:
    return Path(importlib.util.find_spec(name).origin).read_text()


def needs_examples(name: str) -> bool:
    return name == EXAMPLES_REQUIRED or name.startswith(EXAMPLES_REQUIRED + ".")


def modules_with_examples() -> list[str]:
    """Every core module that holds code, and every other module with an example."""
    chosen = []
    for part in PARTS:
        for name in module_names(part):
            source = source_of(name)
            wanted = holds_code(name, source) if needs_examples(name) else ">>>" in source
            if wanted:
                chosen.append(name)
    return chosen


MODULES = modules_with_examples()


def test_every_part_of_the_package_is_walked() -> None:
    walked = {name.split(".")[1] if name.count(".") else "" for name in MODULES}
    assert {"core", "adapters", "shell"} <= walked
    assert "asyncgrpo.tasks" in MODULES  # a module of asyncgrpo's own folder
    assert "asyncgrpo.shell.experiments.simulate" in MODULES
    assert not any(name.endswith("__main__") for name in MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    if needs_examples(name):
        assert result.attempted > 0, f"{name} has no worked example"
    assert result.failed == 0
