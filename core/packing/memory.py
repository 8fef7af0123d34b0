"""Whether the learner recomputes its decoder layers in the backward (gradient checkpointing):
a decision over the activations a packed row keeps and the memory free for them.

Without checkpointing a decoder layer keeps, per forwarded token, about
``7 x hidden + 2 x kv_width + 3 x intermediate`` values for its backward (the norms' outputs, the
query, key and value projections, the attention output, the MLP's gate, up and activation),
and the CPU's dense tree attention keeps its ``heads x T x T`` weights; with checkpointing a
layer keeps only its input. ``gradient_checkpointing=None`` (the default) turns it on only when
a row of ``token_budget`` tokens would keep more than :data:`ACTIVATION_SHARE` of the free
memory without it: small models on CPUs train without recomputation (a third faster), large
ones on GPUs keep it, as TRL's default does.

Example:
    >>> kept = activation_bytes(1024, layers=30, hidden=576, kv_width=192, intermediate=1536,
    ...                         heads=9, bytes_per_value=2)
    >>> round(kept / 2**30, 2)
    1.04
    >>> choose_checkpointing(None, kept, free_bytes=20 * 2**30).enabled
    False
    >>> choose_checkpointing(None, kept, free_bytes=2 * 2**30).enabled
    True
"""

from __future__ import annotations

import attrs

ACTIVATION_SHARE = 0.25


@attrs.frozen
class CheckpointingChoice:
    """Recompute the layers or not, and why (for the run's log)."""

    enabled: bool
    reason: str


def activation_bytes(tokens: int, layers: int, hidden: int, kv_width: int, intermediate: int,
                     heads: int, bytes_per_value: int) -> int:  # fmt: skip
    """Bytes a row of ``tokens`` keeps for the backward without checkpointing (see above)."""
    per_token = 7 * hidden + 2 * kv_width + 3 * intermediate
    attention = heads * tokens * tokens
    return layers * (tokens * per_token + attention) * bytes_per_value


def choose_checkpointing(
    requested: bool | None, kept_bytes: int, free_bytes: int | None
) -> CheckpointingChoice:
    """Checkpointing as requested, or (``None``) on when the activations a row keeps without
    it exceed :data:`ACTIVATION_SHARE` of ``free_bytes`` (on when the free memory is unknown)."""
    if requested is not None:
        return CheckpointingChoice(requested, f"gradient_checkpointing={requested} (config)")
    gib = kept_bytes / 2**30
    if free_bytes is None:
        return CheckpointingChoice(True, f"on: a row keeps {gib:.2f} GiB, free memory unknown")
    if kept_bytes > ACTIVATION_SHARE * free_bytes:
        return CheckpointingChoice(
            True, f"on: a row would keep {gib:.2f} GiB, over {ACTIVATION_SHARE:.0%} of the "
            f"{free_bytes / 2**30:.1f} GiB free"
        )  # fmt: skip
    return CheckpointingChoice(
        False, f"off: a row keeps {gib:.2f} GiB, within {ACTIVATION_SHARE:.0%} of the "
        f"{free_bytes / 2**30:.1f} GiB free"
    )  # fmt: skip
