"""Gradient checkpointing decided for the row actually used, with the attention term of the
backend that runs: Qwen3-0.6B, 1.7B and 8B shapes (their configs' numbers) at 4k to 32k-token
rows, on CPU hosts and CUDA GPUs described as records."""

import attrs
from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.core.packing.memory import (
    ACTIVATION_SHARE,
    LINEAR,
    QUADRATIC,
    ActivationRow,
    DecoderShape,
    DeviceMemory,
    activation_bytes,
    choose_checkpointing,
    row_tokens,
)

GIB = 2**30
# the Qwen3 configs on the hub: layers, hidden, kv heads x head_dim (8 x 128), intermediate, heads
QWEN3 = {
    "Qwen3-0.6B": DecoderShape(layers=28, hidden=1024, kv_width=1024, intermediate=3072, heads=16),
    "Qwen3-1.7B": DecoderShape(layers=28, hidden=2048, kv_width=1024, intermediate=6144, heads=16),
    "Qwen3-8B": DecoderShape(layers=36, hidden=4096, kv_width=1024, intermediate=12288, heads=32),
}
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


@given(st.sampled_from([QUADRATIC, LINEAR]), gpu_80gb)
def test_qwen3_1_7b_at_a_32k_row_is_checkpointed_on_an_80gb_gpu(kind, device) -> None:
    """About 60 GiB of activations without the attention term: over a quarter of any 80 GB GPU,
    whichever backend runs."""
    row = ActivationRow(32768, "the server's max_model_len", BACKENDS[kind][0], kind, 2)
    if kind == LINEAR:
        assert 55 * GIB < activation_bytes(row, QWEN3["Qwen3-1.7B"]) < 65 * GIB
    assert choose_checkpointing(None, row, QWEN3["Qwen3-1.7B"], device).enabled


@given(st.sampled_from(BACKENDS[LINEAR]), h200)
def test_qwen3_0_6b_at_a_16k_row_trains_without_recomputation_on_an_h200(backend, device) -> None:
    """A varlen or Flex backend keeps O(T): about 16 GiB, far below the 240 GiB predicted with
    the T x T term, so an H200 keeps the activations and saves the recomputation."""
    shape, linear = QWEN3["Qwen3-0.6B"], ActivationRow(16384, "token_budget", backend, LINEAR, 2)
    quadratic = attrs.evolve(linear, backend="dense", attention=QUADRATIC)
    kept = activation_bytes(linear, shape)
    assert kept < 20 * GIB
    assert round(activation_bytes(quadratic, shape) / GIB) == 240
    assert not choose_checkpointing(None, linear, shape, device).enabled
    assert choose_checkpointing(None, quadratic, shape, device).enabled


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
    )


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
