"""Tree attention: a transformers attention backend that runs a stock model on one packed row.

A :class:`~asyncgrpo.core.packing.PackedRow` lays a micro-batch's samples out as a prefix trie
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

Backends (all compute the same function; see :func:`default_backend` for the choice, on CPU
row by row by a cost model measured here):

* ``"dense"``: the reference; ``PackedRow.dense_mask()`` through SDPA. Memory ``T²``.
* ``"segments"``: the varlen view, looped over segments: each segment's queries against its
  gathered path keys (``kv_indices``, ``cu_seqlens_k``), causal, bottom-right aligned. Memory
  ``sum_g Lq_g · Lk_g``, the tree's true attention footprint.
* ``"flash_varlen"`` (CUDA): the same gathered varlen view through flash-attention's
  ``flash_attn_varlen_func`` from the ``kernels`` hub (flash-attn3 on Hopper, flash-attn4 on
  Blackwell); bf16/fp16 only.
* ``"flex"`` (CUDA): torch FlexAttention with a block mask from :func:`tree_mask_mod`.
* ``"torch_varlen"`` (CUDA): the gathered varlen view through torch's own
  ``torch.nn.attention.varlen.varlen_attn`` (flash-attention inside torch, no ``kernels``
  download); bf16/fp16 only, where the installed torch offers it.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from collections.abc import Callable
from typing import Literal, get_args

import attrs
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from transformers import AttentionInterface, PreTrainedModel

from asyncgrpo.adapters.architecture_support import check_tree_packing_support
from asyncgrpo.adapters.gated_delta_net import enable_tree_gated_delta_net
from asyncgrpo.core.attention_choice import cheaper_backend
from asyncgrpo.core.flops import query_key_pairs
from asyncgrpo.core.packing import PackedRow

TREE_ATTENTION = "asyncgrpo_tree"
LAYOUT_KWARG = "tree_layout"

Backend = Literal["dense", "segments", "flash_varlen", "flex", "torch_varlen"]
BACKENDS: tuple[Backend, ...] = get_args(Backend)

# Hub repositories of flash-attention with a varlen entry point, with the kernel versions
# transformers 5.19 pins for them: flash-attn3 for Hopper (sm90), flash-attn4 for Blackwell.
_FLASH_ATTN3 = ("kernels-community/flash-attn3", 1)
_FLASH_ATTN4 = ("kernels-community/flash-attn4", 0)
_GPU_EXTRA = "pip install asyncgrpo[gpu]"


class BackendUnavailableError(RuntimeError):
    """A tree-attention backend cannot run here (no CUDA device, no ``kernels``, wrong GPU)."""


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


@attrs.frozen
class ModelAttention:
    """What the CPU backend choice needs from the model: the query width (``heads x
    head_dim``) and the attention layers one forward runs (defaults: the tiny test model)."""

    query_width: int = 128
    layers: int = 2

    @classmethod
    def of(cls, model: PreTrainedModel) -> ModelAttention:
        config = model.config.get_text_config()
        heads = int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        return cls(heads * head_dim, int(config.num_hidden_layers))


def default_backend(
    device: torch.device | str, row: PackedRow | None = None, shape: ModelAttention | None = None
) -> Backend:
    """The backend for ``device`` (and, on CPU, for ``row`` in a model of ``shape``).

    CPU: by cost, row by row (:func:`asyncgrpo.core.attention_choice.cheaper_backend`, measured
    here): ``"dense"`` for rows of many short samples (one SDPA call instead of one per
    segment), ``"segments"`` for rows of few long ones (the tree's pairs instead of ``T²``);
    both are exact. Without a row, ``"segments"``: it consumes the same gathered varlen view
    (``kv_indices``, ``cu_seqlens``) as the GPU kernel, and its memory follows the tree's
    attention pairs rather than ``T²``.
    CUDA: ``"flash_varlen"`` when its kernel loads on this GPU (the first call may download
    it from the Hugging Face hub through ``kernels``), else ``"flex"``.
    """
    device = torch.device(device)
    if device.type != "cuda":
        if row is None:
            return "segments"
        shape = shape or ModelAttention()
        pairs = query_key_pairs(row.cu_seqlens_q, row.cu_seqlens_k)
        return cheaper_backend(row.num_tokens, row.num_segments, pairs,  # type: ignore[return-value]
                               shape.query_width, shape.layers)  # fmt: skip
    try:
        _flash_varlen_function(device)
    except BackendUnavailableError:
        return "flex"
    return "flash_varlen"


def check_backend(backend: str, device: torch.device | str) -> None:
    """Raise :class:`BackendUnavailableError` (or ``ValueError`` for an unknown name) unless
    ``backend`` can run on ``device``; loads the flash kernel for ``"flash_varlen"``."""
    device = torch.device(device)
    if backend not in BACKENDS:
        raise ValueError(f"unknown tree attention backend {backend!r}; choose one of {BACKENDS}")
    if backend == "flash_varlen":
        _flash_varlen_function(device)
    elif backend == "torch_varlen":
        _torch_varlen_function(device)
    elif backend == "flex" and device.type != "cuda":
        raise BackendUnavailableError(
            f"tree attention backend 'flex' needs a CUDA device, got {device} (FlexAttention has "
            "no CPU backward); use 'segments' or 'dense' on CPU"
        )


def tree_layout(
    row: PackedRow,
    device: torch.device | str,
    backend: Backend | None = None,
    shape: ModelAttention | None = None,
) -> TreeLayout:
    """The row's :class:`TreeLayout` on ``device`` for ``backend`` (default: by device and,
    on CPU, by the row's cost in a model of ``shape``; see :func:`default_backend`).

    Raises:
        BackendUnavailableError: ``backend`` cannot run on ``device``.
    """
    device = torch.device(device)
    backend = backend or default_backend(device, row, shape)
    check_backend(backend, device)
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
        segment_spans=_segment_spans(cu_q, cu_k),
        dense_mask=torch.tensor(row.dense_mask(), device=device) if backend == "dense" else None,
        block_mask=_tree_block_mask(row, device) if backend == "flex" else None,
    )


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
        kwargs: must hold ``tree_layout``, the row's :class:`TreeLayout`; ``sliding_window``
            must be ``None``.

    Returns:
        ``(output, None)``: float [1, T, H, D], and no attention weights.
    """
    if kwargs.get("s_aux") is not None:
        raise ValueError(
            f"{type(module).__name__} passes attention sinks (s_aux); tree attention does not "
            "implement them"
        )
    layout = _layout_from(kwargs)
    _check_call(query, attention_mask, dropout, kwargs.get("sliding_window"), layout)
    q, k, v = query[0], key[0], value[0]
    out = _ATTEND[layout.backend](q, k, v, layout, scaling)
    return out.unsqueeze(0), None


def enable_tree_attention(model: PreTrainedModel) -> PreTrainedModel:
    """Switch ``model``'s attention layers to :data:`TREE_ATTENTION`; returns ``model``.

    Every forward must then pass ``tree_layout=``; switch back with
    ``model.set_attn_implementation("sdpa")`` to run unpacked batches. Gated DeltaNet layers
    (Qwen3.5, Qwen3-Next) follow the tree too (:mod:`asyncgrpo.adapters.gated_delta_net`).

    Raises:
        UnsupportedArchitectureError: a layer the tree-packed forward would compute wrongly
            (see :mod:`asyncgrpo.adapters.architecture_support`).
    """
    check_tree_packing_support(model)
    model.set_attn_implementation(TREE_ATTENTION)
    enable_tree_gated_delta_net(model)
    return model


def _dense(q: Tensor, k: Tensor, v: Tensor, layout: TreeLayout, scaling: float | None) -> Tensor:
    """q [H, T, D], k/v [H_kv, T, D] -> [T, H, D] with the boolean [T, T] mask."""
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=layout.dense_mask, scale=scaling, enable_gqa=True
    )
    return out.transpose(0, 1)


