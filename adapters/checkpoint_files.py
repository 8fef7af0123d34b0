"""Checks of the files a checkpoint or a saved model holds, without loading their tensors.

Each check reads what a file says about itself (a safetensors header, a sharded checkpoint's
``.metadata``, a JSON object's keys, a small torch pickle) and compares it with the file as it
is on disk. A file cut short by a full disk, a node that crashed or a copy that stopped, an
empty file, a missing one: each raises :class:`DamagedFile`, naming the file and what is wrong.

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> file = Path(tempfile.mkdtemp()) / "rollout_state.json"
    >>> _ = file.write_text("")
    >>> try:
    ...     read_json_object(file, ("step",))
    ... except DamagedFile as error:
    ...     error.problem
    'empty (0 bytes)'
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader

DCP_METADATA = ".metadata"
SAFETENSORS_DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
"""Bytes per element of each safetensors dtype; tensors of other dtypes (sub-byte ones) are
checked by their offsets only."""
SAFETENSORS_HEADER_LIMIT = 100 * 1024**2  # the largest header the safetensors library reads


class DamagedFile(ValueError):
    """A file of a checkpoint or a saved model is missing, empty, cut short or does not parse.

    Attributes:
        file: the file.
        problem: what is wrong with it, in words (``"missing"``, ``"empty (0 bytes)"``, ...).
    """

    def __init__(self, file: Path, problem: str) -> None:
        super().__init__(f"{file}: {problem}")
        self.file = file
        self.problem = problem


def _size(file: Path) -> int:
    """The size of ``file`` in bytes; :class:`DamagedFile` when it is missing or empty."""
    if not file.is_file():
        raise DamagedFile(file, "missing")
    size = file.stat().st_size
    if size == 0:
        raise DamagedFile(file, "empty (0 bytes)")
    return size


def read_json_object(file: Path, required: Sequence[str] = ()) -> dict[str, Any]:
    """The JSON object in ``file``, which must hold the keys ``required``.

    Raises:
        DamagedFile: the file is missing, empty, not JSON, not an object, or lacks a key.
    """
    _size(file)
    try:
        value = json.loads(file.read_text())
    except (OSError, ValueError) as error:
        raise DamagedFile(file, f"not valid JSON ({type(error).__name__}: {error})") from error
    if not isinstance(value, dict):
        raise DamagedFile(file, f"holds a JSON {type(value).__name__}, not an object")
    missing = [key for key in required if key not in value]
    if missing:
        raise DamagedFile(file, f"lacks the key(s) {', '.join(map(repr, missing))}")
    return value


def check_torch_file(file: Path) -> Any:
    """Load the small torch pickle ``file`` (``weights_only``) and return what it holds.

    Raises:
        DamagedFile: the file is missing, empty or does not load.
    """
    _size(file)
    try:
        return torch.load(file, weights_only=True)
    except Exception as error:
        raise DamagedFile(file, f"does not load ({type(error).__name__}: {error})") from error


def check_safetensors(file: Path) -> None:
    """Check that ``file`` is a whole safetensors file: its 8-byte header length and its JSON
    header are there, each tensor's byte range matches its dtype and shape, and the file is as
    long as the header's last offset says (the layout the safetensors library requires).

    Raises:
        DamagedFile: naming what is missing or cut short, with the sizes in bytes.
    """
    size = _size(file)
    if size < 8:
        raise DamagedFile(file, f"cut short: {size} bytes, shorter than the 8-byte header length")
    with file.open("rb") as handle:
        (header_bytes,) = struct.unpack("<Q", handle.read(8))
        if header_bytes > SAFETENSORS_HEADER_LIMIT:
            raise DamagedFile(file, f"not a safetensors file: a header of {header_bytes} bytes")
        if 8 + header_bytes > size:
            raise DamagedFile(
                file, f"cut short: {size} bytes, its header alone needs {8 + header_bytes}"
            )
        try:
            header = json.loads(handle.read(header_bytes))
        except ValueError as error:
            raise DamagedFile(file, f"its header is not valid JSON ({error})") from error
    if not isinstance(header, dict):
        raise DamagedFile(file, "its header is not a JSON object")
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, stop = (int(offset) for offset in entry["data_offsets"])
            elements = math.prod(int(d) for d in entry["shape"])
            dtype = str(entry["dtype"])
        except (KeyError, TypeError, ValueError) as error:
            raise DamagedFile(
                file,
                f"its header entry for {name!r} is malformed ({type(error).__name__}: {error})",
            ) from error
        per_element = SAFETENSORS_DTYPE_BYTES.get(dtype)
        if stop < begin or (per_element is not None and stop - begin != elements * per_element):
            raise DamagedFile(
                file,
                f"its header gives tensor {name!r} ({dtype}, "
                f"{elements} elements) bytes [{begin}, {stop})",
            )
        end = max(end, stop)
    needed = 8 + header_bytes + end
    if size < needed:
        raise DamagedFile(file, f"cut short: {size} bytes, its header needs {needed}")
    if size > needed:
        raise DamagedFile(
            file, f"{size} bytes, {size - needed} more than its header accounts for ({needed})"
        )


def check_distributed_checkpoint(directory: Path) -> None:
    """Check a checkpoint written by torch's distributed checkpoint: ``.metadata`` is there
    and loads, and each data file (``*.distcp``) it refers to is at least as long as the
    metadata says.

    Raises:
        DamagedFile: naming ``.metadata`` or the data file, and what is wrong.
    """
    metadata_file = directory / DCP_METADATA
    _size(metadata_file)
    try:
        metadata = FileSystemReader(str(directory)).read_metadata()
    except Exception as error:
        problem = f"does not load ({type(error).__name__}: {error})"
        raise DamagedFile(metadata_file, problem) from error
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        file = directory / name
        if not file.is_file():
            raise DamagedFile(file, f"missing; {metadata_file} refers to it")
        size = file.stat().st_size
        if size < end:
            raise DamagedFile(file, f"cut short: {size} bytes, {metadata_file.name} needs {end}")


def file_sizes(directory: Path, leave_out: Sequence[str] = ()) -> dict[str, int]:
    """The size in bytes of every file under ``directory``, by path relative to it (``/``
    separated), leaving out the relative paths ``leave_out``."""
    sizes: dict[str, int] = {}
    for root, _, names in os.walk(directory):
        for name in names:
            file = Path(root) / name
            relative = file.relative_to(directory).as_posix()
            if relative not in leave_out:
                sizes[relative] = file.stat().st_size
    return dict(sorted(sizes.items()))


def check_file_sizes(directory: Path, sizes: Mapping[str, int], listed_in: str) -> None:
    """Check that every file ``sizes`` lists (relative to ``directory``) is there with the
    size it had when it was written; ``listed_in`` names the record, for the message.

    Raises:
        DamagedFile: the first file that is missing or has another size.
    """
    for relative, expected in sorted(sizes.items()):
        file = directory / relative
        if not file.is_file():
            raise DamagedFile(file, f"missing; {listed_in} lists it ({expected} bytes)")
        size = file.stat().st_size
        if size == 0 < expected:
            raise DamagedFile(file, f"empty (0 bytes; {expected} when saved, {listed_in})")
        if size != expected:
            shorter = "cut short: " if size < expected else ""
            raise DamagedFile(file, f"{shorter}{size} bytes, {expected} when saved ({listed_in})")


def write_arrays(file: Path, arrays: Mapping[str, Any], metadata: Mapping[str, str]) -> None:
    """Write named numpy ``arrays`` and string ``metadata`` to ``file`` as safetensors (no
    pickle: a checkpoint read back runs no code)."""
    from safetensors.numpy import save_file

    save_file(dict(arrays), str(file), metadata=dict(metadata))


def read_arrays(file: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """The named numpy arrays and the string metadata of safetensors ``file``
    (:func:`write_arrays`).

    Raises:
        DamagedFile: the file is missing, cut short or not safetensors.
    """
    from safetensors import SafetensorError, safe_open

    check_safetensors(file)
    try:
        with safe_open(str(file), framework="np") as opened:
            metadata = dict(opened.metadata() or {})
            names = opened.keys()  # safe_open is no mapping: it has keys() and get_tensor()
            return {key: opened.get_tensor(key) for key in names}, metadata
    except (SafetensorError, OSError) as error:
        raise DamagedFile(file, f"does not load ({type(error).__name__}: {error})") from error
