"""Gradient checkpointing decided for the row actually used, with the attention term of the
backend that runs, against the memory the training state leaves: Qwen3-0.6B, 1.7B, 4B and 8B
shapes (their configs' numbers) at 4k to 32k-token rows, on CPU hosts, H100s and H200s
described as records."""

import attrs
from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.core.packing.memory import (
    ACTIVATION_SHARE,
    LINEAR,
    OPTIMIZER_STATES,
    QUADRATIC,
    ActivationRow,
    DecoderShape,
    DeviceMemory,
    Reserved,
    ShardedModel,
    activation_bytes,
    choose_checkpointing,
    push_snapshot_bytes,
    reserved_after_sharding,
    row_tokens,
)

GIB = 2**30


def qwen3(layers: int, hidden: int, intermediate: int, heads: int) -> DecoderShape:
    """A Qwen3 config's numbers: 8 key/value heads of 128, per-head query/key norms."""
    return DecoderShape(
        layers,
        hidden,
        8 * 128,
        intermediate,
        heads,
        q_width=heads * 128,
        head_dim=128,
        qk_norm=True,
    )


QWEN3 = {
    "Qwen3-0.6B": qwen3(28, 1024, 3072, 16),
    "Qwen3-1.7B": qwen3(28, 2048, 6144, 16),
    "Qwen3-4B": qwen3(36, 2560, 9728, 32),
    "Qwen3-8B": qwen3(36, 4096, 12288, 32),
}
PARAMETERS = {  # the checkpoints' parameter counts
    "Qwen3-0.6B": 596_049_920,
    "Qwen3-1.7B": 2_031_739_904,
    "Qwen3-4B": 4_022_468_096,
    "Qwen3-8B": 8_190_735_360,
}
H100 = 79 * GIB  # free on an 80 GB H100 (79.2 GiB) once CUDA's context is made
H200 = 139 * GIB  # free on an H200 (139.8 GiB)
# the backends by what their attention keeps (adapters/kernels/backends.py declares each one's)
BACKENDS = {QUADRATIC: ("dense", "segments"), LINEAR: ("flash_varlen", "flex", "torch_varlen")}

shapes = st.sampled_from(sorted(QWEN3)).map(QWEN3.__getitem__)
row_lengths = st.integers(4096, 32768)
kinds = st.sampled_from([QUADRATIC, LINEAR])
# an 80 GB GPU (A100/H100: 79.6 GiB) and an H200 (141 GB: 131 GiB), with what a run leaves free
gpu_80gb = st.integers(40 * GIB, 79 * GIB).map(lambda free: DeviceMemory("cuda", free))
h200 = st.integers(110 * GIB, 130 * GIB).map(lambda free: DeviceMemory("cuda", free))
cpu_host = st.integers(16 * GIB, 1024 * GIB).map(lambda free: DeviceMemory("cpu", free))
devices = st.one_of(gpu_80gb, h200, cpu_host, st.just(DeviceMemory("cuda", None)))


@st.composite
def rows(draw, tokens=row_lengths, attention=kinds):
    kind = draw(attention)
    backend = draw(st.sampled_from(BACKENDS[kind]))
    return ActivationRow(draw(tokens), "the server's max_model_len", backend, kind, 2)