def _segments(q: Tensor, k: Tensor, v: Tensor, layout: TreeLayout, scaling: float | None) -> Tensor:
    """q [H, T, D], k/v [H_kv, T, D] -> [T, H, D], one SDPA per segment on the varlen view."""
    q_rows, k_path, v_path = _varlen_view(q, k, v, layout)
    outputs = []
    for q_start, q_end, k_start, k_end in layout.segment_spans:
        causal = _bottom_right_causal(q_end - q_start, k_end - k_start, q.device)
        outputs.append(
            F.scaled_dot_product_attention(
                q_rows[q_start:q_end].transpose(0, 1),
                k_path[k_start:k_end].transpose(0, 1),
                v_path[k_start:k_end].transpose(0, 1),
                attn_mask=causal,
                scale=scaling,
                enable_gqa=True,
            ).transpose(0, 1)
        )
    return torch.cat(outputs)


def _flash_varlen(
    q: Tensor, k: Tensor, v: Tensor, layout: TreeLayout, scaling: float | None
) -> Tensor:
    """q [H, T, D], k/v [H_kv, T, D] -> [T, H, D] through ``flash_attn_varlen_func``."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(
            f"tree attention backend 'flash_varlen' needs bf16 or fp16 activations, got "
            f"{q.dtype}: load the model with dtype='bfloat16', or choose backend 'flex'"
        )
    q_rows, k_path, v_path = _varlen_view(q, k, v, layout)
    out = _flash_varlen_function(q.device)(
        q_rows,
        k_path,
        v_path,
        cu_seqlens_q=layout.cu_seqlens_q,
        cu_seqlens_k=layout.cu_seqlens_k,
        max_seqlen_q=layout.max_seqlen_q,
        max_seqlen_k=layout.max_seqlen_k,
        softmax_scale=scaling,
        causal=True,
    )
    return out[0] if isinstance(out, tuple) else out


def _torch_varlen(
    q: Tensor, k: Tensor, v: Tensor, layout: TreeLayout, scaling: float | None
) -> Tensor:
    """q [H, T, D], k/v [H_kv, T, D] -> [T, H, D] through torch's ``varlen_attn``, causal and
    bottom-right aligned like flash-attention (the segment's queries end its path)."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(
            f"tree attention backend 'torch_varlen' needs bf16 or fp16 activations, got {q.dtype}"
        )
    q_rows, k_path, v_path = _varlen_view(q, k, v, layout)
    attend = _torch_varlen_function(q.device)
    options = inspect.signature(attend).parameters
    if "enable_gqa" not in options and k_path.shape[1] != q_rows.shape[1]:
        repeats = q_rows.shape[1] // k_path.shape[1]
        k_path, v_path = k_path.repeat_interleave(repeats, 1), v_path.repeat_interleave(repeats, 1)
    kwargs: dict[str, object] = {"scale": scaling}
    kwargs.update({"enable_gqa": True} if "enable_gqa" in options else {})
    kwargs.update({"is_causal": True} if "is_causal" in options else {"window_size": (-1, 0)})
    out = attend(q_rows, k_path, v_path, layout.cu_seqlens_q, layout.cu_seqlens_k,
                 layout.max_seqlen_q, layout.max_seqlen_k, **kwargs)  # fmt: skip
    return out[0] if isinstance(out, tuple) else out


