"""The tree-attention backends: their kernels, what their attention keeps, whether each can run
here, and the run's choice.

Every kernel takes one packed row's query, key and value (q [H, T, D], k/v [H_kv, T, D]) and its
:class:`~asyncgrpo.adapters.kernels.layout.TreeLayout`, and returns [T, H, D];
:func:`attend` dispatches on ``layout.backend``. :func:`choose_backend` makes the run's choice
once (:class:`BackendChoice`: one backend for every row, or on CPU one per row by cost),
:func:`check_backend` refuses one that cannot run here. Whether the flash kernel loads is probed
once per device in a process; a failure is kept with its cause and raised again, never retried
(``kernels`` installed and the hub unreachable cost one download attempt, not one per forward).

Backends (all compute the same function; see :func:`choose_backend` for the default, on CPU
row by row by a cost model measured here), with what their attention keeps for the backward
(:data:`ATTENTION_MEMORY`, read by the gradient-checkpointing decision,
:mod:`asyncgrpo.core.packing.memory`):

* ``"dense"``: the reference; ``PackedRow.dense_mask()`` through SDPA. Memory ``T²``.
* ``"segments"``: the varlen view, looped over segments: each segment's queries against its
  gathered path keys (``kv_indices``, ``cu_seqlens_k``), causal, bottom-right aligned. Memory
  ``sum_g Lq_g · Lk_g``, the tree's true attention footprint (``T²`` for one long sample).
* ``"flash_varlen"`` (CUDA): the same gathered varlen view through flash-attention's
  ``flash_attn_varlen_func`` from the ``kernels`` hub (flash-attn3 on Hopper, flash-attn4 on
  Blackwell); bf16/fp16 only. Memory ``T`` (the log-sum-exp).
* ``"flex"`` (CUDA): torch FlexAttention with a block mask from
  :func:`~asyncgrpo.adapters.kernels.layout.tree_mask_mod`. Memory ``T``.
* ``"torch_varlen"`` (CUDA): the gathered varlen view through torch's own
  ``torch.nn.attention.varlen.varlen_attn`` (flash-attention inside torch, no ``kernels``
  download); bf16/fp16 only, where the installed torch offers it. Memory ``T``.

Attention parts (:mod:`~asyncgrpo.adapters.kernels.attention_parts`): ``"dense"`` and
``"segments"`` compute sliding windows and chunks (along each token's own positions), sinks and
logit soft-capping exactly, through SDPA where only the mask changes and through an explicit
softmax otherwise; ``"flex"`` computes windows and chunks in its block masks and the soft-cap as
a ``score_mod``, and declines sinks; the varlen kernels decline every part. A row whose model
needs a part its backend declines runs on one that has it
(:func:`~asyncgrpo.core.packing.attention_choice.backend_with_parts`), logged once.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from collections.abc import Callable

import attrs
import structlog
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import flex_attention
from transformers import PreTrainedModel

from asyncgrpo.adapters.kernels.attention_parts import (
    AttentionParts,
    config_setting,
    model_attention_parts,
)
from asyncgrpo.adapters.kernels.layout import BACKENDS, Backend, TreeLayout, path_mask
from asyncgrpo.core.packing.attention_choice import (
    BACKEND_PARTS,
    backend_with_parts,
    cheaper_backend,
)
from asyncgrpo.core.packing.flops import query_key_pairs
from asyncgrpo.core.packing.memory import LINEAR, QUADRATIC, AttentionMemory
from asyncgrpo.core.packing.tree import PackedRow

# Hub repositories of flash-attention with a varlen entry point, with the kernel versions
# transformers 5.19 pins for them: flash-attn3 for Hopper (sm90), flash-attn4 for Blackwell.
_FLASH_ATTN3 = ("kernels-community/flash-attn3", 1)
_FLASH_ATTN4 = ("kernels-community/flash-attn4", 0)
_GPU_EXTRA = "pip install asyncgrpo[gpu]"
_NO_PARTS = AttentionParts()

log = structlog.get_logger("asyncgrpo.tree_attention")


class BackendUnavailableError(RuntimeError):
    """A tree-attention backend cannot run here (no CUDA device, no ``kernels``, wrong GPU)."""


@attrs.frozen
class ModelAttention:
    """What the backend choice needs from the model: the query width (``heads x head_dim``),
    the attention layers one forward runs (defaults: the tiny test model), and each layer's
    attention parts (windows, chunks, sinks, soft-caps; none by default)."""

    query_width: int = 128
    layers: int = 2
    parts: tuple[AttentionParts, ...] = ()

    @classmethod
    def of(cls, model: PreTrainedModel) -> ModelAttention:
        config = model.config.get_text_config()
        heads = int(config_setting(config, "num_attention_heads") or 1)  # Mamba: none
        head_dim = int(config_setting(config, "head_dim") or config.hidden_size // heads)
        return cls(heads * head_dim, int(config.num_hidden_layers), model_attention_parts(model))

    @property
    def needed_parts(self) -> frozenset[str]:
        """Every attention part some layer has."""
        return frozenset().union(*(layer.names for layer in self.parts))

    @property
    def mask_shapes(self) -> frozenset[tuple[int | None, int | None]]:
        """The layers' distinct ``(window, chunk)``, always with the plain tree's."""
        return frozenset({(None, None), *(layer.mask_shape for layer in self.parts)})


@attrs.frozen
class BackendChoice:
    """The run's tree-attention backend, chosen once by :func:`choose_backend`.

    Attributes:
        backend: the backend of every row; ``None``: on CPU, ``"dense"`` or ``"segments"``
            for each row by cost (:func:`~asyncgrpo.core.packing.attention_choice.cheaper_backend`).
        memory: what its attention keeps for the backward (:data:`ATTENTION_MEMORY`).
        reason: why, for the run's log; names the cause when the flash kernel failed to load.
    """

    backend: Backend | None
    memory: AttentionMemory
    reason: str

    @property
    def name(self) -> str:
        """The backend's name for a log line."""
        return self.backend or "dense or segments, by row"

    def for_row(self, row: PackedRow | None, shape: ModelAttention | None = None) -> Backend:
        """The backend of ``row`` in a model of ``shape``; probes nothing. Without a row (and
        no fixed backend), ``"segments"``: it consumes the same gathered varlen view
        (``kv_indices``, ``cu_seqlens``) as the GPU kernels. A fixed backend that declines an
        attention part of ``shape``'s layers gives way to one that has it
        (:func:`~asyncgrpo.core.packing.attention_choice.backend_with_parts`), logged once."""
        shape = shape or ModelAttention()
        if self.backend is not None:
            backend, reason = backend_with_parts(self.backend, shape.needed_parts)
            if reason is not None:
                _log_backend_change(self.backend, backend, reason)
            return backend  # type: ignore[return-value]
        if row is None:
            return "segments"
        pairs = query_key_pairs(row.cu_seqlens_q, row.cu_seqlens_k)
        return cheaper_backend(
            row.num_tokens,
            row.num_segments,
            pairs,  # type: ignore[return-value]
            shape.query_width,
            shape.layers,
        )


