"""Files and directories replaced whole: written beside their final name, then renamed onto
it, so a reader, or a run killed while it writes, finds the old content or the new one, never
part of one.

The rename is ``os.replace``: atomic on POSIX file systems for a file, and for a directory
where the final name is free (a directory is never renamed onto a non-empty one). It keeps
the data safe from a killed process, not from a power loss (nothing is ``fsync``'ed).

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> file = Path(tempfile.mkdtemp()) / "index.json"
    >>> write_text_whole(file, '{"runs": []}')
    >>> file.read_text(), sorted(p.name for p in file.parent.iterdir())
    ('{"runs": []}', ['index.json'])
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


def partial_path(final: Path, unique: bool = False) -> Path:
    """Where the new content of ``final`` is written first: a hidden name beside it, that of
    this process when ``unique`` (for several processes that may write ``final`` at once)."""
    suffix = f".partial-{os.getpid()}" if unique else ".partial"
    return final.with_name(f".{final.name}{suffix}")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def replaced_whole(final: str | Path, unique: bool = False) -> Iterator[Path]:
    """Give a path beside ``final`` to write its new content at (a file, or a directory the
    block creates); when the block ends without an error, that path is renamed onto
    ``final``. A partial path left by an earlier, killed writer is removed first; on an error
    in the block, or in the rename, the partial path is removed and ``final`` is left as it was.

    Args:
        final: the file or directory to replace (or create).
        unique: a partial path of this process's own (see :func:`partial_path`).

    Raises:
        OSError: the rename failed, as ``os.replace`` raises it (a directory onto a non-empty
            one: another writer finished first).
    """
    final = Path(final)
    partial = partial_path(final, unique)
    _remove(partial)
    try:
        yield partial
        os.replace(partial, final)
    except BaseException:
        with contextlib.suppress(OSError):
            _remove(partial)
        raise


def write_text_whole(path: str | Path, text: str) -> None:
    """Replace the file at ``path`` with ``text`` (UTF-8) whole (see :func:`replaced_whole`)."""
    with replaced_whole(path) as partial:
        partial.write_text(text, encoding="utf-8")
