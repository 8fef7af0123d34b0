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
        positions: long [T], each row's position in its own sample (its trie depth): sliding
            windows and chunks count along it.
        dense_mask: bool [T, T] (``"dense"`` only), True where query row attends to key row.
        block_masks: FlexAttention block masks (``"flex"`` only), one per ``(window, chunk)``
            of the model's layers (:attr:`AttentionParts.mask_shape
            <asyncgrpo.adapters.kernels.attention_parts.AttentionParts.mask_shape>`).
    """

    backend: Backend
    num_tokens: int
    kv_indices: Tensor
    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    segment_spans: tuple[tuple[int, int, int, int], ...]
    positions: Tensor
    dense_mask: Tensor | None = None
    block_masks: dict[MaskShape, BlockMask] = attrs.field(factory=dict)


MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]

compiled_block_mask = torch.compile(create_block_mask, dynamic=True)
"""``create_block_mask`` compiled, once for every row length (``dynamic``): the mask is
evaluated block by block. Eagerly it is a ``T x T`` tensor with ``T x T`` intermediates for
every comparison of :func:`tree_mask_mod` (a GiB each at 32k tokens), and each row waits for
it; a new row length or tree does not recompile it
(``tests/adapters/test_attention.py`` counts the graphs on the CPU)."""
MaskShape = tuple[int | None, int | None]
"""``(window, chunk)`` of a layer's mask, in positions of each token's own sample."""


def tree_mask_mod(
    row: PackedRow, device: torch.device | str, mask_shape: MaskShape = (None, None)
) -> MaskMod:
    """FlexAttention's ``mask_mod(batch, head, q_idx, kv_idx)`` for the row's tree.

    Query row ``q`` sees key row ``k`` when ``k <= q`` and ``k``'s segment is ``q``'s or one of
    its ancestors. Segments are numbered depth first (pre-order), so the subtree of segment
    ``a`` is the index range ``[a, subtree_end[a])`` and the ancestor test is two comparisons.
    Equals ``row.dense_mask()`` on the full grid (the tests check it on CPU). With a
    ``mask_shape`` ``(window, chunk)``, the window and chunk of :func:`path_mask` apply too.
    """
    segment = torch.tensor(row.segment_ids, dtype=torch.long, device=device)
    subtree_end = torch.tensor(_subtree_ends(row.segment_parents), device=device)
    positions = torch.tensor(row.position_ids, dtype=torch.long, device=device)

    def mask_mod(batch: Tensor, head: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        q_segment, kv_segment = segment[q_idx], segment[kv_idx]
        tree = (kv_idx <= q_idx) & (kv_segment <= q_segment) & (q_segment < subtree_end[kv_segment])
        return tree & path_mask(positions[q_idx], positions[kv_idx], mask_shape)

    return mask_mod


def path_mask(q_position: Tensor, k_position: Tensor, mask_shape: MaskShape) -> Tensor:
    """True where a query at ``q_position`` may see a key at ``k_position`` of its own path
    (positions in the token's own sample, broadcast against each other) under ``mask_shape``
    ``(window, chunk)``: ``q - window < k`` and ``k // chunk == q // chunk``, as transformers'
    ``sliding_window_overlay`` and ``chunked_overlay`` count along one unpacked sample."""
    window, chunk = mask_shape
    allowed = torch.ones_like(q_position - k_position, dtype=torch.bool)
    if window is not None:
        allowed = allowed & (k_position > q_position - window)
    if chunk is not None:
        allowed = allowed & (
            torch.div(k_position, chunk, rounding_mode="floor")
            == torch.div(q_position, chunk, rounding_mode="floor")
        )
    return allowed


def segment_spans(cu_q: np.ndarray, cu_k: np.ndarray) -> tuple[tuple[int, int, int, int], ...]:
    """Per segment ``(q_start, q_end, k_start, k_end)`` from the cumulative lengths [S + 1]."""
    spans = np.stack([cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]], axis=1)
    return tuple(tuple(span) for span in spans.tolist())


def tree_block_mask(
    row: PackedRow, device: torch.device, mask_shape: MaskShape = (None, None)
) -> BlockMask:
    """FlexAttention's block mask of the row's tree (:func:`tree_mask_mod`), ``T x T``, with
    the window and chunk of ``mask_shape``: built by :data:`compiled_block_mask` on a GPU;
    on the CPU, where Flex does not train (its rows there are tests' and checks' small ones),
    eagerly, which costs less than inductor's compile of it (about 30 s a process)."""
    t = row.num_tokens
    mask_mod = tree_mask_mod(row, device, mask_shape)
    build = compiled_block_mask if torch.device(device).type == "cuda" else create_block_mask
    return build(mask_mod, None, None, t, t, device)


def _subtree_ends(parents: np.ndarray) -> np.ndarray:
    """int64 [S]: one past the last segment of each segment's subtree (pre-order numbering)."""
    ends = np.arange(1, len(parents) + 1, dtype=np.int64)
    for segment in range(len(parents) - 1, -1, -1):
        parent = parents[segment]
        if parent >= 0:
            ends[parent] = max(ends[parent], ends[segment])
    return ends
