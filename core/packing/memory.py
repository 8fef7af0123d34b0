"""Whether the learner recomputes its decoder layers in the backward (gradient checkpointing):
a decision over the activations the longest packed row keeps and the memory free for them.

**The row.** Rows are filled up to ``token_budget`` tokens, or, when it is unset, up to the
server's ``max_model_len`` (the trainer asks the server); a learner without either takes the
model's own context length, which is what ``vllm serve`` serves by default
(:func:`row_tokens`).

**What a row keeps.** Without checkpointing a decoder layer keeps, per forwarded token, about
``7 x hidden + 2 x kv_width + 3 x intermediate`` values for its backward (the norms' outputs,
the query, key and value projections, the attention output, the MLP's gate, up and activation),
plus what its attention keeps, which depends on the backend that runs (each backend declares
its kind where it is implemented, :mod:`asyncgrpo.adapters.kernels.backends`):

* :data:`QUADRATIC` (``"dense"``, ``"segments"``: SDPA keeps its attention weights)
  ``heads x T x T`` values per layer (``"segments"``: at most that, for one long sample);
* :data:`LINEAR` (``"flash_varlen"``, ``"torch_varlen"``, ``"flex"``: the kernel recomputes
  the weights in its backward) ``heads x T`` values, the softmax's log-sum-exp.

With checkpointing a layer keeps only its input. ``gradient_checkpointing=None`` (the default)
turns it on only when the row would keep more than :data:`ACTIVATION_SHARE` of the free
memory without it: small models on CPUs train without recomputation (a third faster), large
ones on GPUs keep it, as TRL's default does.

Example (SmolLM2-135M's shape, a 1,024-token row on CPU, dense tree attention):
    >>> smollm2 = DecoderShape(layers=30, hidden=576, kv_width=192, intermediate=1536, heads=9)
    >>> row = ActivationRow(1024, "token_budget", "dense", QUADRATIC, bytes_per_value=2)
    >>> round(activation_bytes(row, smollm2) / 2**30, 2)
    1.04
    >>> choose_checkpointing(None, row, smollm2, DeviceMemory("cpu", 20 * 2**30)).enabled
    False
    >>> choice = choose_checkpointing(None, row, smollm2, DeviceMemory("cpu", 2 * 2**30))
    >>> choice.enabled
    True
    >>> print(choice.reason)
    on: a 1,024-token row (token_budget) with 'dense' attention (heads x T x T) would keep
    1.04 GiB, over 25% of the 2.0 GiB free on cpu
"""

from __future__ import annotations

from typing import Literal

import attrs

ACTIVATION_SHARE = 0.25

AttentionMemory = Literal["quadratic", "linear"]
QUADRATIC: AttentionMemory = "quadratic"
"""The attention keeps ``heads x T x T`` values per layer (its weights)."""
LINEAR: AttentionMemory = "linear"
"""The attention keeps ``heads x T`` values per layer (the softmax's log-sum-exp)."""
_TERMS = {QUADRATIC: "heads x T x T", LINEAR: "heads x T"}


@attrs.frozen
class DecoderShape:
    """The sizes of a decoder that set what a row keeps (a model config's numbers).

    Attributes:
        layers: decoder layers.
        hidden: the hidden size.
        kv_width: key/value heads x head_dim.
        intermediate: the MLP's intermediate size.
        heads: query heads.
    """

    layers: int
    hidden: int
    kv_width: int
    intermediate: int
    heads: int


@attrs.frozen
class ActivationRow:
    """The longest row the learner forwards, and the attention that runs on it.

    Attributes:
        tokens: ``T``, the row's forwarded tokens; ``None`` when unknown.
        source: where ``tokens`` comes from, for the log (``"token_budget"``, ...).
        backend: the tree-attention backend's name, for the log.
        attention: what that backend keeps, :data:`QUADRATIC` or :data:`LINEAR`.
        bytes_per_value: 2 in bf16, 4 in fp32.
    """

    tokens: int | None
    source: str
    backend: str
    attention: AttentionMemory
    bytes_per_value: int


@attrs.frozen
class DeviceMemory:
    """Where the learner trains and the memory free there.

    Attributes:
        kind: ``"cpu"`` (the host's available RAM) or ``"cuda"``.
        free_bytes: free now; ``None`` when it cannot be measured.
    """

    kind: str
    free_bytes: int | None


@attrs.frozen
class CheckpointingChoice:
    """Recompute the layers or not, and why (for the run's log)."""

    enabled: bool
    reason: str


def row_tokens(
    token_budget: int | None, max_model_len: int | None, model_context: int | None
) -> tuple[int | None, str]:
    """The tokens of the longest row the learner forwards and where that number comes from:
    ``token_budget``, else the server's ``max_model_len``, else the model's context length.

    Example:
        >>> row_tokens(None, 32768, 40960)
        (32768, "the server's max_model_len")
    """
    if token_budget:
        return token_budget, "token_budget"
    if max_model_len:
        return max_model_len, "the server's max_model_len"
    if model_context:
        return model_context, "the model's max_position_embeddings"
    return None, "unknown"


