import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.core.experiments.recommend import (
    GPUS,
    PACED_STALENESS,
    WASTE_TOLERANCE,
    Candidate,
    Prediction,
    Throughputs,
    candidates,
    gpu_throughputs,
    paced_to_confirm,
    recommend,
    scaled_throughputs,
)


@given(st.integers(2, 24), st.none() | st.integers(1, 8))
def test_candidates_are_valid_splits_and_cover_every_one(devices, max_servers) -> None:
    found = candidates(devices, max_servers=max_servers)
    assert len(set(found)) == len(found)
    for c in found:
        generation = c.generation_devices(devices)
        assert c.train_devices >= 1 and generation >= 1 and generation % c.servers == 0
        assert c.servers <= (max_servers or generation)
        assert c.max_staleness >= c.weight_sync_steps - 1  # the config refuses the rest
    assert {c.train_devices for c in found} == set(range(1, devices))
    assert {(c.max_staleness, c.weight_sync_steps) for c in found} == {
        (0, 1),
        (1, 1),
        (1, 2),
        (2, 1),
        (2, 2),
        (4, 1),
        (4, 2),
        (4, 4),
    }


def test_one_device_cannot_be_split() -> None:
    with pytest.raises(ValueError, match="at least 2 devices"):
        candidates(1)


@given(st.integers(2, 32), st.data())
def test_scaling_keeps_total_generation_per_device(devices, data) -> None:
    """However the generation devices are shared, the servers together generate as much per
    device as the measured server; fixed costs and the push stay as measured."""
    chosen = data.draw(st.sampled_from(candidates(devices)))
    measured = Throughputs(1000.0, 0.2, 0.01, 300.0, 0.5)
    scaled = scaled_throughputs(measured, 2, 3, chosen, devices)
    total = scaled.generation_tokens_per_s * chosen.servers
    assert total == pytest.approx(300.0 / 3 * chosen.generation_devices(devices))
    assert scaled.training_tokens_per_s == pytest.approx(500.0 * chosen.train_devices)
    assert (scaled.training_fixed_s, scaled.training_per_sample_s, scaled.weight_sync_s) == (
        0.2,
        0.01,
        0.5,
    )


def _prediction(staleness_setting, samples_per_s, staleness, servers=1, sync_steps=1):
    return Prediction(
        Candidate(1, servers, staleness_setting, sync_steps), samples_per_s, 1.0, staleness, 0.0
    )


@given(
    st.lists(
        st.tuples(st.sampled_from([0, 1, 2, 4]), st.floats(1.0, 100.0), st.floats(0.0, 4.0)),
        min_size=1,
        max_size=12,
    )
)
def test_recommend_is_within_tolerance_of_the_best_and_freshest_there(rows) -> None:
    predictions = [_prediction(*row) for row in rows]
    chosen = recommend(predictions)
    best = max(p.samples_per_s for p in predictions)
    assert chosen.samples_per_s >= 0.95 * best
    close = [p for p in predictions if p.samples_per_s >= 0.95 * best]
    assert round(chosen.staleness, 2) == min(round(p.staleness, 2) for p in close)


def test_a_staler_setting_must_buy_five_percent_more_samples() -> None:
    fresh = _prediction(0, 10.0, 0.0)
    assert recommend([fresh, _prediction(4, 10.4, 3.0)]) == fresh
    stale = _prediction(4, 10.6, 3.0)
    assert recommend([fresh, stale]) == stale
    # the same figures: fewer servers and fewer steps between pushes first
    one, two = _prediction(1, 10.0, 0.9, servers=1), _prediction(1, 10.0, 0.9, servers=2)
    assert recommend([two, one]) == one
    with pytest.raises(ValueError, match="no predictions"):
        recommend([])


