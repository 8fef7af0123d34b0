"""The ``asyncgrpo`` command: argparse glue over the other wings (``demo``, ``train``, ``plot``,
``simulate``, ``sweep``, ``compare``); the experiments themselves live in the experiments wing."""

from __future__ import annotations

from asyncgrpo.shell.commands.cli import main

__all__ = ["main"]
