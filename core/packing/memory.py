"""Whether the learner recomputes its decoder layers in the backward (gradient checkpointing):
a decision over the activations the longest packed row keeps and the memory free for them.

**The row.** Rows are filled up to ``token_budget`` tokens, or, when it is unset, up to the
server's ``max_model_len`` (the trainer asks the server); a learner without either takes the
model's own context length, which is what ``vllm serve`` serves by default
(:func:`row_tokens`).

**What a row keeps.** Without checkpointing a decoder layer keeps, per forwarded token, the
values :func:`layer_values_per_token` counts for its backward: the inputs of its projections
and norms, the query/key/value projections and their rotary embedding, the attention output,
the MLP's gate, up and activation. The counts follow the layer as built (its norms over the
hidden size, a norm over each query and key head as Qwen3 has, the compute dtype: a norm
computes in fp32 and keeps that copy too in a bf16 layer); they are the bytes torch's
saved-tensor hooks see kept by transformers' Llama and Qwen3 layers on this CPU
(``tests/core/test_layer_activations.py`` measures them). What the attention keeps depends
on the backend that runs (each backend declares its kind where it is implemented,
:mod:`asyncgrpo.adapters.kernels.backends`):

* :data:`QUADRATIC` (``"dense"``, ``"segments"``: SDPA keeps its attention weights)
  ``heads x T x T`` values per layer (``"segments"``: at most that, for one long sample);
* :data:`LINEAR` (``"flash_varlen"``, ``"torch_varlen"``, ``"flex"``: the kernel recomputes
  the weights in its backward) ``heads x T`` values, the softmax's log-sum-exp.

**What else the device holds.** The learner decides once the model is sharded and on its
device (FSDP2), so the free memory it measures already excludes this process's shards of the
weights, and whatever else shares the device. Training adds to it (:func:`reserved_after_sharding`):
each trained value's gradient and two AdamW moments (:data:`OPTIMIZER_STATES`; they exist
only after the first step), the compute copies FSDP2 gathers for the forward, and the
snapshot an overlapped weight push keeps in host memory (:func:`push_snapshot_bytes`). The
activations are weighed against the memory left free after these (:class:`Reserved`).

With checkpointing a layer keeps only its input. ``gradient_checkpointing=None`` (the default)
turns it on only when the row would keep more than :data:`ACTIVATION_SHARE` of the memory
left free after the training state and the snapshot: small models on CPUs train without
recomputation (a third faster), large ones on GPUs keep it, as TRL's default does.

Example (SmolLM2-135M's shape, a 1,024-token row on CPU, dense tree attention):
    >>> smollm2 = DecoderShape(layers=30, hidden=576, kv_width=192, intermediate=1536, heads=9)
    >>> row = ActivationRow(1024, "token_budget", "dense", QUADRATIC, bytes_per_value=2)
    >>> round(activation_bytes(row, smollm2) / 2**30, 2)
    1.24
    >>> choose_checkpointing(None, row, smollm2, DeviceMemory("cpu", 20 * 2**30)).enabled
    False
    >>> choice = choose_checkpointing(None, row, smollm2, DeviceMemory("cpu", 2 * 2**30))
    >>> choice.enabled
    True
    >>> print(choice.reason)
    on: a 1,024-token row (token_budget) with 'dense' attention (heads x T x T) would keep
    1.24 GiB, over 50% of the 2.0 GiB free on cpu
"""

from __future__ import annotations

from typing import Literal

import attrs

ACTIVATION_SHARE = 0.5
"""The share of the memory left free after the training state and the push snapshot that a
row's activations may keep without checkpointing; the other half is for the log-prob head's
logits, the layers FSDP gathers and the allocator's fragmentation."""
OPTIMIZER_STATES = 3
"""Tensors training adds per trained parameter, each the size of the parameter's shard in
its dtype: its gradient and AdamW's two moments."""

AttentionMemory = Literal["quadratic", "linear"]
QUADRATIC: AttentionMemory = "quadratic"
"""The attention keeps ``heads x T x T`` values per layer (its weights)."""
LINEAR: AttentionMemory = "linear"
"""The attention keeps ``heads x T`` values per layer (the softmax's log-sum-exp)."""
_TERMS = {QUADRATIC: "heads x T x T", LINEAR: "heads x T"}


@attrs.frozen
class DecoderShape:
    """The sizes of a decoder that set what a row keeps (a model config's numbers, and what
    its layers are built of).

    Attributes:
        layers: decoder layers.
        hidden: the hidden size.
        kv_width: key/value heads x head_dim.
        intermediate: the MLP's intermediate size.
        heads: query heads.
        q_width: query heads x head_dim (``None``: the hidden size, as in Llama).
        head_dim: one head's width (``None``: hidden / heads).
        hidden_norms: norms over the hidden size in a layer (2 in Llama and Qwen3; Gemma 2
            and 3 have 4).
        qk_norm: a norm over each query and key head (Qwen3, OLMo 2, Gemma 3).
    """

    layers: int
    hidden: int
    kv_width: int
    intermediate: int
    heads: int
    q_width: int | None = None
    head_dim: int | None = None
    hidden_norms: int = 2
    qk_norm: bool = False


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