@functools.cache
def _log_backend_change(backend: str, replacement: str, reason: str) -> None:
    """One warning per process for each change of backend (every row would repeat it)."""
    log.warning("tree attention backend changed", backend=backend, to=replacement, reason=reason)


def choose_backend(
    device: torch.device | str,
    requested: Backend | None = None,
    shape: ModelAttention | None = None,
) -> BackendChoice:
    """The tree-attention backend for a run on ``device``: ``requested`` when given (checked),
    else by device; with the model's ``shape`` (:meth:`ModelAttention.of`), one that has every
    attention part its layers need (the reason says what changed, and the memory is the
    replacement's).

    CPU: by cost, row by row (measured here): ``"dense"`` for rows of many short samples (one
    SDPA call instead of one per segment), ``"segments"`` for rows of few long ones (the tree's
    pairs instead of ``T²``); both are exact. CUDA: ``"flash_varlen"`` when its kernel loads on
    this GPU (the first probe may download it from the Hugging Face hub through ``kernels``),
    else ``"flex"``, with the kernel's failure in the reason. Call it once per run and hand the
    choice to every forward (:func:`~asyncgrpo.adapters.kernels.attention.tree_layout`).

    Raises:
        BackendUnavailableError: ``requested`` cannot run on ``device`` (the same error, with
            its cause, on every call: the probe is not retried).
        ValueError: ``requested`` is not a backend.
    """
    choice = _choose_backend(torch.device(device), requested)
    if shape is None or choice.backend is None:
        return choice
    backend, change = backend_with_parts(choice.backend, shape.needed_parts)
    if change is None:
        return choice
    memory = ATTENTION_MEMORY[backend]  # type: ignore[index]
    return BackendChoice(backend, memory, f"{choice.reason}; {change}")  # type: ignore[arg-type]


