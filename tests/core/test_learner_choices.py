"""The learner's precision, checkpointing and freed-memory decisions: a setting in the config
(or the environment, for the allocator) always wins, and the automatic choice is monotone in
what it weighs."""

import itertools

import attrs
from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.core.packing.host_memory import (
    MALLOC_ENVIRONMENT,
    TRIM_EVERY_STEPS,
    HostMemoryChoice,
    choose_host_memory,
    server_allocator_environment,
    trim_due,
)
from asyncgrpo.core.packing.memory import (
    ACTIVATION_SHARE,
    LINEAR,
    QUADRATIC,
    ActivationRow,
    DecoderShape,
    DeviceMemory,
    activation_bytes,
    choose_checkpointing,
)
from asyncgrpo.core.packing.precision import (
    BF16_MIN_PARAMETERS,
    BF16_MIN_SPEEDUP,
    choose_precision,
)

parameters = st.integers(1, 10**10)
speedups = st.none() | st.floats(0.1, 20.0)


@given(st.booleans(), st.booleans(), parameters, speedups)
def test_a_configured_bf16_is_used_as_given(requested, on_cuda, count, speedup) -> None:
    choice = choose_precision(requested, on_cuda, count, speedup)
    assert choice.bf16 is requested and "config" in choice.reason


@given(parameters, speedups)
def test_cuda_computes_in_bf16_unless_told_otherwise(count, speedup) -> None:
    assert choose_precision(None, True, count, speedup).bf16


@given(parameters, speedups, st.integers(1, 10**10), st.floats(0.1, 20.0))
def test_a_cpu_uses_bf16_only_for_large_models_it_multiplies_faster(
    count, speedup, more, faster
) -> None:
    choice = choose_precision(None, False, count, speedup)
    assert choice.bf16 == (
        count >= BF16_MIN_PARAMETERS and speedup is not None and speedup >= BF16_MIN_SPEEDUP
    )
    if choice.bf16:  # more parameters or a faster bf16 keep it
        assert choose_precision(None, False, count + more, speedup + faster).bf16


tokens = st.integers(1, 8192)
widths = st.integers(1, 4096)
kinds = st.sampled_from([QUADRATIC, LINEAR])


def row_of(count, attention, bytes_per_value=2) -> ActivationRow:
    return ActivationRow(count, "token_budget", "a backend", attention, bytes_per_value)


@given(tokens, st.integers(1, 64), widths, widths, widths, st.integers(1, 64), tokens, kinds)
def test_a_row_keeps_more_with_more_tokens_and_layers(
    count, layers, hidden, kv_width, intermediate, heads, more, attention
) -> None:
    shape = DecoderShape(layers, hidden, kv_width, intermediate, heads)
    kept = activation_bytes(row_of(count, attention), shape)
    assert activation_bytes(row_of(count + more, attention), shape) > kept
    assert activation_bytes(row_of(count, attention), attrs.evolve(shape, layers=2 * layers)) == (
        2 * kept
    )
    # fp32 values take twice the bytes, but a bf16 layer keeps its norms' fp32 copies too
    fp32 = activation_bytes(row_of(count, attention, bytes_per_value=4), shape)
    assert kept < fp32 <= 2 * kept


kept_bytes = st.integers(0, 2**40)
free = st.none() | st.integers(0, 2**40)
# one layer whose only activation is one head's log-sum-exp, one byte per token (linear
# attention): a row of ``kept`` tokens keeps ``kept`` bytes
ONE_BYTE = DecoderShape(layers=1, hidden=0, kv_width=0, intermediate=0, heads=1)


def one_byte_row(kept) -> ActivationRow:
    return ActivationRow(kept, "token_budget", "flex", LINEAR, bytes_per_value=1)


@given(st.booleans(), kept_bytes, free)
def test_configured_checkpointing_is_used_as_given(requested, kept, free_bytes) -> None:
    device = DeviceMemory("cuda", free_bytes)
    assert choose_checkpointing(requested, one_byte_row(kept), ONE_BYTE, device).enabled is (
        requested
    )


@given(kept_bytes, free, kept_bytes)
def test_checkpointing_turns_on_past_a_share_of_free_memory(kept, free_bytes, more) -> None:
    device = DeviceMemory("cuda", free_bytes)
    assert activation_bytes(one_byte_row(kept), ONE_BYTE) == kept
    choice = choose_checkpointing(None, one_byte_row(kept), ONE_BYTE, device)
    assert choice.enabled == (free_bytes is None or kept > ACTIVATION_SHARE * free_bytes)
    if choice.enabled:  # a larger row keeps it on
        assert choose_checkpointing(None, one_byte_row(kept + more), ONE_BYTE, device).enabled


@given(
    st.sampled_from(["cpu", "cuda", "xpu"]),
    st.sampled_from(["", " ", "/usr/lib/libjemalloc.so.2", "libtcmalloc.so"]),
    st.lists(st.sampled_from(MALLOC_ENVIRONMENT), unique=True).map(tuple),
    st.sampled_from(["glibc", "musl", ""]),
)
def test_freed_memory_is_kept_only_where_nobody_chose_the_allocator(
    device, preloaded, given_settings, libc
) -> None:
    choice = choose_host_memory(device, preloaded, given_settings, libc)
    alone = device == "cpu" and not preloaded.strip() and not given_settings and libc == "glibc"
    assert choice.retain is alone
    assert choice.reason
    if preloaded.strip() and device == "cpu":
        assert preloaded in choice.reason


@given(st.booleans(), st.integers(1, 10_000), st.integers(1, 500))
def test_kept_memory_is_given_back_once_every_trim_period(retain, first, steps) -> None:
    """Over any stretch of steps: one trim per TRIM_EVERY_STEPS steps where freed memory is
    kept (so the heap's growth between trims is bounded), none where glibc trims itself."""
    choice = HostMemoryChoice(retain, "why")
    trims = [step for step in range(first, first + steps) if trim_due(choice, step)]
    if not retain:
        assert trims == []
        return
    assert len(trims) in (steps // TRIM_EVERY_STEPS, steps // TRIM_EVERY_STEPS + 1)
    assert all(b - a == TRIM_EVERY_STEPS for a, b in itertools.pairwise(trims))


@given(
    st.one_of(st.none(), st.integers(1, 2**31 - 1)),
    st.lists(
        st.sampled_from([*MALLOC_ENVIRONMENT, "PATH", "MALLOC_ARENA_MAX", "LD_PRELOAD"]),
        unique=True,
    ).map(tuple),
)
def test_a_server_gets_a_fixed_mmap_threshold_only_where_nobody_chose_the_allocator(
    threshold, environment
) -> None:
    settings = server_allocator_environment(threshold, environment)
    chosen = any(name in MALLOC_ENVIRONMENT for name in environment)
    if threshold is None or chosen:
        assert settings == {}
    else:
        assert settings == {"MALLOC_MMAP_THRESHOLD_": str(threshold)}