def layer_values_per_token(shape: DecoderShape, bytes_per_value: int) -> int:
    """Values (of ``bytes_per_value`` bytes) one decoder layer keeps per token for its
    backward, the attention's own aside: ``4 h`` (the inputs of the attention output and MLP
    projections, the residual sums) ``+ n h`` per norm over the hidden size (``2 n h`` in bf16:
    the norm's fp32 copy too) ``+ 2 q + 2 kv`` (queries, keys, values, after the rotary
    embedding) ``+ 2 q + 2 kv`` more with per-head query/key norms (``3 q + 3 kv`` in bf16)
    ``+ 4 i`` (the MLP's gate, up, activation, product) ``+ 2 head_dim`` (the rotary cos/sin).

    Example (Qwen3-8B's layer in bf16: 8 h + 5 q + 5 kv + 4 i + 2 head_dim):
        >>> qwen3_8b = DecoderShape(36, 4096, 1024, 12288, 32, q_width=4096, qk_norm=True)
        >>> layer_values_per_token(qwen3_8b, 2)
        107776
    """
    upcast = 2 if bytes_per_value < 4 else 1  # a norm's fp32 copy, in compute values
    q_width = shape.hidden if shape.q_width is None else shape.q_width
    head_dim = shape.head_dim or shape.hidden // max(shape.heads, 1)
    per_head_norm = (1 + upcast) if shape.qk_norm else 0
    return (
        (4 + upcast * shape.hidden_norms) * shape.hidden
        + (2 + per_head_norm) * (q_width + shape.kv_width)
        + 4 * shape.intermediate
        + 2 * head_dim
    )


def activation_bytes(row: ActivationRow, shape: DecoderShape) -> int:
    """Bytes ``row`` keeps for the backward without checkpointing (see above).

    Raises:
        ValueError: the row's length is unknown.
    """
    if row.tokens is None:
        raise ValueError("activation_bytes needs the row's tokens; got None")
    tokens = row.tokens
    per_token = layer_values_per_token(shape, row.bytes_per_value)
    attention = shape.heads * tokens * (tokens if row.attention == QUADRATIC else 1)
    return shape.layers * (tokens * per_token + attention) * row.bytes_per_value


@attrs.frozen
class Reserved:
    """Memory of the device that the rows cannot have: what the training state still takes
    (:func:`reserved_after_sharding`) and the snapshot of an overlapped weight push kept there."""

    training_state: int = 0
    snapshot: int = 0

    @property
    def total(self) -> int:
        return self.training_state + self.snapshot


@attrs.frozen
class ShardedModel:
    """What one process holds of the model when the learner decides: sharded and on its
    device, the optimizer not stepped yet.

    Attributes:
        trained_bytes: this process's shards of the trained parameters, in bytes (their
            master dtype: fp32 under mixed precision).
        parameters: the whole model's parameters (not sharded).
        largest_layer: the parameters of its largest decoder layer.
        compute_bytes: bytes per value of the copy FSDP2 gathers for the forward (2 in bf16).
        processes: the processes sharding it.
    """

    trained_bytes: int
    parameters: int
    largest_layer: int
    compute_bytes: int
    processes: int


def reserved_after_sharding(model: ShardedModel, snapshot: int = 0) -> Reserved:
    """What training adds on the device to a model sharded as ``model`` says, the free memory
    measured already excluding its shards: a gradient and AdamW's two moments per trained
    value (:data:`OPTIMIZER_STATES`; they exist only once a step ran), and the compute copies
    FSDP2 gathers (one process keeps every layer gathered from its forward to its backward;
    several gather a layer and prefetch the next), with ``snapshot``, the bytes an overlapped
    push keeps there.

    Example (Qwen3-4B trained whole on one GPU in bf16: 4.02e9 parameters, fp32 masters):
        >>> qwen3_4b = ShardedModel(4 * 4_022_468_096, 4_022_468_096, 100_930_816, 2, 1)
        >>> round(reserved_after_sharding(qwen3_4b).training_state / 2**30, 1)
        52.4
    """
    gathered = model.parameters if model.processes == 1 else 2 * model.largest_layer
    state = OPTIMIZER_STATES * model.trained_bytes + gathered * model.compute_bytes
    return Reserved(state, snapshot)


def push_snapshot_bytes(parameters: int, compute_bytes: int, lora: bool, on_host: bool) -> int:
    """Bytes the snapshot of an overlapped push keeps in host memory (the merged weights in
    the export dtype): none on a GPU's memory, none for LoRA, which pushes adapters from disk.

    Example:
        >>> push_snapshot_bytes(134_515_008, 4, lora=False, on_host=True)
        538060032
    """
    return parameters * compute_bytes if on_host and not lora else 0


def choose_checkpointing(
    requested: bool | None,
    row: ActivationRow,
    shape: DecoderShape,
    device: DeviceMemory,
    reserved: Reserved = Reserved(),
) -> CheckpointingChoice:
    """Checkpointing as requested, or (``None``) on when the activations ``row`` keeps without
    it exceed :data:`ACTIVATION_SHARE` of ``device``'s free memory less ``reserved`` (on when
    the free memory or the row's length is unknown)."""
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
    left = max(0, free - reserved.total)
    share = f"{ACTIVATION_SHARE:.0%} of the {left / 2**30:.1f} GiB free on {device.kind}"
    if reserved.total:
        share += (
            f" after the training state ({reserved.training_state / 2**30:.1f} GiB to come) "
            f"and the push snapshot ({reserved.snapshot / 2**30:.1f} GiB)"
        )
    if kept > ACTIVATION_SHARE * left:
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