def _choose_backend(device: torch.device, requested: Backend | None) -> BackendChoice:
    if requested is not None:
        check_backend(requested, device)
        return BackendChoice(
            requested, ATTENTION_MEMORY[requested], f"attention_backend={requested!r} (given)"
        )
    if device.type != "cuda":
        by_cost = f"{device.type}: 'dense' or 'segments' by each row's cost"
        return BackendChoice(None, QUADRATIC, by_cost)
    try:
        _flash_varlen_function(device)
    except BackendUnavailableError as error:
        return BackendChoice("flex", LINEAR, f"'flash_varlen' is unavailable: {error}")
    return BackendChoice("flash_varlen", LINEAR, "flash-attention's varlen kernel loads here")


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


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: TreeLayout,
    scaling: float | None,
    parts: AttentionParts = _NO_PARTS,
    sinks: Tensor | None = None,
) -> Tensor:
    """q [H, T, D], k/v [H_kv, T, D] -> [T, H, D] through ``layout.backend``'s kernel, with the
    layer's attention ``parts`` (``sinks``: float [H], the per-head sink logits, when
    ``parts.sinks``).

    Raises:
        ValueError: the backend declines one of ``parts`` (the backend choice gives such rows
            to one that has them, so this means the layout was built without the model's
            :class:`ModelAttention`), or ``parts.sinks`` disagrees with ``sinks``.
    """
    if parts.sinks != (sinks is not None):
        raise ValueError(f"parts.sinks is {parts.sinks} but sinks is {type(sinks).__name__}")
    lacking = parts.names - BACKEND_PARTS[layout.backend]
    if lacking:
        raise ValueError(
            f"tree attention backend {layout.backend!r} does not implement "
            f"{', '.join(sorted(lacking))}: build the layout with the model's shape, "
            "tree_layout(row, device, choice, ModelAttention.of(model)), so that the row runs "
            "on a backend that has them"
        )
    return _ATTEND[layout.backend](q, k, v, layout, scaling, parts, sinks)


def _dense(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: TreeLayout,
    scaling: float | None,
    parts: AttentionParts,
    sinks: Tensor | None,
) -> Tensor:
    """q [H, T, D], k/v [H_kv, T, D] -> [T, H, D] with the boolean [T, T] mask, narrowed to
    the layer's window or chunk along each token's own positions."""
    mask = layout.dense_mask
    if mask is None:
        raise ValueError(
            "tree attention backend 'dense' needs the layout's dense_mask; build the layout "
            "with tree_layout(row, device, 'dense'), which sets it"
        )
    if parts.mask_shape != (None, None):
        positions = layout.positions
        mask = mask & path_mask(positions[:, None], positions[None, :], parts.mask_shape)
    return _masked_attention(q, k, v, mask, scaling, parts, sinks).transpose(0, 1)


