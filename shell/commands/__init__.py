"""The ``asyncgrpo`` command: ``demo``, ``train``, ``plot`` and ``simulate``."""

from __future__ import annotations

from asyncgrpo.shell.commands.cli import main

__all__ = ["main"]
