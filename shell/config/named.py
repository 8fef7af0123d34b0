"""What a command line or a sweep file names by text: objects as ``module:name``, datasets
as a file, a ``save_to_disk`` folder or ``module:function``, and named evaluation datasets as
``[NAME=]PATH``.

    >>> import_named("json:dumps", "reward function")([1])
    '[1]'
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any


class NamedObjectError(ValueError):
    """A ``module:name`` or dataset that cannot be loaded; the message names it and the fix."""


def import_named(spec: str, what: str) -> Any:
    """``"package.module:name"`` -> the object; ``what`` names it in errors ("reward function").

    Raises:
        NamedObjectError: ``spec`` has no ``:``, or the module or the name is missing.
    """
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise NamedObjectError(f"{what} {spec!r} must look like 'package.module:name'")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise NamedObjectError(f"cannot import {what} {spec!r}: {error}") from error


def load_named_dataset(spec: str) -> Any:
    """A dataset from a JSON/JSONL file, a ``save_to_disk`` folder, or ``module:function`` (a
    function of no arguments that returns one).

    Raises:
        NamedObjectError: anything else, or a ``module:function`` that cannot be imported.
    """
    from datasets import load_dataset, load_from_disk

    path = Path(spec)
    if path.is_dir():
        return load_from_disk(spec)
    if spec.endswith((".json", ".jsonl")):
        return load_dataset("json", data_files=spec, split="train")
    if ":" in spec and not path.exists():
        return import_named(spec, "dataset")()
    raise NamedObjectError(
        f"dataset {spec!r}: give a .json/.jsonl file, a dataset folder or 'module:function'"
    )


def eval_dataset_specs(value: str | list[str] | Mapping[str, str], what: str) -> dict[str, str]:
    """Evaluation datasets by name, as ``asyncgrpo eval --dataset``, ``asyncgrpo train
    --eval_dataset`` and the ``eval_dataset`` key of config and sweep files give them: one
    ``[NAME=]PATH`` string, a list of them, or a table of ``NAME = PATH``. A lone unnamed
    dataset is ``eval``; an unnamed one among several is named after its file
    (``data/held.jsonl`` -> ``held``). A PATH is what :func:`load_named_dataset` takes. The
    names name the metrics ``eval/<NAME>/...``.

    Raises:
        NamedObjectError: a name given twice, an empty one or one with ``/``, or another
            type (``what`` names the flag or key).

    Example:
        >>> eval_dataset_specs(["held=a.jsonl", "data/b.jsonl"], "--eval_dataset")
        {'held': 'a.jsonl', 'b': 'data/b.jsonl'}
        >>> eval_dataset_specs("a.jsonl", "eval_dataset")
        {'eval': 'a.jsonl'}
    """
    specs = [value] if isinstance(value, str) else value
    if isinstance(value, Mapping):
        pairs = [(str(name), str(path)) for name, path in value.items()]
    elif isinstance(specs, list) and all(isinstance(spec, str) for spec in specs):
        pairs = [_name_and_path(spec, len(specs)) for spec in specs]
    else:
        raise NamedObjectError(
            f"{what}: give a '[NAME=]PATH' string, a list of them or a table "
            f"of NAME = PATH, not {value!r}"
        )
    named: dict[str, str] = {}
    for name, path in pairs:
        if not name or "/" in name:
            raise NamedObjectError(
                f"{what}: the name {name!r} of {path!r} must be non-empty "
                "and without '/' (it names the metrics "
                "eval/<name>/...)"
            )
        if name in named:
            raise NamedObjectError(
                f"{what}: the name {name!r} is given twice; name each dataset with NAME=PATH"
            )
        named[name] = path
    if not named:
        raise NamedObjectError(f"{what}: no dataset given")
    return named


def _name_and_path(spec: str, count: int) -> tuple[str, str]:
    """``NAME=PATH`` or ``PATH`` (a path that exists, or whose part before ``=`` holds a
    ``/``, is a path whole: ``runs/max_staleness=1/held.jsonl``)."""
    name, equals, path = spec.partition("=")
    if not equals or "/" in name or Path(spec).exists():
        name, path = ("eval" if count == 1 else Path(spec).stem), spec
    return name, path


def load_eval_datasets(specs: Mapping[str, str]) -> dict[str, Any]:
    """The datasets of :func:`eval_dataset_specs`' names and paths, loaded by name."""
    return {name: load_named_dataset(path) for name, path in specs.items()}
