import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncgrpo.core.experiments import generator as generators
from asyncgrpo.core.experiments.hardware import GPUS, parameters_only

SEVEN_B = parameters_only(7e9, kv_bytes_per_token=57344)


@st.composite
def server_generators(draw):
    kind = draw(st.sampled_from(["constant", "fitted", "roofline"]))
    if kind == "constant":
        return generators.constant(draw(st.floats(10.0, 1e5)))
    if kind == "fitted":
        return generators.Generator(
            draw(st.floats(1e-5, 1e-2)),
            weight_read_s=draw(st.floats(0.0, 0.05)),
            kv_capacity_tokens=draw(st.floats(100.0, 1e6)),
        )
    return generators.roofline(
        GPUS[draw(st.sampled_from(["h100", "h200", "a100"]))],
        SEVEN_B,
        draw(st.sampled_from([1, 2, 4])),
    )


@st.composite
def requests(draw):
    n = draw(st.integers(1, 40))
    lengths = np.array(draw(st.lists(st.integers(1, 4000), min_size=n, max_size=n)), float)
    done = np.array(draw(st.lists(st.floats(0.0, 1.0), min_size=n, max_size=n)))
    prompts = np.array(draw(st.lists(st.integers(1, 2000), min_size=n, max_size=n)), float)
    return np.floor(lengths * done), lengths, prompts


def alone(generator, generated, lengths, prompts, seconds):
    """One server's requests advanced by themselves."""
    one = np.zeros(len(lengths), int)
    return generators.advance_servers(
        generator, generated, lengths, prompts, one, np.array([seconds], float)
    )


@settings(max_examples=80, deadline=None)
@given(server_generators(), requests(), st.just(0.0) | st.floats(1e-3, 5.0))
def test_decoding_advances_running_requests_within_their_lengths(generator, state, seconds):
    generated, lengths, prompts = state
    after = alone(generator, generated, lengths, prompts, seconds)
    assert np.all(after >= generated) and np.all(after <= lengths)
    moved = after > generated
    if seconds > 0 and np.any(generated < lengths):
        assert moved.any()  # the first unfinished request always runs
    # requests advance in arrival order: a request that moved has every earlier unfinished
    # one moving too (admission never skips a waiting request)
    unfinished = np.flatnonzero(generated < lengths)
    flags = moved[unfinished]
    assert not np.any(flags[1:] & ~flags[:-1])
    # those that moved fit the KV cache together (or are the one that always runs)
    running = unfinished[flags]
    if len(running) > 1:
        assert np.sum((prompts + generated)[running]) <= generator.kv_capacity_tokens


@settings(max_examples=80, deadline=None)
@given(
    server_generators(),
    requests(),
    st.integers(1, 6),
    st.data(),
)
def test_all_servers_at_once_advance_as_each_server_alone(generator, state, servers, data):
    generated, lengths, prompts = state
    on = np.array(
        data.draw(
            st.lists(st.integers(0, servers - 1), min_size=len(lengths), max_size=len(lengths))
        )
    )
    seconds = np.array(
        data.draw(st.lists(st.just(0.0) | st.floats(1e-3, 5.0), min_size=servers, max_size=servers))
    )
    together = generators.advance_servers(generator, generated, lengths, prompts, on, seconds)
    each = generated.copy()
    for server in range(servers):
        mine = on == server
        each[mine] = alone(
            generator, generated[mine], lengths[mine], prompts[mine], seconds[server]
        )
    # the KV sums are taken over all servers in one pass: equal up to rounding
    np.testing.assert_allclose(together, each, rtol=1e-9, atol=1e-9)