def sharded(model: str, processes: int = 1) -> ShardedModel:
    """``model`` trained whole in bf16 with fp32 master weights, sharded over ``processes``."""
    shape = QWEN3[model]
    assert shape.q_width is not None
    layer = shape.hidden * (2 * shape.q_width + 2 * shape.kv_width + 3 * shape.intermediate)
    masters = -(-4 * PARAMETERS[model] // processes)
    return ShardedModel(masters, PARAMETERS[model], layer, 2, processes)


def after_sharding(device: int, model: str, processes: int = 1) -> DeviceMemory:
    """What the learner measures free on a GPU of ``device`` bytes free once its shards of the
    master weights are on it."""
    return DeviceMemory("cuda", device - sharded(model, processes).trained_bytes)


@given(st.sampled_from([QUADRATIC, LINEAR]), gpu_80gb)
def test_qwen3_1_7b_at_a_32k_row_is_checkpointed_on_an_80gb_gpu(kind, device) -> None:
    """About 97 GiB of activations without the attention term: more than any 80 GB GPU has,
    whichever backend runs."""
    row = ActivationRow(32768, "the server's max_model_len", BACKENDS[kind][0], kind, 2)
    if kind == LINEAR:
        assert 90 * GIB < activation_bytes(row, QWEN3["Qwen3-1.7B"]) < 100 * GIB
    assert choose_checkpointing(None, row, QWEN3["Qwen3-1.7B"], device).enabled


@given(st.sampled_from(BACKENDS[LINEAR]), h200)
def test_qwen3_0_6b_at_a_16k_row_trains_without_recomputation_on_an_h200(backend, device) -> None:
    """A varlen or Flex backend keeps O(T): about 31 GiB, far below the 255 GiB predicted with
    the T x T term, so an H200 keeps the activations beside the 10 GiB of training state and
    saves the recomputation."""
    shape, linear = QWEN3["Qwen3-0.6B"], ActivationRow(16384, "token_budget", backend, LINEAR, 2)
    quadratic = attrs.evolve(linear, backend="dense", attention=QUADRATIC)
    kept = activation_bytes(linear, shape)
    assert 30 * GIB < kept < 32 * GIB
    assert round(activation_bytes(quadratic, shape) / GIB) == 255
    reserved = reserved_after_sharding(sharded("Qwen3-0.6B"))
    free = after_sharding(device.free_bytes, "Qwen3-0.6B")
    assert not choose_checkpointing(None, linear, shape, free, reserved).enabled
    assert choose_checkpointing(None, quadratic, shape, free, reserved).enabled


@given(st.sampled_from(BACKENDS[LINEAR]))
def test_the_reviews_cases_are_checkpointed(backend) -> None:
    """Qwen3-4B on one H200 at a 10k-token row was decided "off" (free memory measured with the
    model still on the host, activations counted 1.7-2x low) and needs about 140 GiB; Qwen3-1.7B
    on one H100 at 11k tokens was marginal. Decided after sharding, both are on."""
    for model, device, tokens in (("Qwen3-4B", H200, 10240), ("Qwen3-1.7B", H100, 11264)):
        row = ActivationRow(tokens, "token_budget", backend, LINEAR, 2)
        state = reserved_after_sharding(sharded(model))
        free = after_sharding(device, model)
        needs = sharded(model).trained_bytes + state.total + activation_bytes(row, QWEN3[model])
        choice = choose_checkpointing(None, row, QWEN3[model], free, state)
        assert choice.enabled and "training state" in choice.reason
        if model == "Qwen3-4B":
            assert 120 * GIB < needs < 140 * GIB


@given(
    st.sampled_from(sorted(QWEN3)),
    rows(tokens=st.integers(4096, 32768), attention=st.just(LINEAR)),
    st.sampled_from([H100, H200]),
    st.integers(1, 8),
    st.integers(0, 8 * GIB),
)
def test_off_leaves_as_much_again_as_the_rows_keep_after_the_state_and_snapshot(
    model, row, device, processes, snapshot
) -> None:
    """Off only where the shards, what training adds to them (sharded over ``processes``), the
    push snapshot and twice the row's activations fit the GPU: the other half is for the
    logits and the allocator."""
    shards = sharded(model, processes)
    reserved = reserved_after_sharding(shards, snapshot)
    kept = activation_bytes(row, QWEN3[model])
    free = after_sharding(device, model, processes)
    choice = choose_checkpointing(None, row, QWEN3[model], free, reserved)
    if not choice.enabled:
        assert shards.trained_bytes + reserved.total + 2 * kept <= device
    more = Reserved(reserved.training_state, snapshot + GIB)
    if choice.enabled:  # less memory left never turns it off
        assert choose_checkpointing(None, row, QWEN3[model], free, more).enabled


@given(
    st.integers(2, 10**10),
    st.integers(0, 4),
    st.sampled_from([2, 4]),
    st.integers(1, 64),
    st.data(),
)
def test_training_adds_adamws_states_of_the_shard_and_the_gathered_layers(
    parameters, frozen_share, compute, processes, data
) -> None:
    """A gradient and two moments per trained value of this process's shard; the gathered
    compute copy of the whole model in one process, of two layers in several. More processes
    never reserve more, and a frozen base (LoRA) adds only the gathered copies."""
    largest = data.draw(st.integers(1, parameters // 2))  # a decoder has 2 layers or more
    trained = parameters // (1 + frozen_share)
    shards = ShardedModel(-(-4 * trained // processes), parameters, largest, compute, processes)
    state = reserved_after_sharding(shards).training_state
    gathered = parameters if processes == 1 else 2 * largest
    assert state == OPTIMIZER_STATES * shards.trained_bytes + gathered * compute
    wider = attrs.evolve(
        shards, trained_bytes=-(-4 * trained // (processes + 1)), processes=processes + 1
    )
    assert reserved_after_sharding(wider).training_state <= state
    frozen = attrs.evolve(shards, trained_bytes=0)
    assert reserved_after_sharding(frozen).training_state == gathered * compute


@given(shapes, rows(), st.integers(0, 28672), devices)
def test_more_tokens_keep_more_and_never_turn_checkpointing_off(shape, row, more, device) -> None:
    longer = attrs.evolve(row, tokens=min(row.tokens + more, 32768))
    assert activation_bytes(longer, shape) >= activation_bytes(row, shape)
    if choose_checkpointing(None, row, shape, device).enabled:
        assert choose_checkpointing(None, longer, shape, device).enabled


@given(shapes, rows(attention=st.just(LINEAR)), devices)
def test_an_o_t_backend_never_predicts_more_than_an_o_t2_one(shape, row, device) -> None:
    dense = attrs.evolve(row, backend="dense", attention=QUADRATIC)
    assert activation_bytes(row, shape) < activation_bytes(dense, shape)
    if choose_checkpointing(None, row, shape, device).enabled:
        assert choose_checkpointing(None, dense, shape, device).enabled


@given(shapes, rows(), devices)
def test_the_log_line_names_the_row_and_the_backend(shape, row, device) -> None:
    choice = choose_checkpointing(None, row, shape, device)
    assert f"{row.tokens:,}-token row" in choice.reason
    assert row.source in choice.reason and repr(row.backend) in choice.reason
    assert choice.reason.startswith("on" if choice.enabled else "off")
    assert choice.enabled == (
        device.free_bytes is None
        or activation_bytes(row, shape) > ACTIVATION_SHARE * device.free_bytes
    )  # nothing reserved: the free memory is what the rows may have


@given(row_lengths, st.integers(0, 8192), st.none() | st.integers(1, 65536))
def test_without_a_token_budget_the_row_is_the_servers_context(served, longer, budget) -> None:
    """Rows are filled to ``token_budget``, else to the server's ``max_model_len``: the decision
    is for that row, not for a guess."""
    context = served + longer  # the model's own context, at least what the server serves
    assert row_tokens(None, served, context) == (served, "the server's max_model_len")
    assert row_tokens(budget, served, context)[0] == (budget or served)
    assert row_tokens(None, None, context) == (context, "the model's max_position_embeddings")


@given(shapes, kinds, devices)
def test_a_row_of_unknown_length_is_checkpointed(shape, kind, device) -> None:
    row = ActivationRow(None, "unknown", BACKENDS[kind][0], kind, bytes_per_value=2)
    choice = choose_checkpointing(None, row, shape, device)
    assert choice.enabled and "unknown" in choice.reason


@given(st.integers(0, 10**10), st.sampled_from([2, 4]), st.booleans(), st.booleans())
def test_the_push_snapshot_is_kept_in_host_memory_for_a_whole_model(
    parameters, compute, lora, on_host
) -> None:
    snapshot = push_snapshot_bytes(parameters, compute, lora, on_host)
    assert (snapshot > 0) == (on_host and not lora and parameters > 0)
    assert snapshot in (0, parameters * compute)
