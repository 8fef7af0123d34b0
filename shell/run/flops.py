"""``perf/fwd_bwd_mfu``: the model FLOPs of a step's rows over fwd+bwd time and a peak.

The FLOP count is :mod:`asyncgrpo.core.packing.flops`; this module reads the model's shape from its
config and finds the peak: a listed GPU's datasheet peak for the training dtype, otherwise (a
CPU, an unlisted GPU) the best of a few square matmuls timed at start with the trainer's
threads, which is what this machine actually reaches, not a datasheet figure.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from asyncgrpo.core.metrics import Observation, ratio
from asyncgrpo.core.packing.flops import (
    gpu_peak_flops,
    matmul_flops,
    model_shape,
    query_key_pairs,
    train_flops,
)
from asyncgrpo.core.packing.tree import PackedRow

PROBE_SIZE = 512
PROBE_REPEATS = 8


def measured_peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of the fastest of a few ``PROBE_SIZE``-square matmuls on ``device``."""
    a = torch.randn(PROBE_SIZE, PROBE_SIZE, device=device, dtype=dtype)
    b = torch.randn(PROBE_SIZE, PROBE_SIZE, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(PROBE_REPEATS):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return matmul_flops(PROBE_SIZE) / max(best, 1e-9)


class FlopsMeter:
    """Model FLOPs of rows and the peak they are measured against (one process's device).

    Attributes:
        shape: the model's shape.
        peak_flops: FLOP/s of one process's device.
        peak_source: ``"datasheet"`` or ``"matmul"`` (measured at start).
    """

    def __init__(self, config: Any, device: torch.device, bf16: bool) -> None:
        self.shape = model_shape(config)
        listed = (
            gpu_peak_flops(torch.cuda.get_device_name(device), bf16)
            if (device.type == "cuda")
            else None
        )
        self.peak_source = "datasheet" if listed else "matmul"
        dtype = torch.bfloat16 if bf16 else torch.float32
        self.peak_flops = listed or measured_peak_flops(device, dtype)

    def of_rows(self, rows: Sequence[PackedRow]) -> float:
        """Forward and backward FLOPs of ``rows``."""
        forwarded = sum(r.num_tokens for r in rows)
        trained = sum(len(r.target_ids) for r in rows)
        pairs = sum(query_key_pairs(r.cu_seqlens_q, r.cu_seqlens_k) for r in rows)
        return train_flops(self.shape, forwarded, trained, pairs)

    def mfu(
        self, step_flops: float, fwd_bwd_s: float | None, processes: int
    ) -> tuple[Observation, ...]:
        """``perf/fwd_bwd_mfu`` of a step: its rows' model FLOPs (``step_flops``, all
        processes) over its fwd+bwd seconds x one process's peak x ``processes``; nothing
        without a time or FLOPs."""
        if not fwd_bwd_s or not step_flops:
            return ()
        capacity = fwd_bwd_s * self.peak_flops * processes
        return (ratio("perf/fwd_bwd_mfu", step_flops, capacity),)
