"""Whether a learner on a CPU keeps the memory its step frees for the next step.

glibc's ``malloc`` serves a block of 32 MiB or more (the logits over the vocabulary, the
embedding's gradient, a decoder layer's gathered weights and gradients) with a fresh ``mmap``
and returns it to the kernel when it is freed. Every step then faults those pages in again, each
one zeroed by the kernel first: on SmolLM2-135M on one core that was about a fifth of forward
and backward (docs/benchmarks.md). Keeping freed memory (no ``mmap`` for large blocks, no trim of
the heap) is what PyTorch's CPU performance guide gets from preloading jemalloc or tcmalloc; the
process's resident memory then stays at its peak instead of falling between steps.

It is left alone when the process's allocator is chosen already: another one preloaded, or
glibc's own settings given in the environment (``MALLOC_MMAP_MAX_`` ...), and on a C library
other than glibc, whose ``mallopt`` differs.

Kept memory also grows past the step's peak: what reference cycles hold waits for Python's
rare full collections, and blocks freed in varying sizes fragment the heap (the demo's tiny
model, 2026-12-05: +34 MB per 100 steps). So every :data:`TRIM_EVERY_STEPS` steps the learner
collects the cycles and gives the heap's free part back to the kernel (``malloc_trim``); the
step after faults that part in again once.

Example:
    >>> choose_host_memory("cpu", preloaded="", malloc_environment=(), libc="glibc").retain
    True
    >>> choose_host_memory("cpu", "/usr/lib/libjemalloc.so.2", (), "glibc").reason
    'another allocator is preloaded (LD_PRELOAD=/usr/lib/libjemalloc.so.2)'
    >>> choose_host_memory("cuda", "", (), "glibc").retain
    False
"""

from __future__ import annotations

import attrs

MALLOC_ENVIRONMENT = (
    "MALLOC_MMAP_MAX_",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "GLIBC_TUNABLES",
)
"""glibc's own allocator settings in the environment: given, they are the user's choice."""


TRIM_EVERY_STEPS = 50
"""How often a learner that keeps freed memory gives its heap's free part back: with a full
collection and a trim every 50 steps the demo's trainer grew 1.7 MB per 100 steps instead of
34 (400 steps with the in-memory engine; a trim alone: 34)."""


@attrs.frozen
class HostMemoryChoice:
    """Keep freed memory in the process or not, and why (for the run's log)."""

    retain: bool
    reason: str


def choose_host_memory(
    device: str, preloaded: str, malloc_environment: tuple[str, ...], libc: str
) -> HostMemoryChoice:
    """Whether the learner's process keeps the memory a step frees.

    Args:
        device: the learner's device type (``"cpu"``, ``"cuda"``, ...); an accelerator's memory
            has its own caching allocator, and the host's matters little there.
        preloaded: ``LD_PRELOAD`` ("" when unset).
        malloc_environment: which of :data:`MALLOC_ENVIRONMENT` the environment sets.
        libc: the C library (``platform.libc_ver()[0]``, "" when unknown).
    """
    if device != "cpu":
        return HostMemoryChoice(False, f"the learner runs on {device}")
    if preloaded.strip():
        return HostMemoryChoice(False, f"another allocator is preloaded (LD_PRELOAD={preloaded})")
    if malloc_environment:
        given = ", ".join(malloc_environment)
        return HostMemoryChoice(False, f"the environment sets the allocator ({given})")
    if libc != "glibc":
        return HostMemoryChoice(False, f"the C library is {libc or 'unknown'}, not glibc")
    return HostMemoryChoice(True, "a CPU learner with glibc's malloc: freed memory is kept")


def trim_due(choice: HostMemoryChoice, step: int) -> bool:
    """Whether the learner gives its heap's free part back after optimizer step ``step``
    (counted from 1): every :data:`TRIM_EVERY_STEPS` steps where freed memory is kept, never
    where the allocator is left as it was (glibc trims its heap's top itself there).

    Example:
        >>> kept = HostMemoryChoice(True, "kept")
        >>> [step for step in range(1, 151) if trim_due(kept, step)]
        [50, 100, 150]
        >>> trim_due(HostMemoryChoice(False, "the learner runs on cuda"), 50)
        False
    """
    return choice.retain and step % TRIM_EVERY_STEPS == 0


ROLLOUT_TRIM_EVERY_S = 60.0
"""How often the rollout process gives its heap's free part back. glibc's defaults, left alone
there, trim only the heap's top: a burst of failed replies (every generation reply cut for 30 s,
chaos's ``link_truncate``) left the rollout process's heap 35-94 MB larger for the rest of the
run, all of it free (``malloc_trim`` gave back 85 of the 88 MB; 2026-12-05)."""


def rollout_trim_due(seconds_since_trim: float) -> bool:
    """Whether the rollout process gives its heap's free part back now, ``seconds_since_trim``
    after it last did (or started).

    Example:
        >>> rollout_trim_due(59.0), rollout_trim_due(60.0)
        (False, True)
    """
    return seconds_since_trim >= ROLLOUT_TRIM_EVERY_S


def server_allocator_environment(
    mmap_threshold_bytes: int | None, environment: tuple[str, ...]
) -> dict[str, str]:
    """What a vLLM server's processes get in their environment for glibc's ``malloc``: a fixed
    mmap threshold (``MALLOC_MMAP_THRESHOLD_``), unless it is ``None`` or the environment
    (the names in ``environment``) sets glibc's allocator already.

    Example:
        >>> server_allocator_environment(65536, ("PATH",))
        {'MALLOC_MMAP_THRESHOLD_': '65536'}
        >>> server_allocator_environment(65536, ("GLIBC_TUNABLES",))
        {}
    """
    if mmap_threshold_bytes is None or any(name in environment for name in MALLOC_ENVIRONMENT):
        return {}
    return {"MALLOC_MMAP_THRESHOLD_": str(mmap_threshold_bytes)}
