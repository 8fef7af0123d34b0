"""What immutable records hold: a read-only, picklable mapping (``MappingProxyType`` cannot
be pickled, and records cross the rollout process boundary), and read-only numpy arrays
compared by value."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

import attrs
import numpy as np

ARRAY_EQ = attrs.cmp_using(eq=np.array_equal)
"""The comparison of an attrs field holding a numpy array: equal arrays, not the same object."""


def read_only(array: np.ndarray) -> np.ndarray:
    """``array``, made read-only in place (a frozen record's arrays cannot be written).

    Example:
        >>> read_only(np.zeros(2)).flags.writeable
        False
    """
    array.setflags(write=False)
    return array


K = TypeVar("K")
V = TypeVar("V")


class FrozenMap(Mapping[K, V]):
    """A mapping that cannot change after it is built.

    Example:
        >>> m = FrozenMap({1: -0.5})
        >>> m[1], dict(m), m == {1: -0.5}
        (-0.5, {1: -0.5}, True)
    """

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[K, V] | None = None) -> None:
        self._data: dict[K, V] = dict(data or {})

    def __getitem__(self, key: K) -> V:
        return self._data[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"FrozenMap({self._data!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrozenMap, (self._data,))