def test_gpu_throughputs_follow_the_published_figures() -> None:
    """Decoding a few requests is bound by reading the weights, many by compute; a bigger
    model trains proportionally slower; an H200 decodes faster than an H100 (bandwidth)."""
    small = gpu_throughputs(GPUS["h100"], 1e9, concurrency=1)
    assert small.generation_tokens_per_s == pytest.approx(3.35e12 / 2e9)
    many = gpu_throughputs(GPUS["h100"], 1e9, concurrency=1024)
    assert many.generation_tokens_per_s == pytest.approx(0.5 * 989e12 / 2e9)
    big = gpu_throughputs(GPUS["h100"], 8e9, concurrency=1)
    assert big.training_tokens_per_s == pytest.approx(small.training_tokens_per_s / 8)
    h200 = gpu_throughputs(GPUS["h200"], 1e9, concurrency=1)
    assert h200.generation_tokens_per_s > small.generation_tokens_per_s
    with pytest.raises(ValueError):
        gpu_throughputs(GPUS["h100"], 0.0, concurrency=1)


@given(
    st.lists(
        st.tuples(st.sampled_from([0, 1, 2, 4]), st.floats(1.0, 100.0), st.booleans()),
        min_size=1,
        max_size=12,
    )
)
def test_paced_settings_near_the_best_are_confirmed_whole_until_none_is_left(rows) -> None:
    """Confirming a paced setting whole lowers its figure (a share overrates it); confirming
    until none is left leaves no paced setting on a share within 5% of the best, and the
    recommendation is made from figures none of which is a paced setting's share."""
    predictions = {
        Candidate(i + 1, 1, staleness, 1): Prediction(
            Candidate(i + 1, 1, staleness, 1), rate, 1.0, float(staleness), 0.0
        )
        for i, (staleness, rate, _) in enumerate(rows)
    }
    whole = {c for c, (_, _, is_whole) in zip(predictions, rows, strict=True) if is_whole}
    confirmed = []
    while doubtful := paced_to_confirm(predictions.values(), whole):
        for c in doubtful:
            assert c.max_staleness <= PACED_STALENESS and c not in whole
            old = predictions[c]
            predictions[c] = Prediction(c, 0.8 * old.samples_per_s, 1.0, old.staleness, 0.0)
            whole.add(c)
            confirmed.append(c)
    assert len(confirmed) == len(set(confirmed))
    top = max(p.samples_per_s for p in predictions.values())
    chosen = recommend(list(predictions.values()))
    assert chosen.candidate.max_staleness > PACED_STALENESS or chosen.candidate in whole
    for c, p in predictions.items():
        if c.max_staleness <= PACED_STALENESS and c not in whole:
            assert p.samples_per_s < 0.95 * top


@given(
    st.lists(
        st.tuples(
            st.sampled_from([0, 1, 2, 4]),
            st.floats(1.0, 100.0),
            st.floats(0.0, 4.0),
            st.floats(0.0, 2000.0),
        ),
        min_size=1,
        max_size=12,
    )
)
def test_the_recommended_setting_wastes_no_more_generation_than_the_thriftiest_close_one(
    rows,
) -> None:
    """Dropped samples weigh in before staleness: the choice drops at most 1 point more of
    its generation than the least wasteful setting within 5% of the best, and is the
    freshest of those that do."""
    predictions = [
        attrs.evolve(_prediction(s, rate, stale), dropped_per_step=dropped, samples_per_step=8192)
        for s, rate, stale, dropped in rows
    ]
    chosen = recommend(predictions)
    best = max(p.samples_per_s for p in predictions)
    close = [p for p in predictions if p.samples_per_s >= 0.95 * best]
    least = min(p.wasted_frac for p in close)
    assert chosen.wasted_frac <= least + WASTE_TOLERANCE
    thrifty = [p for p in close if p.wasted_frac <= least + WASTE_TOLERANCE]
    assert round(chosen.staleness, 2) == min(round(p.staleness, 2) for p in thrifty)


def test_a_fresher_setting_that_drops_more_is_not_chosen() -> None:
    """The case of the 1.5B plan on 128 GPUs: within 5% of each other, the fresher drops 662
    of 8,192 samples a step, the staler 290; the staler is chosen (without the drops counted,
    the fresher would be)."""
    fresher = attrs.evolve(
        _prediction(2, 140.0, 1.4), dropped_per_step=662.0, samples_per_step=7530.0
    )
    staler = attrs.evolve(
        _prediction(4, 145.0, 2.6), dropped_per_step=290.0, samples_per_step=7902.0
    )
    assert recommend([fresher, staler]) == staler
    counted_out = [attrs.evolve(p, dropped_per_step=0.0) for p in (fresher, staler)]
    assert recommend(counted_out).candidate.max_staleness == 2
