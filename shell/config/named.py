"""What a command line or a sweep file names by text: objects as ``module:name`` and datasets
as a file, a ``save_to_disk`` folder or ``module:function``.

    >>> import_named("json:dumps", "reward function")([1])
    '[1]'
"""

from __future__ import annotations

import importlib
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
