"""Running a user's training script as its own Python process, as a user would."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def run_script(
    source: str, folder: Path, name: str, *args: str, timeout_s: float
) -> subprocess.CompletedProcess[str]:
    """Write ``source`` to ``folder / name`` and run it with ``args`` from ``folder``; its
    exit code and output (text)."""
    script = folder / name
    script.write_text(source)
    return subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=folder,
    )
