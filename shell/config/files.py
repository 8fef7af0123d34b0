"""Config files: TOML, YAML or JSON, read into :class:`~asyncgrpo.AsyncGRPOConfig` values.

The fields may sit at the top level or in an ``asyncgrpo`` table (``[asyncgrpo]`` in TOML);
a field given in both places is an error. Top-level keys that are not fields are returned to
the caller (``asyncgrpo train`` reads ``model``, ``dataset`` and ``reward_funcs`` from them)
so that nothing in the file is ignored; an unknown key inside the table is an error naming
the closest field.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from asyncgrpo.core.names import did_you_mean
from asyncgrpo.shell.config.rules import field_names

TABLE = "asyncgrpo"


def load_mapping(path: str | Path) -> dict[str, Any]:
    """The file's top-level mapping, by extension: ``.toml``, ``.yaml``/``.yml``, ``.json``."""
    path = Path(path)
    text = path.read_text()
    if path.suffix == ".toml":
        data = tomllib.loads(text)
    elif path.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text) or {}
    elif path.suffix == ".json":
        data = json.loads(text)
    else:
        raise ValueError(f"{path}: a config file must end in .toml, .yaml, .yml or .json")
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the file must hold a mapping of settings")
    return data


def read_config(path: str | Path, cls: type) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(config values, other top-level keys)`` of a config file for the config class ``cls``.

    Raises:
        ValueError: a key in the ``asyncgrpo`` table that is not a field of ``cls`` (naming
            the closest field), or a field given both at the top level and in the table.
    """
    data = load_mapping(path)
    table = data.pop(TABLE, {})
    if not isinstance(table, dict):
        raise ValueError(f"{path}: '{TABLE}' must be a table of AsyncGRPOConfig fields")
    known = field_names(cls)
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise ValueError(
            f"{path}: [{TABLE}] {unknown[0]!r} is not an AsyncGRPOConfig field"
            + did_you_mean(unknown[0], known)
        )
    top_fields = {k: v for k, v in data.items() if k in known}
    both = sorted(set(top_fields) & set(table))
    if both:
        raise ValueError(f"{path}: {both} given both at the top level and in [{TABLE}]")
    extra = {k: v for k, v in data.items() if k not in known}
    return {**top_fields, **table}, extra
