"""The byte layout of a weight chunk: tensors back to back in one uint8 buffer, each starting
:data:`ALIGN_BYTES`-aligned, so that any dtype can be viewed back out of it without a copy.

The ``asyncgrpo_gloo`` engine sends its chunks in this layout, and ``benchmarks/gpu_check.py``
checks the weight stream's round trip with it on a machine without vLLM (which the engine's
module imports); this module needs only torch.

Example:
    >>> import torch
    >>> tensors = [torch.arange(3, dtype=torch.int64), torch.ones(2, dtype=torch.bfloat16)]
    >>> sizes = [padded_nbytes(t.dtype, tuple(t.shape)) for t in tensors]
    >>> sizes
    [32, 16]
    >>> [t.tolist() for _, t in unpack(pack(tensors, sizes), [("a", torch.int64, (3,)),
    ...                                                        ("b", torch.bfloat16, (2,))])]
    [[0, 1, 2], [1.0, 1.0]]
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

ALIGN_BYTES = 16


def padded_nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    """Bytes a tensor takes in a chunk: its size rounded up to :data:`ALIGN_BYTES`, so that every
    tensor starts aligned for any dtype when viewed back out of the byte buffer."""
    nbytes = math.prod(shape) * dtype.itemsize
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


def pack(tensors: Sequence[torch.Tensor], sizes: Sequence[int]) -> torch.Tensor:
    """uint8 [sum(sizes)] on the tensors' device: ``tensors`` back to back at their padded
    ``sizes`` (one ``torch.cat`` of byte views, as vLLM's NCCL packer builds its buffers)."""
    parts = []
    for tensor, size in zip(tensors, sizes, strict=True):
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        parts += [data, data.new_zeros(size - data.numel())]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def unpack(
    buffer: torch.Tensor, metas: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]
) -> list[tuple[str, torch.Tensor]]:
    """The named tensors :func:`pack` laid out in ``buffer`` (views, no copy)."""
    tensors, offset = [], 0
    for name, dtype, shape in metas:
        nbytes = math.prod(shape) * dtype.itemsize
        tensors.append((name, buffer[offset : offset + nbytes].view(dtype).reshape(shape)))
        offset += padded_nbytes(dtype, shape)
    return tensors
