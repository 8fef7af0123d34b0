"""Stream order between the tensors a weight push reads and the CUDA streams that send them.

vLLM's NCCL engine packs the weights on side streams it caches per device
(``packed_nccl_broadcast_producer``), and a side stream does not wait for work queued on any
other stream: the optimizer step, or the copy of a snapshot, may still be running on the
trainer's stream when the packing reads the tensor. The server would then get stale or half
written weights, and nothing would say so.

The remedy is the one CUDA prescribes: record an event on the stream that wrote the tensors
(:func:`record_ready`), and make whichever stream reads them wait for it
(:func:`stream_ordered`). The wait is queued on the device, so the trainer's thread does not
block. On a CPU (the gloo engine, the disk path) both are no-ops.

Example:
    >>> import torch
    >>> weights = [("w", torch.ones(2))]
    >>> ready = record_ready(torch.device("cpu"))  # None: nothing to order on a CPU
    >>> [name for name, _ in stream_ordered(weights, ready)]
    ['w']
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


def record_ready(device: torch.device) -> torch.cuda.Event | None:
    """An event recorded on ``device``'s current stream now: it completes once everything
    queued there so far (an optimizer step, a copy) has run. ``None`` on a CPU."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def stream_ordered(
    pairs: Iterable[tuple[str, torch.Tensor]], ready: torch.cuda.Event | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``pairs``; before each pair is taken from them, the stream current at that moment
    (a sender's side stream, when it packs) waits for ``ready``.

    The wait comes before the pair is taken, not after: taking it may itself queue work that
    reads the weights on the current stream (an FSDP gather, a cast to the export dtype).
    Waiting at every pair, not once, matters too: a sender that packs on several streams (vLLM
    rotates two) makes each of them current in turn while it iterates."""
    pairs = iter(pairs)
    while True:
        if ready is not None:
            torch.cuda.current_stream().wait_event(ready)
        pair = next(pairs, None)
        if pair is None:
            return
        yield pair
