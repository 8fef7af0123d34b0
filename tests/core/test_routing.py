"""Routing groups to servers: properties over every set of server states."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.core.rollout.pacing import ServerLoad
from asyncgrpo.core.servers.routing import ServerView, eligible, load_key, load_of, route_group

loads = st.one_of(
    st.none(),
    st.builds(ServerLoad, st.floats(0, 1), st.integers(0, 300), st.integers(0, 300)),
)
views = st.builds(
    ServerView,
    routable=st.booleans(),
    version=st.integers(0, 12),
    reserved=st.integers(0, 300),
    cap=st.integers(1, 256),
    load=loads,
)
pools = st.lists(views, min_size=1, max_size=8)
steps = st.integers(0, 14)
staleness = st.integers(0, 4)


@given(pools, steps, staleness)
def test_a_group_goes_to_an_eligible_server_or_waits_when_there_is_none(pool, taken, ms) -> None:
    chosen = route_group(pool, taken, ms)
    able = [i for i, v in enumerate(pool) if eligible(v, taken, ms)]
    assert (chosen is None) == (not able)
    if chosen is not None:
        view = pool[chosen]
        assert view.routable and view.reserved < view.cap and taken - view.version <= ms


@given(pools, steps, staleness)
def test_the_chosen_server_is_the_least_loaded_for_its_capacity(pool, taken, ms) -> None:
    chosen = route_group(pool, taken, ms)
    if chosen is None:
        return
    best = load_key(pool[chosen], chosen)
    for index, view in enumerate(pool):
        if eligible(view, taken, ms):
            assert best <= load_key(view, index)
            assert load_of(pool[chosen]) / pool[chosen].cap <= load_of(view) / view.cap


@given(pools, steps, staleness, st.randoms(use_true_random=False))
def test_the_order_of_the_servers_only_breaks_exact_ties(pool, taken, ms, random) -> None:
    """Shuffled, the pool routes to a server in the same state (the same one unless another
    is in exactly the same state)."""
    order = list(range(len(pool)))
    random.shuffle(order)
    chosen = route_group(pool, taken, ms)
    shuffled = route_group([pool[i] for i in order], taken, ms)
    assert (chosen is None) == (shuffled is None)
    if chosen is not None:
        assert load_key(pool[chosen], 0)[:3] == load_key(pool[order[shuffled]], 0)[:3]


@given(pools, steps, staleness, st.integers(0, 7), st.integers(1, 100))
def test_more_load_on_another_server_does_not_change_the_choice(
    pool, taken, ms, other, extra
) -> None:
    chosen = route_group(pool, taken, ms)
    other %= len(pool)
    if chosen is None or other == chosen:
        return
    busier = list(pool)
    view = pool[other]
    busier[other] = ServerView(
        view.routable, view.version, view.reserved + extra, view.cap, view.load
    )
    assert route_group(busier, taken, ms) == chosen


@given(pools, steps, staleness)
def test_an_unroutable_or_lagging_server_never_gets_a_group_however_idle(pool, taken, ms) -> None:
    idle = [ServerView(v.routable, v.version, 0, v.cap) for v in pool]
    chosen = route_group(idle, taken, ms)
    for index, view in enumerate(idle):
        if not view.routable or taken - view.version > ms:
            assert chosen != index


@given(st.integers(1, 8), st.integers(1, 16), st.integers(1, 64), st.integers(1, 200))
def test_equal_servers_share_groups_evenly(servers, group, cap_groups, groups) -> None:
    """Routing groups one after another (none finishing) to servers of one capacity: until
    they are all full, no server holds two groups more than another."""
    cap = cap_groups * group
    reserved = [0] * servers
    for _ in range(groups):
        pool = [ServerView(True, 0, r, cap) for r in reserved]
        chosen = route_group(pool, 0, 0)
        if chosen is None:
            assert all(r >= cap for r in reserved)
            break
        reserved[chosen] += group
        assert max(reserved) - min(reserved) <= group or min(reserved) + group > cap


@given(st.lists(st.integers(1, 8), min_size=2, max_size=6), st.integers(1, 8), st.integers(1, 300))
def test_groups_follow_each_servers_capacity(capacities, group, groups) -> None:
    """Servers whose caps differ fill in proportion: at any time the fractions of their caps
    in use differ by at most one group's share of the smallest cap."""
    caps = [c * 16 for c in capacities]
    reserved = [0] * len(caps)
    for _ in range(groups):
        chosen = route_group(
            [ServerView(True, 0, r, c) for r, c in zip(reserved, caps, strict=True)], 0, 0
        )
        if chosen is None:
            break
        reserved[chosen] += group
        below = [r / c for r, c in zip(reserved, caps, strict=True) if r < c]
        if below and len(below) == len(caps):
            assert max(below) - min(below) <= group / min(caps) + 1e-9


def test_metrics_count_other_clients_and_ties_go_to_the_newer_version() -> None:
    """A server whose /metrics shows requests of another client is busier than this run's own
    count says; between equally loaded servers the newer policy wins."""
    crowded = ServerView(True, 5, reserved=2, cap=32, load=ServerLoad(0.1, 20, 4))
    quiet = ServerView(True, 5, reserved=4, cap=32, load=ServerLoad(0.1, 4, 0))
    assert route_group([crowded, quiet], steps_taken=5, max_staleness=0) == 1
    older, newer = ServerView(True, 4, 0, 8), ServerView(True, 5, 0, 8)
    assert route_group([older, newer], steps_taken=5, max_staleness=2) == 1
    for a, b in itertools.permutations([older, newer]):
        assert [a, b][route_group([a, b], 5, 2)] == newer


@given(st.integers(2, 4), st.integers(1, 40))
def test_idle_servers_take_turns(servers: int, groups: int) -> None:
    """One group at a time (each finishes before the next starts): every server takes one in
    turn, whatever its KV-cache use, so none is left without groups."""
    routed = [0] * servers
    for _ in range(groups):
        views = [
            ServerView(
                True, version=0, reserved=0, cap=8, routed=r, load=ServerLoad(0.01 * i, 0, 0)
            )
            for i, r in enumerate(routed)
        ]
        routed[route_group(views, steps_taken=0, max_staleness=0)] += 1
    assert max(routed) - min(routed) <= 1
