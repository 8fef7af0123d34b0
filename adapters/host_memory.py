"""The C allocator of the learner and rollout processes: freed memory kept for the next step on
a CPU learner, and the heap's free part given back now and then by both, as
:mod:`asyncgrpo.core.packing.host_memory` decides."""

from __future__ import annotations

import ctypes
import gc
import os
import platform

from asyncgrpo.core.packing.host_memory import (
    MALLOC_ENVIRONMENT,
    HostMemoryChoice,
    choose_host_memory,
)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_MAX = -4
KEEP_FREE_BYTES = 2**31 - 1
"""Free memory at the heap's top beyond this goes back to the kernel (mallopt takes an int)."""


def keep_freed_memory(device: str) -> HostMemoryChoice:
    """Decide from this process's environment, and when it says so, set glibc's ``malloc`` to
    serve large blocks from its heap and to keep what is freed there (for the whole process,
    from now on). Returns the choice, for the log."""
    choice = choose_host_memory(
        device,
        os.environ.get("LD_PRELOAD", ""),
        tuple(name for name in MALLOC_ENVIRONMENT if name in os.environ),
        platform.libc_ver()[0],
    )
    if not choice.retain:
        return choice
    mallopt = ctypes.CDLL(None).mallopt
    if mallopt(M_MMAP_MAX, 0) != 1 or mallopt(M_TRIM_THRESHOLD, KEEP_FREE_BYTES) != 1:
        return HostMemoryChoice(False, "glibc's mallopt refused the settings")
    return choice


def give_back_freed_memory() -> None:
    """Free what only reference cycles hold (a full garbage collection: the run's long-lived
    objects make Python's own full collections rare), then return the free memory of glibc's
    heaps (every arena, not only the top) to the kernel (``malloc_trim(0)``); on another C
    library, the collection only."""
    gc.collect()
    if platform.libc_ver()[0] == "glibc":
        ctypes.CDLL(None).malloc_trim(0)
