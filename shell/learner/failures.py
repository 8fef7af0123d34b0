"""The learner's failures that end a run, each named with its cause and its fix: a row that
does not fit in memory, and weights that diverged.

**Out of memory.** The forward and backward of a micro-batch's row are where a step's memory
peaks (the activations grow with the row's tokens). torch's own errors there say how many
bytes it wanted, not why: on a CPU ``RuntimeError: ... DefaultCPUAllocator: can't allocate
memory`` (a host near its limit, or ``RLIMIT_AS``), on a GPU ``torch.OutOfMemoryError``, from
numpy or Python a ``MemoryError``. :func:`out_of_memory_named` turns each into a
:class:`RowOutOfMemoryError` naming the row's tokens, ``token_budget`` and
``gradient_checkpointing`` and what to change (:func:`~asyncgrpo.core.packing.memory.
out_of_memory_message`). The row is not lowered by the learner: rows are packed before the
step, from samples generated under ``token_budget``, and a smaller row would need a new plan
and a different step; the run stops and says which setting to lower. Checkpoints are written
between steps, so the last one is whole.

**Diverging weights.** :class:`DivergedError` (:mod:`asyncgrpo.core.run.divergence`).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from asyncgrpo.core.packing.memory import RowSize, out_of_memory_message
from asyncgrpo.core.packing.tree import PackedRow

CPU_OUT_OF_MEMORY = (
    "DefaultCPUAllocator: can't allocate memory",
    "DefaultCPUAllocator: not enough memory",
)
"""What torch's CPU allocator says when ``malloc`` fails (``posix_memalign`` then
``alloc_cpu.cpp``'s check, or ``TORCH_CHECK_ALLOC``), as a ``RuntimeError``."""


class RowOutOfMemoryError(RuntimeError):
    """A packed row's forward and backward ran out of memory; the message names the row's
    tokens, ``token_budget``, ``gradient_checkpointing`` and the fix."""


class DivergedError(RuntimeError):
    """The weights diverged: ``stop_after_nonfinite_steps`` steps in a row had a non-finite
    loss or gradient norm (the last finite weights are in a checkpoint), or an optimizer step
    made the weights themselves non-finite; the message suggests a lower ``learning_rate``."""


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation failure (CUDA's or the CPU's), not another error.

    Example:
        >>> is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate"))
        True
        >>> is_out_of_memory(RuntimeError("shape mismatch"))
        False
    """
    if isinstance(error, torch.OutOfMemoryError | MemoryError):
        return True
    return isinstance(error, RuntimeError) and any(s in str(error) for s in CPU_OUT_OF_MEMORY)


def row_size(row: PackedRow) -> RowSize:
    """The figures of ``row`` the out-of-memory error names."""
    lengths = [len(sample.sequence) for sample in row.samples] or [len(row.input_ids)]
    return RowSize(len(row.input_ids), len(row.target_ids), len(row.samples), max(lengths))


@contextmanager
def out_of_memory_named(
    row: PackedRow,
    token_budget: int | None,
    checkpointing: bool,
    device: torch.device,
    release: Callable[[], None],
) -> Iterator[None]:
    """Run a row's forward and backward; an allocation failure becomes a
    :class:`RowOutOfMemoryError` (other errors pass as they are).

    Args:
        row: the row being forwarded (the dummy row of a process without samples, too).
        token_budget: the config's (None: rows fill up to the server's ``max_model_len``).
        checkpointing: whether the learner recomputes its layers (its decision at start).
        device: where it trains.
        release: called first, to drop what the failed step holds (its gradients).

    The failed step's frames are cleared (their activations freed) before the error is
    raised, so the run's teardown does not need memory the host no longer has.
    """
    try:
        yield
    except (MemoryError, RuntimeError) as error:
        if not is_out_of_memory(error):
            raise
        traceback.clear_frames(error.__traceback__)
        release()
        said = next((line for line in str(error).splitlines() if line.strip()), "")
        cause = f"{type(error).__name__}: {said.strip()[:300]}"
        message = out_of_memory_message(
            row_size(row), token_budget, checkpointing, str(device), cause
        )
        raise RowOutOfMemoryError(message) from error