def test_a_server_advanced_with_another_servers_seconds_is_caught() -> None:
    """The comparison above can fail: swapping two servers' seconds changes their requests."""
    g = generators.Generator(1e-3, weight_read_s=0.01, kv_capacity_tokens=500.0)
    generated, lengths, prompts = np.zeros(4), np.full(4, 1000.0), np.full(4, 100.0)
    on = np.array([0, 1, 0, 1])
    right = generators.advance_servers(g, generated, lengths, prompts, on, np.array([0.5, 1.0]))
    swapped = generators.advance_servers(g, generated, lengths, prompts, on, np.array([1.0, 0.5]))
    by_itself = alone(g, generated[on == 0], lengths[on == 0], prompts[on == 0], 0.5)
    np.testing.assert_allclose(right[on == 0], by_itself)
    assert not np.allclose(swapped[on == 0], by_itself)


@settings(max_examples=60, deadline=None)
@given(server_generators(), st.integers(1, 512), st.floats(0.0, 4000.0))
def test_throughput_grows_with_requests_in_flight(generator, requests, context_each):
    """More requests never decode fewer tokens per second (the step's fixed cost is shared),
    and each request never decodes faster."""
    fewer = generator.tokens_per_s(requests, requests * context_each)
    more = generator.tokens_per_s(requests + 1, (requests + 1) * context_each)
    assert more >= fewer * (1 - 1e-9)
    assert more / (requests + 1) <= fewer / requests * (1 + 1e-9)


def test_a_constant_generator_shares_its_throughput() -> None:
    g = generators.constant(1000.0)
    after = alone(g, np.zeros(4), np.full(4, 1e6), np.zeros(4), 2.0)
    assert after.sum() == pytest.approx(2000.0)


def test_the_roofline_is_bound_by_reading_then_by_compute_and_by_kv() -> None:
    g = generators.roofline(GPUS["h100"], SEVEN_B, 1)
    assert g.tokens_per_s(1) == pytest.approx(3.35e12 / 14e9)
    assert g.tokens_per_s(1e6) == pytest.approx(0.5 * 989e12 / 14e9, rel=1e-3)
    assert g.tokens_per_s(256, 256 * 4000) < g.tokens_per_s(256, 0)  # KV reads cost
    bigger = generators.roofline(GPUS["h100"], SEVEN_B, 2)
    assert bigger.kv_capacity_tokens > 2 * g.kv_capacity_tokens  # one copy of the weights less
    with pytest.raises(ValueError, match="raise the tensor-parallel size"):
        generators.roofline(GPUS["h100"], parameters_only(70e9, 327680), 1)


@settings(max_examples=60, deadline=None)
@given(
    st.floats(1e-4, 0.05),
    st.floats(1e-6, 1e-3),
    st.lists(st.integers(1, 512), min_size=2, max_size=6, unique=True),
)
def test_a_fit_over_concurrencies_recovers_the_step_time(fixed_s, per_request_s, concurrency):
    points = [(c, c / (fixed_s + per_request_s * c)) for c in concurrency]
    fitted = generators.fit_concurrency(points)
    for c in concurrency:
        assert fitted.tokens_per_s(c) == pytest.approx(c / (fixed_s + per_request_s * c), rel=1e-6)


@settings(max_examples=40, deadline=None)
@given(server_generators(), st.floats(1.0, 64.0), st.integers(1, 300), st.floats(0.0, 3000.0))
def test_counting_in_units_keeps_the_seconds(generator, unit, running, context_each):
    """A response of L tokens takes as long counted in units of ``unit`` tokens."""
    coarse = generators.in_units(generator, unit)
    fine_s = generator.step_s(running, running * context_each)
    assert coarse.step_s(running, running * context_each / unit) == pytest.approx(unit * fine_s)
    assert math.isinf(coarse.kv_capacity_tokens) or coarse.kv_capacity_tokens == pytest.approx(
        generator.kv_capacity_tokens / unit
    )


def test_a_published_figure_scales_the_roofline() -> None:
    roofline = generators.roofline(GPUS["h100"], SEVEN_B, 1)
    scaled = generators.scaled_to(roofline, 2500.0, 64, 64 * 2000, "a benchmark")
    assert scaled.tokens_per_s(64, 64 * 2000) == pytest.approx(2500.0)
    assert scaled.source == "a benchmark"
    assert scaled.kv_capacity_tokens == roofline.kv_capacity_tokens