def _segments(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: TreeLayout,
    scaling: float | None,
    parts: AttentionParts,
    sinks: Tensor | None,
) -> Tensor:
    """q [H, T, D], k/v [H_kv, T, D] -> [T, H, D], one attention per segment on the varlen
    view (a path's ``j``-th key is at position ``j`` of the segment's samples)."""
    q_rows, k_path, v_path = _varlen_view(q, k, v, layout)
    # The spans tile the rows and the paths in order: one split each, whose backward is one
    # concatenation, where a slice per segment would zero-fill a whole-row gradient per segment.
    q_sizes = [q_end - q_start for q_start, q_end, _, _ in layout.segment_spans]
    k_sizes = [k_end - k_start for _, _, k_start, k_end in layout.segment_spans]
    outputs = [
        _masked_attention(
            q_segment.transpose(0, 1),
            k_segment.transpose(0, 1),
            v_segment.transpose(0, 1),
            _segment_mask(len(q_segment), len(k_segment), parts, q.device),
            scaling,
            parts,
            sinks,
        ).transpose(0, 1)
        for q_segment, k_segment, v_segment in zip(
            q_rows.split(q_sizes), k_path.split(k_sizes), v_path.split(k_sizes), strict=True
        )
    ]
    return torch.cat(outputs)


