"""Tree attention: a transformers attention backend that runs a stock model on one packed row.

A :class:`~asyncgrpo.core.packing.tree.PackedRow` lays a micro-batch's samples out as a prefix trie
(batch size 1, ``T`` tokens); each token must attend to exactly its own history, the keys of
its segment's path in the trie. This module registers :data:`TREE_ATTENTION` with
``transformers.AttentionInterface``, so any model whose attention layers dispatch through that
interface (Qwen3, Llama, ...) computes tree attention once switched over::

    enable_tree_attention(model)            # or config._attn_implementation = TREE_ATTENTION
    layout = tree_layout(row, device)       # once per forward, shared by every layer
    model.model(input_ids=..., position_ids=..., use_cache=False, tree_layout=layout)

**How the layout reaches the layers.** transformers forwards unknown keyword arguments of the
model's ``forward`` down to every attention function; the :class:`TreeLayout` travels as the
``tree_layout`` keyword (:data:`LAYOUT_KWARG`), so concurrent forwards never share state.

**Why transformers' mask stays out of the way.** The mask builders (``create_causal_mask``)
return ``None`` early for any attention name without an entry in
``ALL_MASK_ATTENTION_FUNCTIONS``; :data:`TREE_ATTENTION` deliberately has none, so no ``[T, T]``
causal or "packed sequence" mask is built from the non-monotonic position ids. The attention
function refuses a mask if one ever arrives. Position ids (each token's depth in the trie) are
the caller's to pass: they feed RoPE.

The backends (``"dense"``, ``"segments"``, ``"flash_varlen"``, ``"flex"``, ``"torch_varlen"``),
their kernels and the default choice live in :mod:`asyncgrpo.adapters.kernels.backends`; the
layout they read in :mod:`asyncgrpo.adapters.kernels.layout`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor
from transformers import AttentionInterface, PreTrainedModel

from asyncgrpo.adapters.kernels.architecture_support import check_tree_packing_support
from asyncgrpo.adapters.kernels.attention_parts import call_attention_parts
from asyncgrpo.adapters.kernels.backends import (
    BackendChoice,
    ModelAttention,
    attend,
    choose_backend,
)
from asyncgrpo.adapters.kernels.gated_delta_net import enable_tree_gated_delta_net
from asyncgrpo.adapters.kernels.layout import Backend, TreeLayout, segment_spans, tree_block_mask
from asyncgrpo.adapters.kernels.mamba2 import enable_tree_mamba2
from asyncgrpo.adapters.kernels.short_conv import enable_tree_short_conv
from asyncgrpo.core.packing.tree import PackedRow

TREE_ATTENTION = "asyncgrpo_tree"
LAYOUT_KWARG = "tree_layout"


def tree_layout(
    row: PackedRow,
    device: torch.device | str,
    backend: Backend | BackendChoice | None = None,
    shape: ModelAttention | None = None,
) -> TreeLayout:
    """The row's :class:`TreeLayout` on ``device`` for ``backend``: a name (checked), the run's
    :class:`~asyncgrpo.adapters.kernels.backends.BackendChoice` (made once, probes nothing), or
    ``None`` (by device and, on CPU, by the row's cost in a model of ``shape``; see
    :func:`~asyncgrpo.adapters.kernels.backends.choose_backend`). A backend that declines an
    attention part of ``shape``'s layers gives way to one that has it
    (:meth:`~asyncgrpo.adapters.kernels.backends.BackendChoice.for_row`).

    Raises:
        ~asyncgrpo.adapters.kernels.backends.BackendUnavailableError: ``backend`` cannot run
            on ``device``.
    """
    device = torch.device(device)
    shape = shape or ModelAttention()
    choice = backend if isinstance(backend, BackendChoice) else choose_backend(device, backend)
    backend = choice.for_row(row, shape)
    cu_q = row.cu_seqlens_q.astype(np.int64)
    cu_k = row.cu_seqlens_k.astype(np.int64)
    return TreeLayout(
        backend=backend,
        num_tokens=row.num_tokens,
        kv_indices=torch.tensor(row.kv_indices, dtype=torch.long, device=device),
        cu_seqlens_q=torch.tensor(row.cu_seqlens_q, dtype=torch.int32, device=device),
        cu_seqlens_k=torch.tensor(row.cu_seqlens_k, dtype=torch.int32, device=device),
        max_seqlen_q=int(np.diff(cu_q).max()),
        max_seqlen_k=int(np.diff(cu_k).max()),
        segment_spans=segment_spans(cu_q, cu_k),
        positions=torch.tensor(row.position_ids, dtype=torch.long, device=device),
        dense_mask=torch.tensor(row.dense_mask(), device=device) if backend == "dense" else None,
        block_masks={
            mask_shape: tree_block_mask(row, device, mask_shape) for mask_shape in shape.mask_shapes
        }
        if backend == "flex"
        else {},
    )


def tree_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[Tensor, None]:
    """The attention function transformers calls in every layer under :data:`TREE_ATTENTION`.

    Args:
        module: the attention layer (unused beyond transformers' contract).
        query: float [1, H, T, D], rotary embeddings applied.
        key, value: float [1, H_kv, T, D], ``H`` a multiple of ``H_kv`` (GQA).
        attention_mask: must be ``None`` (no mask is built for this backend).
        scaling: softmax scale, ``1 / sqrt(D)`` when ``None``.
        dropout: must be 0 (attention dropout is not supported).
        kwargs: must hold ``tree_layout``, the row's :class:`TreeLayout`; the layer's
            ``sliding_window``, ``softcap`` and ``s_aux`` (sinks, float [H]) when it has them
            (:func:`~asyncgrpo.adapters.kernels.attention_parts.call_attention_parts`).

    Returns:
        ``(output, None)``: float [1, T, H, D], and no attention weights.
    """
    layout = _layout_from(kwargs)
    _check_call(query, attention_mask, dropout, layout)
    parts = call_attention_parts(module, kwargs)
    sinks = kwargs.get("s_aux")
    query = _query_temperature_along_paths(module, query, layout)
    q, k, v = query[0], key[0], value[0]
    out = attend(q, k, v, layout, scaling, parts, sinks)  # type: ignore[arg-type]
    return out.unsqueeze(0), None


def enable_tree_attention(model: PreTrainedModel) -> PreTrainedModel:
    """Switch ``model``'s attention layers to :data:`TREE_ATTENTION`; returns ``model``.

    Every forward must then pass ``tree_layout=``; switch back with
    ``model.set_attn_implementation("sdpa")`` to run unpacked batches. Gated DeltaNet layers
    (Qwen3.5, Qwen3-Next) follow the tree too (:mod:`asyncgrpo.adapters.kernels.gated_delta_net`),
    and so do LFM2's short convolutions (:mod:`asyncgrpo.adapters.kernels.short_conv`) and
    Mamba-2 mixers (:mod:`asyncgrpo.adapters.kernels.mamba2`).

    Raises:
        UnsupportedArchitectureError: a layer the tree-packed forward would compute wrongly
            (see :mod:`asyncgrpo.adapters.kernels.architecture_support`).
    """
    check_tree_packing_support(model)
    model.set_attn_implementation(TREE_ATTENTION)
    enable_tree_gated_delta_net(model)
    enable_tree_short_conv(model)
    enable_tree_mamba2(model)
    return model


@runtime_checkable
class _TemperatureTuning(Protocol):
    """Llama 4's attention temperature settings (positions, a float scale)."""

    floor_scale: float
    attn_scale: float


def _query_temperature_along_paths(
    module: torch.nn.Module, query: Tensor, layout: TreeLayout
) -> Tensor:
    """Llama 4's NoPE layers scale their queries by position (``attn_temperature_tuning``:
    ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1``) with ``p`` the row index, which
    in a packed row is not the token's position in its own sample; this rescales ``query``
    [1, H, T, D] from the row's scale to the sample's. Other layers pass through unchanged."""
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return query
    if not isinstance(module, _TemperatureTuning):
        raise ValueError(
            f"{type(module).__name__} tunes its attention temperature but has no floor_scale "
            "and attn_scale to tune it with"
        )
    floor_scale, attn_scale = module.floor_scale, module.attn_scale

    def temperature(positions: Tensor) -> Tensor:
        steps = torch.floor((positions.float() + 1.0) / floor_scale)
        return torch.log1p(steps) * attn_scale + 1.0

    # The scales in float32 as Llama 4 computes them; their ratio in the query's precision.
    precision = torch.promote_types(query.dtype, torch.float32)
    rows = torch.arange(layout.num_tokens, device=query.device)
    ratio = temperature(layout.positions).to(precision) / temperature(rows).to(precision)
    return (query * ratio.view(1, 1, -1, 1)).to(query.dtype)


def _layout_from(kwargs: dict[str, object]) -> TreeLayout:
    layout = kwargs.get(LAYOUT_KWARG)
    if not isinstance(layout, TreeLayout):
        raise ValueError(
            f"attention {TREE_ATTENTION!r} needs the keyword {LAYOUT_KWARG}=TreeLayout on every "
            f"forward, got {type(layout).__name__}: build it with tree_layout(row, device) "
            "(packed_log_probs does), or switch the model back with "
            "model.set_attn_implementation('sdpa')"
        )
    return layout


def _check_call(
    query: Tensor,
    attention_mask: Tensor | None,
    dropout: float,
    layout: TreeLayout,
) -> None:
    if query.shape[0] != 1 or query.shape[2] != layout.num_tokens:
        raise ValueError(
            f"tree attention takes one packed row: query has batch {query.shape[0]} and "
            f"{query.shape[2]} tokens, the layout has 1 and {layout.num_tokens}; forward "
            "row.input_ids[None] with the layout of the same row"
        )
    if attention_mask is not None:
        raise ValueError(
            f"attention {TREE_ATTENTION!r} got a mask from transformers; the tree layout is the "
            "mask: pass no attention_mask and register no mask function under this name"
        )
    if dropout:
        raise ValueError(f"tree attention has no attention dropout, got {dropout}: set it to 0")


AttentionInterface.register(TREE_ATTENTION, tree_attention_forward)
