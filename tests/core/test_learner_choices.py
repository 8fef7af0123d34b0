"""The learner's precision, checkpointing and freed-memory decisions: a setting in the config
(or the environment, for the allocator) always wins, and the automatic choice is monotone in
what it weighs."""

from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.core.packing.host_memory import MALLOC_ENVIRONMENT, choose_host_memory
from asyncgrpo.core.packing.memory import (
    ACTIVATION_SHARE,
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


@given(tokens, st.integers(1, 64), widths, widths, widths, st.integers(1, 64), tokens)
def test_a_row_keeps_more_with_more_tokens_and_layers(
    count, layers, hidden, kv_width, intermediate, heads, more
) -> None:
    shape = dict(hidden=hidden, kv_width=kv_width, intermediate=intermediate, heads=heads)
    kept = activation_bytes(count, layers, bytes_per_value=2, **shape)
    assert activation_bytes(count + more, layers, bytes_per_value=2, **shape) > kept
    assert activation_bytes(count, 2 * layers, bytes_per_value=2, **shape) == 2 * kept
    assert activation_bytes(count, layers, bytes_per_value=4, **shape) == 2 * kept


kept_bytes = st.integers(0, 2**40)
free = st.none() | st.integers(0, 2**40)


@given(st.booleans(), kept_bytes, free)
def test_configured_checkpointing_is_used_as_given(requested, kept, free_bytes) -> None:
    assert choose_checkpointing(requested, kept, free_bytes).enabled is requested


@given(kept_bytes, free, kept_bytes)
def test_checkpointing_turns_on_past_a_share_of_free_memory(kept, free_bytes, more) -> None:
    choice = choose_checkpointing(None, kept, free_bytes)
    assert choice.enabled == (free_bytes is None or kept > ACTIVATION_SHARE * free_bytes)
    if choice.enabled:  # a larger row keeps it on
        assert choose_checkpointing(None, kept + more, free_bytes).enabled


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
