"""Which CPU tree-attention backend is cheaper for a packed row: a cost model measured here.

Two exact backends compute tree attention on CPU (``asyncgrpo.adapters.kernels.backends``):

* ``"dense"``: one SDPA call over all ``T`` rows with a boolean ``[T, T]`` mask, built once per
  forward; its work grows with ``T²`` whatever the row's shape;
* ``"segments"``: one SDPA call per segment (a trie node) against its path's keys; its work
  follows the row's true (query, key) pairs, but every segment costs a Python-level call.

So rows of a few long samples favour ``"segments"`` (few calls, far fewer pairs than ``T²``
once several samples share a row) only up to a point, and rows of many short samples favour
``"dense"`` (one call instead of hundreds). The model, per layer forward and backward::

    dense    = DENSE_PER_CALL + DENSE_PER_CELL_DIM * T² * width   (+ the mask, once per forward:
               MASK_PER_CELL * T² + MASK_PER_TOKEN * T)
    segments = SEGMENTS_PER_CALL * S + SEGMENTS_PER_PAIR_DIM * pairs * width

``width`` is ``heads x head_dim`` of the queries, ``S`` the row's segments, ``pairs`` the
(query, key) pairs it attends. The constants were fitted by least squares by
``benchmarks/attention_backends.py --threads 1`` on the 2-core machine of docs/benchmarks.md
(fp32, torch's CPU SDPA, 48 rows of 196-2048 tokens, 1-145 segments, query width 128 and
1024): the model picked the faster backend for 46 of them, the two misses within 3%. They
order the backends; they do not predict another machine's seconds.

The second decision here is where a row runs when its model's layers need attention parts
(sliding windows, chunks, sinks, soft-caps: :data:`ATTENTION_PARTS`) that the run's backend
declines (:data:`BACKEND_PARTS`, :func:`backend_with_parts`).
"""

from __future__ import annotations

import attrs

DENSE = "dense"
SEGMENTS = "segments"


@attrs.frozen
class AttentionCosts:
    """Seconds per unit of work, per layer (forward and backward together)."""

    dense_per_call: float = 0.0
    dense_per_cell_dim: float = 3.19e-10
    mask_per_cell: float = 4.74e-10
    mask_per_token: float = 1.22e-6
    segments_per_call: float = 3.92e-4
    segments_per_pair_dim: float = 6.38e-10


MEASURED = AttentionCosts()


def dense_cost(tokens: int, width: int, layers: int, costs: AttentionCosts = MEASURED) -> float:
    """Seconds of the ``"dense"`` backend for one forward and backward over ``layers``."""
    mask = costs.mask_per_cell * tokens**2 + costs.mask_per_token * tokens
    per_layer = costs.dense_per_call + costs.dense_per_cell_dim * tokens**2 * width
    return mask + layers * per_layer


def segments_cost(
    segments: int, pairs: int, width: int, layers: int, costs: AttentionCosts = MEASURED
) -> float:
    """Seconds of the ``"segments"`` backend for one forward and backward over ``layers``."""
    per_layer = costs.segments_per_call * segments + costs.segments_per_pair_dim * pairs * width
    return layers * per_layer


def cheaper_backend(
    tokens: int,
    segments: int,
    pairs: int,
    width: int,
    layers: int = 1,
    costs: AttentionCosts = MEASURED,
) -> str:
    """``"dense"`` or ``"segments"``, whichever the model says is cheaper (ties: segments, whose
    memory follows the pairs rather than ``T²``).

    Example:
        >>> cheaper_backend(tokens=1024, segments=128, pairs=128 * 36, width=128)
        'dense'
        >>> cheaper_backend(tokens=2048, segments=2, pairs=2 * 1024 * 1025 // 2, width=128)
        'segments'
    """
    if tokens < 1 or segments < 1 or width < 1 or layers < 1:
        raise ValueError("tokens, segments, width and layers must be >= 1")
    dense = dense_cost(tokens, width, layers, costs)
    split = segments_cost(segments, pairs, width, layers, costs)
    return DENSE if dense < split else SEGMENTS


# Attention parts: what a model's attention layers compute beyond causal softmax attention over
# the whole path. Every backend either implements a part exactly or declines it; a row whose
# model needs a part its backend declines runs on one that has it (:func:`backend_with_parts`).
SLIDING_WINDOW = "sliding_window"
"""Each query sees only the keys within ``window`` positions of its own sample (its trie depth)."""
CHUNKED = "chunked_attention"
"""Each query sees only the keys in its own ``chunk``-position block of its own sample."""
SINKS = "attention_sinks"
"""A learned per-head logit joins each softmax's denominator (gpt-oss ``sinks``)."""
SOFTCAP = "logit_softcapping"
"""Attention scores become ``cap * tanh(scores / cap)`` before masking (Gemma 2)."""
ATTENTION_PARTS = (SLIDING_WINDOW, CHUNKED, SINKS, SOFTCAP)

BACKEND_PARTS: dict[str, frozenset[str]] = {
    "dense": frozenset(ATTENTION_PARTS),
    "segments": frozenset(ATTENTION_PARTS),
    "flex": frozenset({SLIDING_WINDOW, CHUNKED, SOFTCAP}),
    "flash_varlen": frozenset(),
    "torch_varlen": frozenset(),
}
"""The parts each tree-attention backend computes exactly. ``"flex"`` declines sinks (they need
the log-sum-exp's gradient); the varlen kernels decline every part (their window and soft-cap
options are not checked against the dense reference here)."""

_FALLBACKS = ("flex", "segments")
"""Where a row falls when its backend declines a part: ``"flex"`` only ever replaces a CUDA
kernel (the only backends that decline parts run on CUDA, where FlexAttention runs too), and
``"segments"`` implements every part."""


def backend_with_parts(backend: str, needed: frozenset[str]) -> tuple[str, str | None]:
    """The backend to run a row that needs the attention ``needed`` parts on, given the run's
    ``backend``, and why it changed (``None`` when ``backend`` has every part).

    Example:
        >>> backend_with_parts("flash_varlen", frozenset({SLIDING_WINDOW}))
        ('flex', "'flash_varlen' lacks sliding_window; 'flex' has every part the model needs")
        >>> backend_with_parts("flex", frozenset({SINKS}))
        ('segments', "'flex' lacks attention_sinks; 'segments' has every part the model needs")
        >>> backend_with_parts("dense", frozenset(ATTENTION_PARTS))
        ('dense', None)
    """
    unknown = needed - set(ATTENTION_PARTS)
    if unknown:
        raise ValueError(f"unknown attention parts {sorted(unknown)}; known: {ATTENTION_PARTS}")
    lacking = needed - BACKEND_PARTS[backend]
    if not lacking:
        return backend, None
    fallback = next(name for name in _FALLBACKS if needed <= BACKEND_PARTS[name])
    reason = (
        f"{backend!r} lacks {', '.join(sorted(lacking))}; {fallback!r} has every part the "
        "model needs"
    )
    return fallback, reason