def _masked_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor,
    scaling: float | None,
    parts: AttentionParts,
    sinks: Tensor | None,
) -> Tensor:
    """q [H, Lq, D], k/v [H_kv, Lk, D], bool mask [Lq, Lk] -> [H, Lq, D]: SDPA, or without
    it where the layer soft-caps its scores or has sinks (as transformers' eager attention of
    Gemma 2 and gpt-oss computes them: scores ``q k^T * scaling``, soft-capped, masked; the
    softmax in float32)."""
    if parts.softcap is None and sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True
        )
    groups = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if parts.softcap is not None:
        scores = torch.tanh(scores / parts.softcap) * parts.softcap
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    scores = scores.masked_fill(~mask, -torch.inf)
    if sinks is None:
        weights = torch.softmax(scores, dim=-1)
    else:
        # The sink joins the denominator as one more logit per query, dropped after the softmax
        # (each weight times exp(lse) / (exp(lse) + exp(sink))), as gpt-oss's eager attention.
        sink_logits = sinks.to(scores.dtype).reshape(-1, 1, 1).expand(-1, scores.shape[1], 1)
        combined = torch.cat([scores, sink_logits], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        weights = torch.softmax(combined, dim=-1)[..., :-1]
    return torch.matmul(weights.to(v.dtype), v)


def _segment_mask(q_len: int, k_len: int, parts: AttentionParts, device: torch.device) -> Tensor:
    """bool [q_len, k_len]: causal, bottom-right aligned (:func:`_bottom_right_causal`), and
    within the layer's window and chunk; the path's key ``j`` is at position ``j`` and the
    segment's query ``i`` at ``k_len - q_len + i``."""
    mask = _bottom_right_causal(q_len, k_len, device)
    if parts.mask_shape == (None, None):
        return mask
    k_position = torch.arange(k_len, device=device)
    q_position = k_position[k_len - q_len :]
    return mask & path_mask(q_position[:, None], k_position[None, :], parts.mask_shape)


def _flash_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: TreeLayout,
    scaling: float | None,
    parts: AttentionParts,
    sinks: Tensor | None,
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
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: TreeLayout,
    scaling: float | None,
    parts: AttentionParts,
    sinks: Tensor | None,
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
    out = attend(
        q_rows,
        k_path,
        v_path,
        layout.cu_seqlens_q,
        layout.cu_seqlens_k,
        layout.max_seqlen_q,
        layout.max_seqlen_k,
        **kwargs,
    )
    return out[0] if isinstance(out, tuple) else out


def _flex(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: TreeLayout,
    scaling: float | None,
    parts: AttentionParts,
    sinks: Tensor | None,
    flex: Callable[..., Tensor] | None = None,
) -> Tensor:
    """q [H, T, D], k/v [H_kv, T, D] -> [T, H, D] through compiled FlexAttention (``flex``
    replaces it in tests), with the block mask of the layer's window and chunk and its
    soft-cap as a ``score_mod``."""
    block_mask = layout.block_masks.get(parts.mask_shape)
    if block_mask is None:
        raise ValueError(
            f"the flex layout has no block mask for (window, chunk) {parts.mask_shape}: build "
            "it with tree_layout(row, device, choice, ModelAttention.of(model))"
        )
    out = (flex or _compiled_flex_attention())(
        q.unsqueeze(0),
        k.unsqueeze(0),
        v.unsqueeze(0),
        score_mod=None if parts.softcap is None else _softcap_score_mod(parts.softcap),
        block_mask=block_mask,
        scale=scaling,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def _softcap_score_mod(cap: float) -> Callable[..., Tensor]:
    """FlexAttention's ``score_mod``: ``cap * tanh(score / cap)`` (the score already scaled)."""

    def softcap(score: Tensor, batch: Tensor, head: Tensor, q_idx: Tensor, kv_idx: Tensor):
        return torch.tanh(score / cap) * cap

    return softcap


_ATTEND: dict[str, Callable[..., Tensor]] = {
    "dense": _dense,
    "segments": _segments,
    "flash_varlen": _flash_varlen,
    "flex": _flex,
    "torch_varlen": _torch_varlen,
}

ATTENTION_MEMORY: dict[Backend, AttentionMemory] = {
    "dense": QUADRATIC,
    "segments": QUADRATIC,
    "flash_varlen": LINEAR,
    "flex": LINEAR,
    "torch_varlen": LINEAR,
}
"""What each backend's attention keeps per layer for the backward: SDPA's weights
(``heads x T x T``, :data:`~asyncgrpo.core.packing.memory.QUADRATIC`), or only the softmax's
log-sum-exp (``heads x T``, :data:`~asyncgrpo.core.packing.memory.LINEAR`) where the kernel
recomputes the weights."""


def _varlen_view(q: Tensor, k: Tensor, v: Tensor, layout: TreeLayout) -> tuple[Tensor, ...]:
    """The varlen kernels' inputs: queries [T, H, D] in row order and keys/values
    [P, H_kv, D] gathered along ``kv_indices`` (each segment's path, segment by segment)."""
    k_rows, v_rows = k.transpose(0, 1), v.transpose(0, 1)
    return q.transpose(0, 1), k_rows[layout.kv_indices], v_rows[layout.kv_indices]


def _bottom_right_causal(q_len: int, k_len: int, device: torch.device) -> Tensor:
    """bool [q_len, k_len]: query ``i`` sees keys ``j <= k_len - q_len + i`` (the segment's
    queries are the last ``q_len`` positions of its path)."""
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(k_len - q_len)


@functools.cache
def _compiled_flex_attention() -> Callable[..., Tensor]:
    return torch.compile(flex_attention)


_FLASH_KERNELS: dict[torch.device, Callable[..., Tensor] | BackendUnavailableError] = {}
"""Per device, the flash kernel or why it cannot load: probed once per process."""


def _flash_varlen_function(device: torch.device) -> Callable[..., Tensor]:
    """``flash_attn_varlen_func`` for ``device``, probed once (:func:`_probe_flash_varlen`);
    a failure is kept and raised again with its cause, never retried."""
    outcome = _FLASH_KERNELS.get(device)
    if outcome is None:
        try:
            outcome = _probe_flash_varlen(device)
        except BackendUnavailableError as error:
            outcome = error
        _FLASH_KERNELS[device] = outcome
    if isinstance(outcome, BackendUnavailableError):
        raise outcome.with_traceback(None)  # the kept error; its cause stays in __cause__
    return outcome


def _probe_flash_varlen(device: torch.device) -> Callable[..., Tensor]:
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


def _torch_varlen_function(device: torch.device) -> Callable[..., Tensor | tuple[Tensor, Tensor]]:
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
