"""One packed row's tree-attention layout: what every backend of
:mod:`asyncgrpo.adapters.kernels.backends` reads.

A :class:`TreeLayout` is built once per forward from a
:class:`~asyncgrpo.core.packing.tree.PackedRow` (by
:func:`asyncgrpo.adapters.kernels.attention.tree_layout`) and shared by every attention layer: the
row's gathered varlen view (``kv_indices``, ``cu_seqlens``), per-segment spans, and the dense or
FlexAttention mask where its backend needs one. :func:`tree_mask_mod` is the tree's FlexAttention
predicate.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args

import attrs
import numpy as np
import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from asyncgrpo.core.packing.tree import PackedRow

Backend = Literal["dense", "segments", "flash_varlen", "flex", "torch_varlen"]
BACKENDS: tuple[Backend, ...] = get_args(Backend)


@attrs.frozen(eq=False)
class TreeLayout:
    """One packed row's attention layout on the model's device, built once per forward.

    Attributes:
        backend: the backend that attends with this layout.
        num_tokens: ``T``, the row's forwarded tokens.
        kv_indices: long [P], for each segment in order, the row indices of its path's keys
            (``P`` = summed path lengths).
        cu_seqlens_q, cu_seqlens_k: int32 [S + 1], cumulative segment and path lengths.
        max_seqlen_q, max_seqlen_k: the longest segment and the longest path (tokens).
        segment_spans: per segment ``(q_start, q_end, k_start, k_end)`` on the host: its query
            rows and its slice of ``kv_indices``.
        dense_mask: bool [T, T] (``"dense"`` only), True where query row attends to key row.
        block_mask: the FlexAttention block mask (``"flex"`` only).
    """

    backend: Backend
    num_tokens: int
    kv_indices: Tensor
    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    segment_spans: tuple[tuple[int, int, int, int], ...]
    dense_mask: Tensor | None = None
    block_mask: BlockMask | None = None


MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def tree_mask_mod(row: PackedRow, device: torch.device | str) -> MaskMod:
    """FlexAttention's ``mask_mod(batch, head, q_idx, kv_idx)`` for the row's tree.

    Query row ``q`` sees key row ``k`` when ``k <= q`` and ``k``'s segment is ``q``'s or one of
    its ancestors. Segments are numbered depth first (pre-order), so the subtree of segment
    ``a`` is the index range ``[a, subtree_end[a])`` and the ancestor test is two comparisons.
    Equals ``row.dense_mask()`` on the full grid (the tests check it on CPU).
    """
    segment = torch.tensor(row.segment_ids, dtype=torch.long, device=device)
    subtree_end = torch.tensor(_subtree_ends(row.segment_parents), device=device)

    def mask_mod(batch: Tensor, head: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        q_segment, kv_segment = segment[q_idx], segment[kv_idx]
        return (kv_idx <= q_idx) & (kv_segment <= q_segment) & (q_segment < subtree_end[kv_segment])

    return mask_mod


def segment_spans(cu_q: np.ndarray, cu_k: np.ndarray) -> tuple[tuple[int, int, int, int], ...]:
    """Per segment ``(q_start, q_end, k_start, k_end)`` from the cumulative lengths [S + 1]."""
    spans = np.stack([cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]], axis=1)
    return tuple(tuple(span) for span in spans.tolist())


def tree_block_mask(row: PackedRow, device: torch.device) -> BlockMask:
    """FlexAttention's block mask of the row's tree (:func:`tree_mask_mod`), ``T x T``."""
    t = row.num_tokens
    return create_block_mask(tree_mask_mod(row, device), None, None, t, t, device=device)


def _subtree_ends(parents: np.ndarray) -> np.ndarray:
    """int64 [S]: one past the last segment of each segment's subtree (pre-order numbering)."""
    ends = np.arange(1, len(parents) + 1, dtype=np.int64)
    for segment in range(len(parents) - 1, -1, -1):
        parent = parents[segment]
        if parent >= 0:
            ends[parent] = max(ends[parent], ends[segment])
    return ends