def _flex(q: Tensor, k: Tensor, v: Tensor, layout: TreeLayout, scaling: float | None) -> Tensor:
    """q [H, T, D], k/v [H_kv, T, D] -> [T, H, D] through compiled FlexAttention."""
    out = _compiled_flex_attention()(
        q.unsqueeze(0),
        k.unsqueeze(0),
        v.unsqueeze(0),
        block_mask=layout.block_mask,
        scale=scaling,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


_ATTEND: dict[str, Callable[[Tensor, Tensor, Tensor, TreeLayout, float | None], Tensor]] = {
    "dense": _dense,
    "segments": _segments,
    "flash_varlen": _flash_varlen,
    "flex": _flex,
    "torch_varlen": _torch_varlen,
}


def _varlen_view(q: Tensor, k: Tensor, v: Tensor, layout: TreeLayout) -> tuple[Tensor, ...]:
    """The varlen kernels' inputs: queries [T, H, D] in row order and keys/values
    [P, H_kv, D] gathered along ``kv_indices`` (each segment's path, segment by segment)."""
    k_rows, v_rows = k.transpose(0, 1), v.transpose(0, 1)
    return q.transpose(0, 1), k_rows[layout.kv_indices], v_rows[layout.kv_indices]


def _segment_spans(cu_q: np.ndarray, cu_k: np.ndarray) -> tuple[tuple[int, int, int, int], ...]:
    """Per segment ``(q_start, q_end, k_start, k_end)`` from the cumulative lengths [S + 1]."""
    spans = np.stack([cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]], axis=1)
    return tuple(tuple(span) for span in spans.tolist())