def activation_bytes(row: ActivationRow, shape: DecoderShape) -> int:
    """Bytes ``row`` keeps for the backward without checkpointing (see above).

    Raises:
        ValueError: the row's length is unknown.
    """
    if row.tokens is None:
        raise ValueError("activation_bytes needs the row's tokens; got None")
    tokens = row.tokens
    per_token = 7 * shape.hidden + 2 * shape.kv_width + 3 * shape.intermediate
    attention = shape.heads * tokens * (tokens if row.attention == QUADRATIC else 1)
    return shape.layers * (tokens * per_token + attention) * row.bytes_per_value


def choose_checkpointing(
    requested: bool | None, row: ActivationRow, shape: DecoderShape, device: DeviceMemory
) -> CheckpointingChoice:
    """Checkpointing as requested, or (``None``) on when the activations ``row`` keeps without
    it exceed :data:`ACTIVATION_SHARE` of ``device``'s free memory (on when the free memory or
    the row's length is unknown)."""
    if requested is not None:
        return CheckpointingChoice(requested, f"gradient_checkpointing={requested} (config)")
    if row.tokens is None:
        return CheckpointingChoice(
            True,
            "on: the row's length is unknown (no token_budget, "
            "server max_model_len or model context)",
        )
    kept = activation_bytes(row, shape)
    gib = kept / 2**30
    what = (
        f"a {row.tokens:,}-token row ({row.source}) with {row.backend!r} attention "
        f"({_TERMS[row.attention]})"
    )
    free = device.free_bytes
    if free is None:
        return CheckpointingChoice(
            True, f"on: {what} keeps {gib:.2f} GiB, free memory on {device.kind} unknown"
        )
    share = f"{ACTIVATION_SHARE:.0%} of the {free / 2**30:.1f} GiB free on {device.kind}"
    if kept > ACTIVATION_SHARE * free:
        return CheckpointingChoice(True, f"on: {what} would keep {gib:.2f} GiB, over {share}")
    return CheckpointingChoice(False, f"off: {what} keeps {gib:.2f} GiB, within {share}")


@attrs.frozen
class RowSize:
    """A packed row the learner could not fit in memory, for the error that names it.

    Attributes:
        tokens: forwarded tokens (``T``).
        trained: trained tokens.
        samples: samples packed in it.
        longest: tokens of its longest sample.
    """

    tokens: int
    trained: int
    samples: int
    longest: int


def out_of_memory_message(
    row: RowSize, token_budget: int | None, checkpointing: bool, device: str, cause: str
) -> str:
    """The error when the forward or backward of ``row`` ran out of memory: the row, the
    settings that size it (``token_budget``, ``gradient_checkpointing``) and what to change.

    Example:
        >>> row = RowSize(tokens=8192, trained=8184, samples=1, longest=8192)
        >>> print(out_of_memory_message(row, None, False, "cpu", "RuntimeError: no memory"))
        the learner ran out of memory on cpu in the forward and backward of a packed row of
        8,192 tokens (8,184 trained; 1 sample, the longest 8,192 tokens) with token_budget
        unset (rows fill up to the server's max_model_len) and gradient_checkpointing off.
        Turn gradient_checkpointing on (each decoder layer then keeps only its input for the
        backward); set token_budget lower, e.g. 4,096 (a row holds at most that many
        tokens); lower max_completion_length (one sample of 8,192 tokens is more than half
        the row); or give the trainer more memory, or more processes (FSDP2 shards the
        weights and the optimizer states over them). Cause: RuntimeError: no memory
    """
    budget = (
        "token_budget unset (rows fill up to the server's max_model_len)"
        if token_budget is None
        else f"token_budget={token_budget}"
    )
    fixes = []
    if not checkpointing:
        fixes.append(
            "turn gradient_checkpointing on (each decoder layer then keeps only its "
            "input for the backward)"
        )
    lower = "set token_budget lower" if token_budget is None else "lower token_budget"
    fixes.append(
        f"{lower}, e.g. {max(1, row.tokens // 2):,} (a row holds at most that many tokens)"
    )
    if row.longest > row.tokens // 2:
        fixes.append(
            f"lower max_completion_length (one sample of {row.longest:,} tokens is "
            "more than half the row)"
        )
    fixes.append(
        "or give the trainer more memory, or more processes (FSDP2 shards the "
        "weights and the optimizer states over them)"
    )
    remedy = "; ".join(fixes)
    samples = f"{row.samples} sample{'s' if row.samples != 1 else ''}"
    return (
        f"the learner ran out of memory on {device} in the forward and backward of a packed "
        f"row of {row.tokens:,} tokens ({row.trained:,} trained; {samples}, the longest "
        f"{row.longest:,} tokens) with {budget} and gradient_checkpointing "
        f"{'on' if checkpointing else 'off'}. {remedy[0].upper()}{remedy[1:]}. Cause: {cause}"
    )
