"""The run's configuration: :class:`AsyncGRPOConfig` (TRL's field names and defaults), the rules
for every inherited ``TrainingArguments`` field (:mod:`.rules`), the checks of its own values
(:mod:`.checks`), config files (:mod:`.files`), where log lines go (:mod:`.logs`),
objects and datasets named by text (:mod:`.named`)
and the generated reference docs/configuration.md (:mod:`.docs`).

The lowest wing: it imports no other wing.
"""

from __future__ import annotations

from asyncgrpo.shell.config import rules
from asyncgrpo.shell.config.fields import AsyncGRPOConfig
from asyncgrpo.shell.config.files import read_config
from asyncgrpo.shell.config.logs import configure_logging, use_log_levels
from asyncgrpo.shell.config.named import (
    NamedObjectError,
    eval_dataset_specs,
    import_named,
    load_eval_datasets,
    load_named_dataset,
)
from asyncgrpo.shell.config.rules import field_names

__all__ = [
    "AsyncGRPOConfig",
    "NamedObjectError",
    "configure_logging",
    "eval_dataset_specs",
    "field_names",
    "import_named",
    "load_eval_datasets",
    "load_named_dataset",
    "read_config",
    "rules",
    "use_log_levels",
]