def _bottom_right_causal(q_len: int, k_len: int, device: torch.device) -> Tensor:
    """bool [q_len, k_len]: query ``i`` sees keys ``j <= k_len - q_len + i`` (the segment's
    queries are the last ``q_len`` positions of its path)."""
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(k_len - q_len)


def _subtree_ends(parents: np.ndarray) -> np.ndarray:
    """int64 [S]: one past the last segment of each segment's subtree (pre-order numbering)."""
    ends = np.arange(1, len(parents) + 1, dtype=np.int64)
    for segment in range(len(parents) - 1, -1, -1):
        parent = parents[segment]
        if parent >= 0:
            ends[parent] = max(ends[parent], ends[segment])
    return ends


def _tree_block_mask(row: PackedRow, device: torch.device) -> BlockMask:
    t = row.num_tokens
    return create_block_mask(tree_mask_mod(row, device), None, None, t, t, device=device)


@functools.cache
def _compiled_flex_attention() -> Callable[..., Tensor]:
    return torch.compile(flex_attention)


@functools.cache
def _flash_varlen_function(device: torch.device) -> Callable[..., Tensor]:
    """``flash_attn_varlen_func`` from the hub kernel for ``device``'s GPU generation."""
    missing = [
        *(["a CUDA device"] if device.type != "cuda" else []),
        *(["the `kernels` package"] if importlib.util.find_spec("kernels") is None else []),
    ]
    if missing:
        raise BackendUnavailableError(
            "tree attention backend 'flash_varlen' needs a CUDA device and the `kernels` package "
            f"({_GPU_EXTRA}); missing on device {device}: {' and '.join(missing)}"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        raise BackendUnavailableError(
            f"tree attention backend 'flash_varlen' needs a Hopper (sm90) or Blackwell (sm100+) "
            f"GPU, this one is sm{major}{minor}; choose backend 'flex'"
        )
    return _load_flash_kernel(*(_FLASH_ATTN3 if major == 9 else _FLASH_ATTN4))


def _torch_varlen_function(device: torch.device) -> Callable[..., Tensor]:
    """torch's ``varlen_attn`` (torch >= 2.10, CUDA)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as error:
        raise BackendUnavailableError(
            f"tree attention backend 'torch_varlen' needs torch >= 2.10 "
            f"(torch.nn.attention.varlen), this is torch {torch.__version__}; choose 'flex'"
        ) from error
    if device.type != "cuda":
        raise BackendUnavailableError(
            f"tree attention backend 'torch_varlen' needs a CUDA device, got {device}; use "
            "'segments' or 'dense' on CPU"
        )
    return varlen_attn


@functools.cache
def _load_flash_kernel(repo: str, version: int) -> Callable[..., Tensor]:
    from kernels import get_kernel

    try:
        kernel = get_kernel(repo, version=version)
    except Exception as error:  # the hub, a build mismatch or a missing binary
        raise BackendUnavailableError(
            f"tree attention backend 'flash_varlen' could not load {repo} (version {version}) "
            f"with `kernels`: {error}; choose backend 'flex' or fix the kernel install"
        ) from error
    return kernel.flash_attn_varlen_func


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
    sliding_window: object,
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
    if sliding_window is not None:
        raise ValueError(
            f"tree attention does not implement sliding-window layers (window {sliding_window})"
        )


AttentionInterface.register(TREE_ATTENTION, tree_attention_forward)
